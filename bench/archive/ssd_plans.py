#!/usr/bin/env python3
"""``tinypipe plan`` for full fine-tuning of models whose training state does not fit DRAM, on one
24 GiB GPU + 128 GiB of host memory + an SSD of stated speed (default: the H200 box's disk, O_DIRECT
measured there: 1.6 GB/s read, 2.4 GB/s write): what goes where (per kind of state: layers and bytes
on the SSD and in DRAM, the staging pools, the scratch file), the predicted step time and tokens/s,
what bounds the step, and the global batch from which the SSD's I/O is hidden. Offline, from the
presets: no GPU, no weights, no disk (``--ssd-read-gbps``/``--ssd-write-gbps`` state the rates; no
free-space check).

    python bench/archive/ssd_plans.py                       # -> bench/results/s5_ssd_plans.txt
    python bench/archive/ssd_plans.py --hardware rtx4090-pcie4 --out /tmp/plans_4090.txt

How long (one CPU core): a few seconds per model for the plan, up to a minute or two for the
hiding-batch search where the chosen plan's own knobs cannot hide the I/O (it re-plans at 2x, 4x
... the batch).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from tinypipe.cli import main as cli_main  # noqa: E402

#: Llama-2-13B, Qwen2.5-14B, a 30B (LLaMA-30B) and a 70B (Llama-3.1-70B): the issue's four.
MODELS = ("llama-2-13b", "qwen2.5-14b", "llama-30b", "llama-3.1-70b")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "s5_ssd_plans.txt")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated presets")
    ap.add_argument("--hardware", default="h200-pcie5",
                    help="GPU/link/CPU preset (capped at --gpu-memory)")
    ap.add_argument("--gpu-memory", default="24GiB")
    ap.add_argument("--cpu-memory", default="128GiB")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--ssd-read-gbps", type=float, default=1.6)
    ap.add_argument("--ssd-write-gbps", type=float, default=2.4)
    ap.add_argument("--max-grad-norm", type=float, default=None)
    ap.add_argument("--out", default=OUT)
    return ap.parse_args(argv)


#: GPU sizes tried, in order, for a model that the GPU budget refuses whatever is on the SSD (the
#: 70B: its resident embedding and head, two layer slots and their fp32 gradients exceed 24 GiB).
LARGER_GPUS = ("32GiB", "48GiB")


def plan_text(a: argparse.Namespace, model: str, gpu_memory: str | None = None) -> tuple[int, str]:
    """``tinypipe plan``'s exit code and output (stdout + stderr) for ``model``."""
    argv = ["plan", "--model", model, "--hardware", a.hardware, "--gpu-memory", gpu_memory or a.gpu_memory,
            "--cpu-memory", a.cpu_memory, "--seq-len", str(a.seq_len), "--global-batch", str(a.global_batch),
            "--ssd-read-gbps", str(a.ssd_read_gbps), "--ssd-write-gbps", str(a.ssd_write_gbps)]
    if a.max_grad_norm is not None:
        argv += ["--max-grad-norm", str(a.max_grad_norm)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = cli_main(argv)
    return code, f"$ tinypipe {' '.join(argv)}\n{buf.getvalue().rstrip()}\nexit {code}"


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    sections = [f"# tinypipe plan, full fine-tuning, 1 x {a.gpu_memory} ({a.hardware}) + {a.cpu_memory} host "
                f"+ an SSD of {a.ssd_read_gbps} GB/s read / {a.ssd_write_gbps} GB/s write (stated), "
                f"{a.global_batch} x {a.seq_len} tokens per step (bench/archive/ssd_plans.py)"]
    worst = 0
    for model in [m for m in a.models.split(",") if m]:
        t0 = time.perf_counter()
        code, text = plan_text(a, model)
        for gpu in LARGER_GPUS if code and "GPU memory per device" in text else ():
            code, more = plan_text(a, model, gpu)
            text += f"\n\n# the GPU budget refuses {model}; the smallest GPU tried that fits:\n{more}"
            if code == 0:
                break
        worst = max(worst, code)
        sections.append(f"{text}\n({time.perf_counter() - t0:.0f} s to plan)")
        print(sections[-1], flush=True)
        print(flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n\n".join(sections) + "\n")
    print(f"wrote {a.out}")
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
