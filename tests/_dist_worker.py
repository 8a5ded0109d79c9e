"""Worker processes of the data-parallel tests: one rank of a gloo group on the CPU, training tiny
zoo models through tinypipe replicas (spawned by tests/test_distributed_*.py)."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

LR, EPS, WD = 1e-3, 1e-6, 0.1
SEQ = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make(spec: dict) -> torch.nn.Module:
    from model_zoo import make_model
    from reference import randomize_biases

    model = make_model(spec.get("family", "llama"), layers=spec.get("layers", 4), seed=spec.get("seed", 0))
    randomize_biases(model)
    if not spec.get("lora"):
        return model
    from tinypipe.lora import LoraSettings, apply_lora

    pm = apply_lora(model, LoraSettings(rank=4, alpha=8.0))
    from test_lora import randomize_lora_b

    return randomize_lora_b(pm)


def batches(spec: dict) -> list[dict]:
    from model_zoo import make_batch

    return [make_batch(spec["batch"], SEQ, seed=i, pad=i == 1) for i in range(spec["steps"])]


def _sabotage(kind: str) -> None:
    """Deliberately wrong variants, to show the tests' tolerances catch them."""
    from tinypipe.distributed import group, reduce

    if kind == "local_tokens":  # each replica normalises by its own tokens only
        group.Replicas.total_tokens = lambda self, tokens: tokens  # type: ignore[method-assign]
    elif kind == "double_reduce":  # every gradient summed twice
        real = reduce.reduce_gradient

        def twice(coll, acc, n, shard, norm):  # type: ignore[no-untyped-def]
            real(coll, acc, n, None, norm).wait()
            return real(coll, acc, n, shard, norm)
        import tinypipe.runtime.transfer_handlers as transfer  # where the reduce task looks it up

        assert transfer.reduce_gradient is real, "the reduce task no longer calls reduce_gradient from here"
        transfer.reduce_gradient = twice  # type: ignore[assignment]


def train(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    """Train ``spec`` as rank ``rank`` of ``world``; write this rank's results to ``out``."""
    torch.set_num_threads(1)
    if spec.get("cuda"):  # fp32 matmuls, as the CPU reference computes them
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    import tinypipe

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        if spec.get("sabotage"):
            _sabotage(spec["sabotage"])
        model = make(dict(spec, seed=spec.get("seed_of", {}).get(rank, spec.get("seed", 0))))
        cfg = dict(spec.get("cfg", {}))
        cfg.update(spec.get("cfg_of", {}).get(rank, {}))
        extra = {"dp_heartbeat_s": spec.get("heartbeat", 10.0), "dp_timeout_s": spec.get("timeout", 60.0),
                 **spec.get("extra", {})}
        config = tinypipe.Config(devices=cfg.pop("devices", ["cpu"]), lr=LR, eps=EPS, weight_decay=WD,
                                 head_chunk_tokens=7, extra=extra, **cfg)
        engine = tinypipe.Engine(model, config)
        poison = spec.get("poison")  # (rank, step, layer): NaN into that rank's local gradient
        steps_run = [0]
        if poison is not None and poison[0] == rank:
            from tinypipe.schedule.ids import reduce_id

            def fault(task):  # type: ignore[no-untyped-def]
                if steps_run[0] == poison[1] and task.id == reduce_id(poison[2]):
                    slot = task.grad_slots[0] if task.grad_slots else None
                    engine.devices[task.device].pool.grads(poison[2], slot)[:5].fill_(float("nan"))
            engine.fault = fault
        results = []
        start = 0
        if spec.get("resume"):
            start = engine.load_checkpoint(spec["ckpt"])["next"]
        for i, b in enumerate(batches(spec)):
            if i < start:
                continue
            if spec.get("fault_rank") == rank and i == spec.get("fault_step", 1):
                Path(out + ".ready").write_text("x")
                # SIGKILL: a dead rank; SIGSTOP: a hung one (its heartbeat stops too)
                os.kill(os.getpid(), signal.SIGSTOP if spec.get("fault") == "hang" else signal.SIGKILL)
            results.append(engine.step(b))
            steps_run[0] += 1
            if spec.get("save_at") == i + 1 and not spec.get("resume"):
                engine.save_checkpoint(spec["ckpt"], extra={"next": i + 1})
        if spec.get("pretrained"):
            engine.save_pretrained(spec["pretrained"])
        state = {k: v.clone() for k, v in engine.state_dict().items()}
        torch.save({"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
                    "clipped": [r.clipped for r in results], "state": state,
                    "skipped": [r.skipped for r in results],
                    "rss_optimizer": engine.store.optimizer_bytes, "sharding": engine.plan.optimizer_sharding,
                    "plan": engine.plan.to_json(),
                    "trace": sorted({e["lane"] for e in engine.step_timeline()})}, out)
        engine.close()
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - the parent reads the message
        Path(out + ".err").write_text(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    """``python _dist_worker.py RANK WORLD PORT SPEC_PT OUT`` (a subprocess rank)."""
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    spec = torch.load(sys.argv[4], weights_only=False)
    train(rank, world, port, spec, sys.argv[5])


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
