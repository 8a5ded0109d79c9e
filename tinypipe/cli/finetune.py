"""``tinypipe finetune``: full-parameter fine-tuning of a causal LM on the user's data."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Sequence

from tinypipe.cli.options import (
    FinetuneSettings,
    config_values,
    engine_config,
    read_plan_file,
    resolve_settings,
)
from tinypipe.cli.output import (
    PROG,
    eval_summary,
    format_count,
    loss_summary,
    prepare_output,
    save_outputs,
    say,
)
from tinypipe.cli.resume import refuse_or_override, resume_differences, run_settings
from tinypipe.config import Config
from tinypipe.errors import ConfigError, WriteError


def cmd_finetune(args: argparse.Namespace) -> int:
    """Check everything that can fail early, load the model and data, train, save."""
    s = resolve_settings(args)  # checked
    config, auto = engine_config(s)
    lora = _lora_settings(s, config.precision)
    plan = read_plan_file(s.plan, len(config.devices)) if s.plan else None
    with ExitStack() as held:  # the output directory's lock, held until the run ends
        data_path, out = _check_inputs(s, held)
        return _finetune(args, s, config, auto, lora, plan, data_path, out)


def _finetune(args: argparse.Namespace, s: FinetuneSettings, config: Config, auto: bool, lora: Any,
              plan: Any, data_path: Path, out: Path) -> int:
    """Load the model and data, train, save (the inputs checked, the output directory locked)."""
    import torch

    from tinypipe.distributed.launch import init_from_environment, shutdown
    from tinypipe.runtime.engine import Engine

    init_from_environment()  # torchrun: every rank trains its rows of each global batch; rank 0 reports
    torch.manual_seed(s.seed)
    model, tokenizer = _load_model(s.model, lora, s.seq_len if s.extend_context else None)
    (dataset, eval_set), seq_len, steps = _load_data(s, data_path, tokenizer, model)
    if any(d.startswith("cuda") for d in config.devices) and s.gpu_memory:
        _cap_gpu_memory(config.devices, s.gpu_memory)
    if auto or s.gpu_memory or s.cpu_memory:  # plan for (or check the plan against) the workload
        config = config.replace(**config_values(s, workload=True, seq_len=seq_len))
        if config.document_tokens is None and dataset.document_tokens() < seq_len:  # packed rows
            config = config.replace(document_tokens=dataset.document_tokens())
    elif config.mlp_chunk_tokens is None:  # the automatic MLP chunk depends on the row length alone
        config = config.replace(mlp_chunk_tokens=_mlp_chunk(model, config.precision, seq_len))
    engine = Engine(model, config, plan=plan)
    try:
        say(_plan_line(engine))
        say(f"training: {steps} steps on {', '.join(config.devices)} ({config.precision}), lr {s.lr:g} "
            f"({s.schedule}, {s.warmup_steps} warm-up steps)")
        run = run_settings(s, data_path, steps, lora, seq_len)
        try:
            records = _train(engine, (dataset, eval_set), steps, s, out, run, progress=not args.no_progress)
            if records is None:
                return 130
            # QLoRA: the dequantized base + adapter in bf16 (the base never had more precision)
            quantized = lora is not None and lora.quant_spec is not None
            metrics, png = _save(engine, tokenizer, records, out, merge=s.merge,
                                 merged_dtype=torch.bfloat16 if quantized else torch.float32)
        except WriteError as failed:  # disk full, ulimit -f: the trained model is saved elsewhere
            from tinypipe.cli.rescue import rescue
            from tinypipe.runtime.checkpoint import find_checkpoint
            from tinypipe.runtime.checkpoint_sharded import find_sharded

            kept = find_checkpoint(out / "checkpoint") or find_sharded(out / "checkpoint")
            raise rescue(engine, tokenizer, failed, kept) from failed
    finally:
        engine.close()
        shutdown()
    what = "LoRA adapter (PeftModel.from_pretrained loads it)" if lora is not None else "model"
    say(f"saved: {what} + tokenizer -> {out}/ ; metrics -> {metrics} ; plots -> {png} , "
        f"{out / 'timeline.png'}")
    if s.merge:
        say(f"saved: merged model + tokenizer -> {out / 'merged'}/ "
            "(AutoModelForCausalLM.from_pretrained loads it)")
    return 0


def _mlp_chunk(model: Any, precision: str, seq_len: int) -> int:
    """The engine's automatic MLP chunk (Config.mlp_chunk_tokens None) for rows of ``seq_len``."""
    from tinypipe.models.chunked_mlp import LONG_SEQUENCE_TOKENS, mlp_chunk_tokens_for
    from tinypipe.planner.probe import shape_of
    from tinypipe.planner.sizes import dtype_bytes

    if seq_len <= LONG_SEQUENCE_TOKENS:  # unchunked, without reading the model's shape
        return 0
    return mlp_chunk_tokens_for(None, shape_of(model.config)["intermediate"], dtype_bytes(precision), seq_len)


