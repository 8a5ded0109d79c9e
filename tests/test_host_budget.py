"""The host-memory check before the store is built counts what the build really adds.

A model built in Python (not by tinypipe's loader) hands its parameters' storage over layer by
layer: the store copies a layer and re-points the parameters, and the old storage is freed. The
check used to count the master copy on top of the model's own parameters, and refused W3 with
clipping on a 128 GiB machine that held it (bench/RESULTS.md, session 7).
"""

from __future__ import annotations

import pytest

import tinypipe
from model_zoo import make_model
from tinypipe.errors import PlanDoesNotFitError
from tinypipe.memory import budget


def _engine(model, **kw):
    return tinypipe.Engine(model, tinypipe.Config(devices=["cpu"], pack_size=1, micro_batch_size=2, **kw))


@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_models_own_storage_counts_as_freed(monkeypatch: pytest.MonkeyPatch, clip: float | None) -> None:
    model = make_model("llama", layers=4)
    params = sum(p.numel() for p in model.parameters())
    per = 8 + 4 + (4 if clip else 0)  # moments + master + retained gradient
    # between the new need (the model's 4 B/param handed over, less one layer) and the old one
    monkeypatch.setattr(budget, "host_available", lambda: (per - 2) * params)
    engine = _engine(model, max_grad_norm=clip)
    engine.close()


def test_a_budget_below_the_store_still_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model("llama", layers=4)
    params = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(budget, "host_available", lambda: 7 * params)  # the store adds >= 8 B/param
    with pytest.raises(PlanDoesNotFitError, match="host memory"):
        _engine(model)


# ------------------------------------------------------------------ replicas sharing a node's memory


def _resolve(cpu_gib: float, sharding: str):
    from tinypipe.distributed.group import Replicas
    from tinypipe.distributed.topology import Topology
    from tinypipe.runtime.replica_setup import resolve_replica_plan

    model = make_model("llama", layers=4)
    two_on_a_node = Replicas(topology=Topology(0, 2, 0, 2), host=None, gather=None)  # type: ignore[arg-type]
    cfg = tinypipe.Config(devices=["cpu"], seq_len=16, global_batch=4, optimizer_sharding=sharding,
                          cpu_memory_bytes=int(cpu_gib * 2**30))
    return resolve_replica_plan(model, cfg, two_on_a_node, num_blocks=4, tied=False, plan=None)


@pytest.mark.parametrize("sharding", ["shard", "replicate", "auto"])
def test_a_forced_sharding_is_planned_for_the_nodes_processes(sharding: str) -> None:
    """Two replica processes on one node share its host memory, also when the sharding is forced:
    each process's overhead (~3 GiB) counts twice, so 4.5 GiB -- enough for one lone engine -- is
    refused (a forced "shard" used to be planned as a lone engine with the whole node's memory)."""
    plan, result = _resolve(64, sharding)
    assert plan.replicas == 2 and result is not None
    assert plan.optimizer_sharding == (sharding if sharding != "auto" else plan.optimizer_sharding)
    with pytest.raises(PlanDoesNotFitError, match="2 x 1"):
        _resolve(4.5, sharding)
