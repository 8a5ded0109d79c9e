"""``tinypipe plan``: choose packing, micro-batches, prefetch window and stash placement for a model
and a machine, offline (no GPU, no weights), in seconds.

    tinypipe plan --model llama-3.1-8b --gpus 2 --gpu-memory 24GiB --cpu-memory 128GiB \\
                  --seq-len 4096 --global-batch 16 [--hardware rtx4090-pcie4|FILE] [--json] \\
                  [--offload-dir DIR[,DIR]] [--ssd-read-gbps X --ssd-write-gbps Y] \\
                  [--max-grad-norm X [--no-assist]]
    tinypipe plan --model llama-2-7b --nodes 2 --gpus 4 --interconnect pcie5,eth100 ...
    tinypipe plan --model llama-3.1-8b --gpu-memory 24GiB --evaluate my_plan.json

``--evaluate FILE`` prices and sizes a plan you already have (``--save-plan``'s file, or a
``bench/run.py --json`` result) on the same budgets, beside what the planner would choose.

With ``--nodes`` (or ``--gpus-per-replica``) ``--gpus`` counts the GPUs of one node and the plan
compares data-parallel layouts: R replicas of G GPUs each (:mod:`tinypipe.planner.replica_search`).

Exit status: 0 with the plan printed; 1 when no plan fits (one line saying what the smallest plan
needs); 2 for bad input (one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

PROG = "tinypipe plan"
EXIT_OK, EXIT_NO_FIT, EXIT_USAGE = 0, 1, 2
DEFAULT_HARDWARE = "rtx4090-pcie4"


def add_parser(subparsers: Any, parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """Register ``plan`` on an ``add_subparsers()`` object; the parsed args' ``func`` is :func:`run`."""
    p = subparsers.add_parser(
        "plan", parents=list(parents),
        help="plan packing/micro-batches/memory for a model and machine (offline)",
        description="Choose a Tiny-Pipe plan (pack sizes, micro-batch sizes, prefetch window, where pack "
                    "inputs are stashed, which layers stay on the GPU with their optimizer) that fits the "
                    "GPUs and host memory, and predict its speed. Runs offline from a config: no GPU, no "
                    "weights.",
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="MODEL",
                   help="Hugging Face model directory, a config.json, or a preset (e.g. llama-3.1-8b; "
                        "'--model list' shows them)")
    p.add_argument("--gpus", default="1", metavar="N",
                   help="number of GPUs (with --nodes: per node; default: 1)")
    p.add_argument("--nodes", default=None, metavar="N",
                   help="compare data-parallel layouts on N nodes of --gpus GPUs each: R replicas x G GPUs "
                        "(a pipeline per replica), each with its sharding of the host optimizer state")
    p.add_argument("--gpus-per-replica", default=None, metavar="G",
                   help="plan only the layout of G GPUs per replica (implies the layout table; "
                        "default: every G that divides --gpus)")
    p.add_argument("--interconnect", default=None, metavar="LINK[,LINK]",
                   help="links for the gradient collectives, a preset or GB/s: within a node "
                        "(pcie4|pcie5|nvlink) and/or between nodes (eth25|eth100|ib200|ib400), e.g. "
                        "nvlink,ib200; one number: within a node on one node, else between nodes "
                        "(default: the hardware's PCIe within, eth25 between)")
    p.add_argument("--optimizer-sharding", default="auto", choices=("auto", "replicate", "shard"),
                   help="with replicas: every replica holds the whole host AdamW state, or 1/R of it "
                        "(default: auto, the planner chooses and says why)")
    p.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="memory per GPU, e.g. 24GiB, 24G, 24000MB (default: the hardware preset's)")
    p.add_argument("--cpu-memory", default=None, metavar="SIZE",
                   help="host memory for training, e.g. 128GiB (default: this machine's RAM)")
    p.add_argument("--seq-len", default=None, metavar="L", help="tokens per sequence (required)")
    p.add_argument("--extend-context", action="store_true",
                   help="a --seq-len beyond the model's max positions: plan with its RoPE scaled to reach it "
                        "(as `tinypipe finetune --extend-context` trains it)")
    p.add_argument("--global-batch", default=None, metavar="B",
                   help="sequences per optimizer step (required)")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, metavar="PRESET|FILE",
                   help=f"GPU + link + CPU rates: a preset or a JSON file (default: {DEFAULT_HARDWARE}; "
                        "'--hardware list' shows presets)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                   help="compute precision (default: bf16)")
    p.add_argument("--max-grad-norm", default=None, metavar="X",
                   help="global-norm clipping (retains gradients on the host: +4 B/param)")
    p.add_argument("--lora", action="store_true",
                   help="plan LoRA fine-tuning (adapters train; the base is frozen)")
    p.add_argument("--lora-rank", default=None, metavar="R", help="LoRA rank (default: 8)")
    p.add_argument("--quantize", default=None, metavar="nf4|fp4|int8",
                   help="with --lora: QLoRA, the frozen base quantized with bitsandbytes (sized exactly)")
    p.add_argument("--lora-targets", default=None, metavar="LIST",
                   help="comma-separated block linear layers to adapt "
                        "(default: every attention and MLP projection)")
    p.add_argument("--device-optimizer", default=None, choices=("off", "embed", "head", "both"),
                   help="keep these resident layers' AdamW state on the GPU (default: searched)")
    p.add_argument("--resident-packs", default=None, metavar="N",
                   help="keep the first N packs resident on the GPU, stepped there (default: searched)")
    p.add_argument("--offload-dir", default=None, metavar="DIR[,DIR]",
                   help="plan with an SSD tier in DIR: state that does not fit --cpu-memory goes there "
                        "(rates: the hardware file's, else measured on DIR, else the preset's); several, "
                        "comma-separated (one per drive): the state is striped over them")
    p.add_argument("--ssd-read-gbps", default=None, metavar="X",
                   help="the SSD's read rate in GB/s, of all --offload-dir drives together (implies the SSD "
                        "tier; overrides measured rates)")
    p.add_argument("--ssd-write-gbps", default=None, metavar="Y",
                   help="the SSD's write rate in GB/s, of all --offload-dir drives together (implies the SSD "
                        "tier; overrides measured rates)")
    p.add_argument("--mlp-chunk-tokens", default=None, metavar="N",
                   help="run each block's MLP over at most N tokens at a time (0: never; default: "
                        "automatic -- off up to 16384 tokens per sequence, above that a chunk whose one "
                        "intermediate is ~256 MiB); the plan's activation memory counts it")
    p.add_argument("--no-assist", action="store_true",
                   help="with --max-grad-norm: step every clipped update on the host (default: the "
                        "planner lets the GPU step some layers' clipped updates on their way up, where "
                        "that is faster)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--evaluate", default=None, metavar="FILE",
                   help="predict this saved plan (--save-plan's JSON, or a bench/run.py --json result) "
                        "instead of searching; the planner's own choice is noted beside it")
    p.add_argument("--save-plan", default=None, metavar="FILE",
                   help="write the chosen plan as JSON (tinypipe.schedule.Plan.load reads it)")