def _check_inputs(s: FinetuneSettings, held: ExitStack) -> tuple[Path, Path]:
    """A wrong model path, malformed data, an unwritable output or one that holds what the run
    would destroy (:mod:`~tinypipe.cli.output_guard`) or that another run is using fails now, before
    the model loads; ``held`` keeps the output's lock. Returns the data path and the output directory."""
    from tinypipe.cli.output_guard import check_output, refuse_model_dir
    from tinypipe.cli.output_lock import output_lock
    from tinypipe.train.records import read_records
    from tinypipe.train.model_io import resolve_model_path

    _, model_path = resolve_model_path(s.model)  # a directory, or a .gguf file (never overwritten)
    refuse_model_dir(Path(s.output).expanduser(), model_path)
    out = prepare_output(s.output)
    held.enter_context(output_lock(out))
    check_output(out, resume=bool(s.resume), overwrite=bool(s.overwrite))
    data_path = Path(s.data).expanduser()
    # read again (and skipped lines logged) when the data loads: quiet here, each line reported once
    read_records(data_path, skip_bad_lines=s.skip_bad_lines, quiet=True)
    if s.eval_data:
        read_records(Path(s.eval_data).expanduser(), skip_bad_lines=s.skip_bad_lines, quiet=True)
    return data_path, out


def _load_model(path: str, lora: Any, context_tokens: int | None = None) -> tuple[Any, Any]:
    """The model (with LoRA adapters when ``lora`` is given; its RoPE scaled to ``context_tokens``
    positions when given) and its tokenizer, reported."""
    from tinypipe.train.model_io import load_model

    t0 = time.perf_counter()
    quant = lora.quant_spec if lora is not None else None
    model, tokenizer = load_model(path, quantize=quant, context_tokens=context_tokens)
    n_params = sum(p.numel() for p in model.parameters())
    if quant is not None:  # QLoRA: count the quantized weights' dense elements, not their bytes
        from tinypipe.quant.model import dense_param_count

        n_params = dense_param_count(model)
    say(f"model: {path} ({type(model).__name__}, {format_count(n_params)} parameters) "
        f"loaded in {time.perf_counter() - t0:.1f} s")
    if context_tokens is not None:
        from tinypipe.models.rope_extension import describe_rope

        say(f"context: {describe_rope(model.config)}")
    if lora is None:
        return model, tokenizer
    from tinypipe.lora import apply_lora

    model = apply_lora(model, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cfg = model.peft_config[model.active_adapter]
    say(f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(sorted(cfg.target_modules))}: "
        f"{format_count(trainable)} trainable parameters ({100.0 * trainable / n_params:.2f}%)"
        + (f" over a {quant.label} base" if quant is not None else ""))
    return model, tokenizer


def _load_data(s: FinetuneSettings, data_path: Path, tokenizer: Any,
               model: Any) -> tuple[tuple[Any, Any], int, int]:
    """The tokenized training rows and held-out rows (None without --eval-*), the sequence length
    and the number of optimizer steps, reported."""
    from tinypipe.train.data import load_dataset

    max_pos = getattr(model.config, "max_position_embeddings", None)
    seq_len = s.seq_len or min(1024, int(max_pos or 1024))
    if max_pos is not None and seq_len > int(max_pos):
        raise ConfigError(f"seq_len {seq_len} exceeds the model's max_position_embeddings {max_pos} "
                          "(--extend-context scales its RoPE to reach it)")
    packing = s.packing == "on" and _document_masks(model)
    dataset, stats = load_dataset(data_path, tokenizer, seq_len, skip_bad_lines=s.skip_bad_lines,
                                  packing=packing)
    dataset, held = _eval_data(s, dataset, tokenizer, seq_len)  # a held-out split leaves fewer rows
    per_epoch = dataset.num_batches(s.global_batch)
    if per_epoch == 0:
        raise ConfigError(
            f"{data_path}: {stats.rows} rows of {seq_len} tokens is fewer than one global batch of "
            f"{s.global_batch}; lower --global-batch or --seq-len, or add data"
        )
    steps = s.steps or max(1, math.ceil((s.epochs or 1.0) * per_epoch))
    say(f"data: {data_path} ({stats.format}, {stats.records} records, {stats.tokens} tokens -> "
        f"{stats.describe()} of {seq_len}; {per_epoch} steps per epoch of {s.global_batch} rows)"
        + (f"; {stats.bad_lines_skipped} bad lines skipped" if stats.bad_lines_skipped else ""))
    return (dataset, held), seq_len, steps


