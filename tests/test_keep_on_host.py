"""Kept graphs in host memory (``Plan.kept_on_host``, runtime/host_kept.py): a kept pack's saved
activations go to host buffers in its forward and come back one backward task ahead.

Training through them must equal plain PyTorch (fp32, the tolerances of tests/test_equivalence.py)
-- streamed packs whose backward runs in other slots, full graphs (eager) and compiled compact ones
(AOT autograd: the compact set goes through the hooks), one and two devices, several forward
micro-batches per backward one, clipping -- and equal the same plan kept on the device bit for bit.
The host buffers are reused from step to step, and a graph that never came back is an error, not
a silent recompute.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import train_plan_against_reference
from tinypipe.runtime.host_kept import HostKeptGraph
from tinypipe.schedule.plan import make_plan

LR, EPS, WD = 1e-3, 1e-6, 0.1
BATCH, SEQ, STEPS = 5, 12, 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _plan(layers: int, keep: list[bool], host: list[bool], devices: int = 1, tied: bool = False,
          **knobs) -> tinypipe.Plan:
    base = dict(pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, prefetch_window=2,
                stash="device")
    base.update(knobs)
    plan = make_plan(layers, num_devices=devices, tied=tied, keep_activations=keep, **base)
    return dataclasses.replace(plan, kept_on_host=tuple(host))


CASES = {
    # window 2: packs 1 and 2 run their backward in other slots than their forward
    "streamed_other_slots": (4, [False, True, True, False], [False, True, True, False], {}, 1),
    # host-kept next to device-kept; clipping triggers; backward micro-batch = 2 forward ones
    "mixed_mb1_bwd2_clip": (4, [True, True, False, True], [True, False, False, True],
                            dict(micro_batch_size=1, backward_micro_batch_size=2, max_grad_norm=0.5), 1),
    "compiled_compact": (4, [False, True, True, False], [False, True, True, False],
                         dict(compile_blocks="aot_eager"), 1),
    "two_devices": (6, [True] * 6, [True, False, True, False, True, False], {}, 2),
}
ENGINE_KNOBS = ("max_grad_norm", "compile_blocks")


def _run(family: str, name: str, on_host: bool = True, device: str = "cpu") -> tuple[tinypipe.Engine, list, dict]:
    layers, keep, host, knobs, devices = CASES[name]
    cfg = {k: knobs.pop(k) for k in list(knobs) if k in ENGINE_KNOBS}
    model = make_model(family, layers=layers)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    plan = _plan(layers, keep, host if on_host else [False] * len(host), devices, tied, **knobs)
    batches = [make_batch(BATCH, SEQ, seed=i, pad=i == 1) for i in range(STEPS)]
    config = tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD, head_chunk_tokens=7, devices=[device] * devices,
                             **cfg)
    engine, results = train_plan_against_reference(model, plan, batches, config)
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    return engine, [(r.loss, r.grad_norm) for r in results], state


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("name", list(CASES))
def test_host_kept_packs_match_pytorch(family: str, name: str) -> None:
    engine, _, _ = _run(family, name)
    plan = engine.plan
    assert any(plan.on_host(q) for q in range(plan.num_packs))
    assert engine.resources.host_kept.nbytes > 0  # the graphs went through the host buffers
    engine.close()


def test_host_kept_equals_device_kept_bit_for_bit() -> None:
    """The same plan with the graphs kept on the device: the same tensors come back, so losses,
    norms and weights are identical."""
    a, steps_a, state_a = _run("llama", "streamed_other_slots", on_host=True)
    b, steps_b, state_b = _run("llama", "streamed_other_slots", on_host=False)
    a.close()
    b.close()
    assert steps_a == steps_b
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_host_buffers_are_reused_across_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later step of the same shapes allocates no host buffer (the first step's are reused);
    its device copies are new (one per saved tensor)."""
    made = {"host": 0, "device": 0}
    original = torch.empty_strided

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        made["host" if "pin_memory" in kwargs else "device"] += 1
        return original(*args, **kwargs)

    engine, _, _ = _run("llama", "streamed_other_slots")
    size = engine.resources.host_kept.nbytes
    monkeypatch.setattr(torch, "empty_strided", counting)
    engine.step(make_batch(BATCH, SEQ, seed=9))  # the shapes of the last step (no padding)
    monkeypatch.undo()
    engine.close()
    assert engine.resources.host_kept.nbytes == size
    assert made["host"] == 0 and made["device"] > 0, made


def test_a_graph_that_never_came_back_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """With its copy back switched off, the backward fails loudly (no stale or missing tensor is
    used silently)."""
    monkeypatch.setattr(HostKeptGraph, "prefetch", lambda self: None)
    with pytest.raises(tinypipe.WorkerError, match="not ready"):
        _run("llama", "streamed_other_slots")


def test_kept_on_host_needs_a_kept_pack() -> None:
    plan = make_plan(4, pack_size=1, micro_batch_size=2, backward_micro_batch_size=2, num_devices=1,
                     prefetch_window=1, stash="device", tied=False, keep_activations=[True, False, False, False])
    with pytest.raises(tinypipe.ConfigError, match="does not keep"):
        dataclasses.replace(plan, kept_on_host=(False, True, False, False))
    with pytest.raises(tinypipe.ConfigError, match="per pack"):
        dataclasses.replace(plan, kept_on_host=(True,))
    host = dataclasses.replace(plan, kept_on_host=(True, False, False, False))
    assert host.describe().endswith("(in host memory: 0)")
    assert type(host).from_json(host.to_json()) == host


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["streamed_other_slots", "mixed_mb1_bwd2_clip"])
def test_cuda_host_kept_match_pytorch(name: str) -> None:
    """On CUDA, blocks compiled by Inductor (compact graphs through the hooks), page-locked host
    buffers, side-stream copies: still equal to plain PyTorch (fp32, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    engine, _, _ = _run("llama", name, device="cuda:0")
    assert engine.compile_backend == "inductor" and engine.resources.host_kept.nbytes > 0
    engine.close()