def _nonnegative_int(name: str, text: Any) -> int:
    return _positive_int(name, text, minimum=0)


def _positive_int(name: str, text: Any, minimum: int = 1) -> int:
    from tinypipe.errors import ConfigError

    if text is None:
        raise ConfigError(f"{name} is required")
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, got {text!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _listing(what: str) -> str:
    from tinypipe.planner.hardware import HARDWARE, GiB
    from tinypipe.planner.presets import PRESETS

    if what == "model":
        return "\n".join(f"{name:<16} {d['model_type']}" for name, d in PRESETS.items())
    return "\n".join(f"{h.name:<16} {h.gpu_memory_bytes / GiB:5.0f} GiB  H2D {h.h2d_gbs:g} GB/s  "
                     f"{h.bf16_tflops:g} TFLOP/s (achieved bf16)  AdamW {h.cpu_adamw_gparams_s:g} G/s  "
                     f"SSD {h.ssd_read_gbps:g}/{h.ssd_write_gbps:g} GB/s  {h.description}"
                     for h in HARDWARE.values())


def _host_ram() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - no psutil: ask for the flag
        from tinypipe.errors import ConfigError

        raise ConfigError("cannot read this machine's RAM; give --cpu-memory") from None


def run(args: argparse.Namespace) -> int:
    """Plan and print; returns the exit status (0 plan, 1 nothing fits, 2 bad input)."""
    from tinypipe.errors import PlanDoesNotFitError, TinypipeError

    debug = bool(getattr(args, "debug", False))
    try:
        if str(args.model).strip().lower() == "list":
            print(_listing("model"))
            return EXIT_OK
        if str(args.hardware).strip().lower() == "list":
            print(_listing("hardware"))
            return EXIT_OK
        from tinypipe.planner.hardware import load_hardware, parse_bytes
        from tinypipe.planner.format import format_plan
        from tinypipe.models.tiled_attention import ATTENTION_TILE_TOKENS
        from tinypipe.planner.request import PlanRequest
        from tinypipe.planner.search import plan

        gpus = _positive_int("--gpus", args.gpus)
        seq = _positive_int("--seq-len", args.seq_len)
        batch = _positive_int("--global-batch", args.global_batch)
        model = _extended(args.model, seq) if getattr(args, "extend_context", False) else args.model
        gpu_mem = parse_bytes(args.gpu_memory) if args.gpu_memory is not None else None
        cpu_mem = parse_bytes(args.cpu_memory) if args.cpu_memory is not None else _host_ram()
        clip = None
        if args.max_grad_norm is not None and str(args.max_grad_norm).strip().lower() not in (
                "none", "off", ""):
            try:
                clip = float(args.max_grad_norm)
            except ValueError:
                from tinypipe.errors import ConfigError

                raise ConfigError(f"--max-grad-norm must be a number, got {args.max_grad_norm!r}") from None
        hardware = load_hardware(args.hardware)
        ssd = None
        if args.offload_dir is not None or args.ssd_read_gbps is not None or args.ssd_write_gbps is not None:
            from tinypipe.planner.ssd import ssd_spec
            from tinypipe.storage.stripe import parse_directories

            dirs = None if args.offload_dir is None else parse_directories(args.offload_dir)
            ssd = ssd_spec(hardware, directory=dirs, read_gbps=args.ssd_read_gbps,
                           write_gbps=args.ssd_write_gbps, measure=True)
        lora = None
        if args.lora:
            from tinypipe.lora.settings import LoraSettings

            rank = (_positive_int("--lora-rank", args.lora_rank) if args.lora_rank is not None
                    else LoraSettings().rank)
            targets = ([t.strip() for t in args.lora_targets.split(",") if t.strip()] if args.lora_targets
                       else None)
            lora = LoraSettings(rank=rank, alpha=2.0 * rank, targets=targets, quantize=args.quantize,
                                compute_dtype=args.precision)
        elif args.lora_rank is not None or args.lora_targets is not None or args.quantize is not None:
            from tinypipe.errors import ConfigError

            raise ConfigError("--lora-rank / --lora-targets / --quantize need --lora")
        if getattr(args, "nodes", None) is not None or getattr(args, "gpus_per_replica", None) is not None:
            if ssd is not None:
                from tinypipe.errors import ConfigError

                raise ConfigError("the replica layouts (--nodes / --gpus-per-replica) do not model the SSD "
                                  "tier yet; plan one replica with --offload-dir instead")
            if getattr(args, "evaluate", None):
                from tinypipe.errors import ConfigError

                raise ConfigError("--evaluate prices one replica's plan: drop --nodes / --gpus-per-replica")
            return _run_layouts(args, model, hardware, gpus=gpus, seq=seq, batch=batch, gpu_mem=gpu_mem,
                                cpu_mem=cpu_mem, clip=clip, lora=lora)
        given = None
        if getattr(args, "evaluate", None):  # read first: a file that is no plan fails before the search
            from tinypipe.cli.options import read_plan_file

            given = read_plan_file(args.evaluate, gpus, "--gpus is")
        request = PlanRequest(model_config=model, gpus=gpus, gpu_memory_bytes=gpu_mem or None,
                              cpu_memory_bytes=cpu_mem, seq=seq, global_batch=batch, precision=args.precision,
                              max_grad_norm=clip, lora=lora, device_optimizer=args.device_optimizer,
                              resident_packs=None if args.resident_packs is None else _nonnegative_int(
                                  "--resident-packs", args.resident_packs), ssd=ssd,
                              assist_updates=not getattr(args, "no_assist", False),
                              mlp_chunk_tokens=None if getattr(args, "mlp_chunk_tokens", None) is None
                              else _nonnegative_int("--mlp-chunk-tokens", args.mlp_chunk_tokens),
                              # a plan given to the engine runs the default tile (the search weighs
                              # tiles for its own plans only): price it with that one
                              attention_tile_tokens=None if given is None else ATTENTION_TILE_TOKENS)
        result = plan(request, hardware)
        if given is not None:  # a plan the user has, priced like the search's
            from tinypipe.planner.given import with_given_plan

            result = with_given_plan(result, given)
        if ssd is not None and ssd.directory is not None and ssd.free_bytes is None:
            result.notes.append(f"offload directory {ssd.directory} does not exist (yet): its free space was "
                                "not checked")
        if args.save_plan:
            try:
                result.best.plan.save(args.save_plan)
            except OSError as exc:
                from tinypipe.errors import ConfigError

                raise ConfigError(f"cannot write {args.save_plan}: {exc.strerror or exc}") from None
        if args.json:
            print(json.dumps(result.as_dict(), indent=1, default=str))
        else:
            print(format_plan(result))
        return EXIT_OK
    except PlanDoesNotFitError as exc:
        if debug:
            raise
        print(f"{PROG}: {_one_line(exc)}", file=sys.stderr, flush=True)
        return EXIT_NO_FIT
    except TinypipeError as exc:
        if debug:
            raise
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr, flush=True)
        return EXIT_USAGE


