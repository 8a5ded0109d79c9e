"""One process as a one-rank process group (``Config.extra["dp_single_rank"]``): every collective of
the replicas runs -- the per-layer reductions on each device's collective lane (NCCL for CUDA
tensors), the sharded optimizer's reduce-scatter / norm all-reduce / all-gather, the host group's
token and loss sums, the start-up fingerprint, the sharded checkpoint -- each an identity over one
rank, so the run must equal the same engine without replicas bit for bit. The one way to run the
NCCL path on a machine with one GPU (NCCL refuses two ranks on one GPU).

``python _dist_single.py SPEC_PT OUT_PT``: spec = {"cases": {name: case}, "store": path}; for each
case trains the plain engine (twice on CUDA: the device's own run-to-run determinism is the bar)
and the one-rank replica, saves after ``save_at`` steps and resumes a fresh replica from there.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS: the same sums every run

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = Path(__file__).resolve().parent


def _config(case: dict, replicas: bool) -> object:
    import tinypipe
    from _dist_worker import EPS, LR, WD

    cfg = dict(case["cfg"])
    extra = {"dp_single_rank": True, "dp_heartbeat_s": 10.0, "dp_timeout_s": 120.0} if replicas else {}
    return tinypipe.Config(devices=cfg.pop("devices", ["cpu"]), lr=LR, eps=EPS, weight_decay=WD,
                           head_chunk_tokens=7, extra=extra, **cfg)


def _poison(engine: object, case: dict, replicas: bool, steps_run: list[int]) -> None:
    """(step, layer): NaN into that layer's local gradient before it is reduced (replicas) or
    downloaded (alone) -- the same gradient either way."""
    if case.get("poison") is None:
        return
    step, layer = case["poison"]
    from tinypipe.schedule.ids import download_id, reduce_id

    target = reduce_id(layer) if replicas else download_id(layer)

    def fault(task):  # type: ignore[no-untyped-def]
        if steps_run[0] == step and task.id == target:
            slot = task.grad_slots[0] if task.grad_slots else None
            grads = engine.devices[task.device].pool.grads  # type: ignore[attr-defined]
            grads(layer, slot)[:5].fill_(float("nan"))
    engine.fault = fault  # type: ignore[attr-defined]


def _train(case: dict, replicas: bool, *, start: int = 0, ckpt: str | None = None) -> dict:
    import tinypipe
    from _dist_worker import batches, make

    engine = tinypipe.Engine(make(case), _config(case, replicas))  # type: ignore[arg-type]
    assert (engine.replicas is not None) == replicas
    steps_run = [start]
    _poison(engine, case, replicas, steps_run)
    if start:
        assert ckpt is not None
        assert engine.load_checkpoint(ckpt)["next"] == start
    results = []
    for i, b in enumerate(batches(case)):
        if i < start:
            continue
        results.append(engine.step(b))
        steps_run[0] += 1
        if ckpt is not None and not start and case.get("save_at") == i + 1:
            engine.save_checkpoint(ckpt, extra={"next": i + 1})
    out = {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
           "clipped": [r.clipped for r in results], "skipped": [r.skipped for r in results],
           "state": {k: v.detach().cpu().clone() for k, v in engine.state_dict().items()},
           "sharding": engine.plan.optimizer_sharding,
           "lanes": sorted({e["lane"] for e in engine.step_timeline()}),
           "optimizer_bytes": engine.store.optimizer_bytes,
           "backends": [] if engine.replicas is None else
           [c.backend for _, c in sorted(engine.replicas.grads.items())]}
    engine.close()
    return out


def run_case(case: dict, ckpt: str) -> dict:
    """The plain engine (twice on CUDA), the one-rank replica (saving) and its resumed tail."""
    cuda = any(d.startswith("cuda") for d in case["cfg"].get("devices", ["cpu"]))
    out = {"plain": _train(case, False), "replica": _train(case, True, ckpt=ckpt)}
    if cuda:
        out["plain_again"] = _train(case, False)
    if case.get("save_at"):
        out["ckpt_files"] = sorted(p.name for p in Path(ckpt).iterdir())
        out["resumed"] = _train(case, True, start=case["save_at"], ckpt=ckpt)
    return out


def main() -> None:
    sys.path.insert(0, str(HERE))
    spec = torch.load(sys.argv[1], weights_only=False)
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # the host group is gloo whatever the devices; each CUDA device's lane gets its own NCCL group
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for name, case in spec["cases"].items():
            results[name] = run_case(case, str(Path(spec["store"]).parent / f"ckpt-{name}"))
        torch.save(results, sys.argv[2])
    except BaseException as exc:  # noqa: BLE001 - the parent reads the message
        Path(sys.argv[2] + ".err").write_text(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise SystemExit(1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