def _document_masks(model: Any) -> bool:
    """Whether packed rows get per-document attention with this model; if not, say so (the data
    is then padded, one example per row)."""
    import transformers

    from tinypipe.lora.hooks import split_peft
    from tinypipe.models.decompose import Decomposition

    inner = split_peft(model)[1]
    if Decomposition(inner).document_masks:
        return True
    say(f"packing: {type(inner).__name__} builds no per-document attention masks from position ids "
        f"(transformers {transformers.__version__}); padding each example to its own row instead")
    return False


def _eval_data(s: FinetuneSettings, dataset: Any, tokenizer: Any, seq_len: int) -> tuple[Any, Any]:
    """(training rows, held-out rows or None): ``--eval-split`` of the rows, or ``--eval-data``."""
    if s.eval_split is not None:
        from tinypipe.train.evaluation import split_eval

        full = len(dataset)
        dataset, held = split_eval(dataset, s.eval_split, s.seed)
        if full >= s.global_batch and dataset.num_batches(s.global_batch) == 0:
            raise ConfigError(f"--eval-split {s.eval_split:g} leaves {len(dataset)} training rows, fewer "
                              f"than one global batch of {s.global_batch}")
        say(f"eval: {len(held)} rows held out ({s.eval_split:g} of the data, seed {s.seed})")
        return dataset, held
    if not s.eval_data:
        return dataset, None
    from tinypipe.train.data import load_dataset

    path = Path(s.eval_data).expanduser()
    # packed (position ids restarting per document) or padded, as the training rows are
    held, stats = load_dataset(path, tokenizer, seq_len, skip_bad_lines=s.skip_bad_lines,
                               packing=dataset.position_ids is not None)
    if len(held) == 0:
        raise ConfigError(f"{path}: {stats.tokens} tokens is less than one row of {seq_len}")
    say(f"eval: {path} ({stats.records} records -> {len(held)} rows of {seq_len})")
    return dataset, held


def _train(engine: Any, data: tuple[Any, Any], steps: int, s: FinetuneSettings, out: Path,
           run: dict[str, Any], progress: bool) -> list | None:
    """Train (from the checkpoint with --resume) and return the whole run's metrics records; None
    when a signal stopped it (a final checkpoint was written)."""
    from tinypipe.train.loop import TrainingInterrupted, read_metrics, train

    metrics = out / "metrics.jsonl"
    ckpt_dir = out / "checkpoint"
    start = _resume(engine, s, ckpt_dir, metrics, run) if s.resume else 0
    reporters = ()
    if s.report_to == "tensorboard":
        from tinypipe.train.tensorboard import TensorBoardReporter

        reporters = (TensorBoardReporter(out / "runs", start_step=start),)
        say(f"tensorboard: logging to {out / 'runs'} (tensorboard --logdir {out / 'runs'})")
    dataset, eval_set = data
    try:
        records = train(
            engine, dataset, steps=steps, global_batch=s.global_batch, lr=s.lr,
            warmup_steps=s.warmup_steps, schedule=s.schedule, min_lr_ratio=s.min_lr_ratio,
            seed=s.seed, log_path=metrics, progress=progress, append=bool(s.resume),
            start_step=start, checkpoint_dir=ckpt_dir, checkpoint_every=s.checkpoint_every or 0,
            checkpoint_extra={"run": run}, eval_dataset=eval_set, eval_every=s.eval_every,
            reporters=reporters,
        )
    except TrainingInterrupted as stop:
        print(f"{PROG}: {stop}; continue with the same command plus --resume", file=sys.stderr, flush=True)
        return None
    return read_metrics(metrics) if s.resume else records  # resumed: the whole run's curve