def _links(text: str | None, nodes: int, hardware: Any) -> tuple[float, float]:
    """(within a node, between nodes) GB/s from ``--interconnect``: ``A,B``, one preset (its kind says
    which link), or one number (the link the collectives cross: within a node on one node)."""
    from tinypipe.errors import ConfigError
    from tinypipe.planner.hardware import NODE_LINKS, interconnect_gbs, node_link_for

    intra, inter = node_link_for(hardware), "eth25"
    parts = [t.strip() for t in (text or "").split(",") if t.strip()]
    if len(parts) > 2:
        raise ConfigError(f"--interconnect takes one or two links (within,between), got {text!r}")
    if len(parts) == 2:
        intra, inter = parts
        if inter.lower() in NODE_LINKS:
            raise ConfigError(f"--interconnect {text}: {inter} links GPUs within a node; between nodes give "
                              "eth25|eth100|ib200|ib400 or GB/s")
    elif parts:
        one = parts[0]
        is_node_link = one.lower() in NODE_LINKS
        if is_node_link or (nodes == 1 and one.lower() not in ("eth25", "eth100", "ib200", "ib400")):
            intra = one
        else:
            inter = one
        if is_node_link and nodes > 1:
            raise ConfigError(f"--interconnect {one} links GPUs within a node; for {nodes} nodes give the "
                              f"link between them too, e.g. {one},ib200")
    return interconnect_gbs(intra), interconnect_gbs(inter)


