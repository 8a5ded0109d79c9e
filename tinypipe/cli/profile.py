"""``tinypipe profile``: measure per-layer times, link bandwidth and the CPU optimizer for the planner.

    tinypipe profile --device cuda:0 --model llama-3.2-3b --seq-lens 1024,2048 --micro-batches 1,2,4 \\
                     --output profile.json
    tinypipe plan --model llama-3.2-3b --hardware profile.json --seq-len 2048 --global-batch 16 ...

``--offload-dir DIR`` also measures DIR's direct-I/O read/write rates for the SSD tier
(``ssd_read_gbps`` / ``ssd_write_gbps``; ``plan --hardware profile.json --offload-dir DIR`` uses them),
and the rate with reads and writes in flight together (one drive serves them in turn). Several
drives: ``--offload-dir A,B`` measures each directory alone, then all of them striped; the striped
set's rates are the profile's ``ssd_read_gbps`` / ``ssd_write_gbps`` (what the planner uses), each
directory's are under ``ssd.directories``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Sequence

PROG = "tinypipe profile"
DEFAULT_MODEL = "llama-3.2-3b"
#: Bytes written and read back per offload directory (and per directory again when striped).
SSD_BYTES = 1 << 30


def add_parser(subparsers: Any, parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "profile", parents=list(parents),
        help="measure this machine (per-layer times, link bandwidth, CPU AdamW) for "
             "'tinypipe plan --hardware'",
        description="Time one real decoder block of a model shape (forward, recompute, backward) and the "
                    "head over micro-batch sizes and sequence lengths, measure host<->device bandwidth and "
                    "the CPU's fused AdamW rate, and write a JSON file that 'tinypipe plan --hardware FILE' "
                    "uses.",
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="cpu or cuda:N (default: cuda:0 if available)")
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="MODEL",
                   help=f"preset, Hugging Face directory or config.json whose block shape is timed "
                        f"(default: {DEFAULT_MODEL}); 'none' measures only the machine rates")
    p.add_argument("--seq-lens", default="1024,2048", metavar="L,L",
                   help="sequence lengths (default: 1024,2048)")
    p.add_argument("--micro-batches", default="1,2,4", metavar="B,B",
                   help="micro-batch sizes (default: 1,2,4)")
    p.add_argument("--precision", default=None, choices=("bf16", "fp32"),
                   help="compute precision (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--reps", default=3, type=int, metavar="N",
                   help="timed repetitions per point (median; default 3)")
    p.add_argument("--offload-dir", default=None, metavar="DIR[,DIR]",
                   help="also measure this directory's SSD read/write rates (--ssd-bytes written and read "
                        "back); several, comma-separated (one per drive): each alone and all of them striped")
    p.add_argument("--ssd-bytes", default="1GiB", metavar="SIZE",
                   help="bytes written and read back per --offload-dir (default 1GiB; less is quicker, "
                        "and nearer the drive's cache than its sustained rate)")
    p.add_argument("--output", required=True, metavar="FILE", help="where to write the profile JSON")


def _ints(name: str, text: str) -> list[int]:
    from tinypipe.errors import ConfigError

    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{name} must be comma-separated whole numbers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ConfigError(f"{name} must list whole numbers >= 1, got {text!r}")
    return sorted(set(vals))


def _ssd_bytes(text: str | None) -> int:
    """``--ssd-bytes``: at least two of the measurement's 64 MiB requests (its mixed run reads one
    while it writes the other); rounded up to whole requests."""
    from tinypipe.errors import ConfigError
    from tinypipe.storage.rates import REGION_BYTES
    from tinypipe.units import parse_bytes

    if text is None:
        return SSD_BYTES
    try:
        nbytes = parse_bytes(text)
    except (ConfigError, ValueError):
        raise ConfigError(f"--ssd-bytes must be a size such as 1GiB or 256MiB, got {text!r}") from None
    if nbytes < 2 * REGION_BYTES:
        raise ConfigError(f"--ssd-bytes must be at least {2 * REGION_BYTES >> 20}MiB, got {text!r}")
    return nbytes


def run(args: argparse.Namespace) -> int:
    from tinypipe.errors import ConfigError

    device = args.device
    if device is None:
        import torch

        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if not (device == "cpu" or device.startswith("cuda")):
        raise ConfigError(f"--device must be cpu or cuda:N, got {device!r}")
    if args.reps < 1:
        raise ConfigError(f"--reps must be >= 1, got {args.reps}")
    dirs = None
    if getattr(args, "offload_dir", None) is not None:  # fail now, not after the layer timings
        from tinypipe.storage import check_directory
        from tinypipe.storage.stripe import as_directories, parse_directories

        dirs = parse_directories(args.offload_dir)
        for d in as_directories(dirs):
            check_directory(d)
        ssd_bytes = _ssd_bytes(getattr(args, "ssd_bytes", None))
    seqs = _ints("--seq-lens", args.seq_lens)
    mbs = _ints("--micro-batches", args.micro_batches)
    model = None if str(args.model).strip().lower() in ("none", "") else args.model
    from tinypipe.planner.profile import hardware_from_profile, run_profile, save_profile

    if model is not None:
        from tinypipe.planner.presets import load_model_config

        cfg = load_model_config(model)
        max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if isinstance(max_pos, int) and max(seqs) > max_pos:
            raise ConfigError(f"--seq-lens {max(seqs)} exceeds the model's max_position_embeddings {max_pos}")
    else:
        cfg = None
    d = run_profile(device, cfg if cfg is not None else None, seq_lens=seqs, micro_batches=mbs,
                    precision=args.precision, reps=args.reps)
    if dirs is not None:
        t0 = time.perf_counter()
        d.update(ssd_rates(dirs, ssd_bytes))
        d["seconds"] += time.perf_counter() - t0
    if cfg is not None:
        d["model"]["name"] = str(model)
    hardware_from_profile(d)  # what plan --hardware will read: fail here, not there
    path = save_profile(d, args.output)
    print(f"wrote {path} ({d['seconds']:.1f} s); use: tinypipe plan --hardware {path} ...", flush=True)
    return 0


def ssd_rates(dirs: str | Sequence[str], nbytes: int = SSD_BYTES) -> dict:
    """The profile's SSD keys: the (striped) rates the planner uses and ``ssd``, the whole
    measurement (each directory's too, with the rates with reads and writes together)."""
    from tinypipe.storage import measure_directories

    ssd = measure_directories(dirs, nbytes, mixed=True, log=lambda line: print(line, flush=True))
    return {"ssd_read_gbps": float(ssd["read_gbps"]), "ssd_write_gbps": float(ssd["write_gbps"]),
            "ssd_mixed_gbps": float(ssd["mixed_gbps"]), "ssd": ssd}


def main(argv: Sequence[str] | None = None) -> int:
    from tinypipe.errors import TinypipeError

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except TinypipeError as exc:
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