def _resume(engine: Any, s: FinetuneSettings, ckpt_dir: Path, metrics: Path, run: dict[str, Any]) -> int:
    """Load the checkpoint -- made by the same run (:mod:`tinypipe.cli.resume`; ``--force``
    overrides, saying what it overrides) -- and drop the metrics lines of steps after it (they
    will be redone); returns the step to continue from."""
    from tinypipe.runtime.checkpoint import read_extra
    from tinypipe.runtime.checkpoint_sharded import sharded_extra
    from tinypipe.train.loop import read_metrics

    differences = engine.checkpoint_differences(ckpt_dir)  # another model or LoRA: ConfigError here
    recorded = sharded_extra(ckpt_dir)  # a sharded checkpoint's manifest, else state.json
    recorded = read_extra(ckpt_dir) if recorded is None else recorded
    differences = resume_differences(recorded, run, s.seed, s.global_batch) + differences
    override = refuse_or_override(ckpt_dir, differences, s.force)
    if override is not None:
        say(override)
    extra = engine.load_checkpoint(ckpt_dir, force=True)
    start = int(extra["step"])
    say(f"resuming at step {start} from {ckpt_dir}")
    if metrics.exists():
        kept = [r for r in read_metrics(metrics) if r["step"] <= start]
        metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return start


def _save(engine: Any, tokenizer: Any, records: list, out: Path, merge: bool,
          merged_dtype: Any = None) -> tuple[Path, Path]:
    """Report the run, save the model (or adapter), tokenizer and plots, and with ``merge`` the
    merged model (in ``merged_dtype``, default fp32); returns the metrics and loss-plot paths."""
    if engine.replicas is not None and not engine.replicas.is_main:  # rank 0 writes; the others wait
        engine.save_pretrained(out)
        return out / "metrics.jsonl", out / "loss.png"
    say(loss_summary(records))
    held = eval_summary(records)
    if held:
        say(held)
    say(engine.memory_report().to_text())
    metrics, png = save_outputs(engine, tokenizer, records, out)
    if merge:
        from tinypipe.lora import save_merged

        save_merged(engine, out / "merged", dtype=merged_dtype)
        tokenizer.save_pretrained(str(out / "merged"))
    return metrics, png


def _plan_line(engine: Any) -> str:
    """``plan: ...``: what the engine runs (``engine.plan``), and what the planner predicted for it."""
    from tinypipe.schedule.plan import CPU_DEVICE

    cpu = not any(d.startswith("cuda") for d in engine.config.devices)
    line = f"plan: {engine.plan.describe(on=CPU_DEVICE) if cpu else engine.plan.describe()}"
    if engine.plan_result is not None:
        best = engine.plan_result.best
        line += (f"; predicted {best.time.tokens_per_s:,.0f} tokens/s, {best.gpu_need / 2**30:.1f} GiB "
                 "per GPU (tinypipe plan shows the alternatives)")
    return line


def _lora_settings(s: FinetuneSettings, precision: str = "fp32") -> Any:
    """LoRA settings from the resolved options (None without --lora); bad values fail here,
    before the model loads."""
    given = [k for k in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "merge", "quantize")
             if getattr(s, k) not in (None, False)]
    if not s.lora:
        if given:
            raise ConfigError(f"{given[0]} needs --lora (LoRA fine-tuning)")
        return None
    from tinypipe.lora.settings import LoraSettings

    defaults = LoraSettings()
    return LoraSettings(
        rank=defaults.rank if s.lora_rank is None else s.lora_rank,
        alpha=defaults.alpha if s.lora_alpha is None else s.lora_alpha,
        dropout=defaults.dropout if s.lora_dropout is None else s.lora_dropout,
        targets=s.lora_targets,
        quantize=s.quantize,
        compute_dtype=precision,
    )


def _cap_gpu_memory(devices: Sequence[str], budget: int) -> None:
    """Hold this process to ``budget`` bytes on each CUDA device (the allocator refuses beyond it)."""
    import torch

    for name in sorted({d for d in devices if d.startswith("cuda")}):
        dev = torch.device(name)
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), dev)