def _extended(model: str, seq: int) -> Any:
    """The model's config with its RoPE scaled to reach ``seq`` positions (``--extend-context``)."""
    from tinypipe.models.rope_extension import extend_rope
    from tinypipe.planner.presets import load_model_config

    config = load_model_config(str(model))
    extend_rope(config, seq)
    if not getattr(config, "name_or_path", ""):
        config.name_or_path = str(model)
    return config


def _run_layouts(args: argparse.Namespace, model: Any, hardware: Any, *, gpus: int, seq: int, batch: int,
                 gpu_mem: int | None, cpu_mem: int, clip: float | None, lora: Any) -> int:
    """The data-parallel layouts' table and the choice (``--nodes`` / ``--gpus-per-replica``)."""
    from tinypipe.planner.replica_format import format_comparison
    from tinypipe.planner.replica_search import compare_layouts
    from tinypipe.planner.replicas import Cluster

    nodes = _positive_int("--nodes", args.nodes) if args.nodes is not None else 1
    per_replica = (_positive_int("--gpus-per-replica", args.gpus_per_replica)
                   if args.gpus_per_replica is not None else None)
    intra, inter = _links(args.interconnect, nodes, hardware)
    cluster = Cluster(nodes, gpus, intra, inter, cpu_mem)
    resident = (None if args.resident_packs is None
                else _nonnegative_int("--resident-packs", args.resident_packs))
    cmp = compare_layouts(model, hardware, cluster, seq=seq, global_batch=batch,
                          gpus_per_replica=per_replica, sharding=args.optimizer_sharding,
                          gpu_memory_bytes=gpu_mem, precision=args.precision, max_grad_norm=clip, lora=lora,
                          device_optimizer=args.device_optimizer, resident_packs=resident,
                          assist_updates=not getattr(args, "no_assist", False),
                          mlp_chunk_tokens=None if getattr(args, "mlp_chunk_tokens", None) is None
                          else _nonnegative_int("--mlp-chunk-tokens", args.mlp_chunk_tokens))
    if args.save_plan and cmp.best is not None:
        try:
            cmp.best.plan().save(args.save_plan)
        except OSError as exc:
            from tinypipe.errors import ConfigError

            raise ConfigError(f"cannot write {args.save_plan}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps(_comparison_dict(cmp), indent=1, default=str))
    else:
        print(format_comparison(cmp))
    return EXIT_OK


def _comparison_dict(cmp: Any) -> dict:
    rows = []
    for r in cmp.rows:
        c = r.choice
        row = {"replicas": r.layout.replicas, "gpus_per_replica": r.layout.gpus_per_replica,
               "replicas_per_node": r.layout.per_node, "kind": r.layout.kind, "fits": r.fits,
               "reason": r.reason}
        if r.fits and c is not None and c.result is not None:
            row.update(sharding=c.sharding, tokens_per_s=c.tokens_per_s, step_s=c.step_s,
                       replica_step_s=c.replica_step_s, collective_s=c.collective_s, exposed_s=c.exposed_s,
                       allgather_s=c.allgather_s, gpu_need_bytes=c.result.best.gpu_need,
                       host_per_node_bytes=c.host_per_node, plan=r.plan().as_dict())
        rows.append(row)
    best = cmp.best
    return {"nodes": cmp.cluster.nodes, "gpus_per_node": cmp.cluster.gpus_per_node,
            "intra_node_gbs": cmp.cluster.intra_gbs, "inter_node_gbs": cmp.cluster.inter_gbs,
            "host_bytes_per_node": cmp.cluster.host_bytes_per_node, "seq": cmp.seq,
            "global_batch": cmp.global_batch, "layouts": rows,
            "best": None if best is None else {"replicas": best.layout.replicas,
                                               "gpus_per_replica": best.layout.gpus_per_replica,
                                               "sharding": best.choice.sharding if best.choice else None,
                                               "reason": best.reason}}


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tinypipe.cli.plan ...``: the same as ``tinypipe plan ...``."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
