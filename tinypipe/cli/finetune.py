"""``tinypipe finetune``: full-parameter fine-tuning of a causal LM on the user's data."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from tinypipe.cli.options import _OPTIONS_BY_DEST, _check_devices, _default_device, _positive, _resolve_settings
from tinypipe.cli.output import PROG, _count, _loss_summary, _prepare_output, _save_outputs, _say
from tinypipe.errors import ConfigError


def cmd_finetune(args: argparse.Namespace) -> int:
    s = _resolve_settings(args)
    for name in ("global_batch", "micro_batch"):
        _positive(name, s[name])
    _positive("seq_len", s["seq_len"], 2)
    _positive("steps", s["steps"])
    _positive("warmup_steps", s["warmup_steps"], 0)
    if s["epochs"] is not None and not s["epochs"] > 0:
        raise ConfigError(f"epochs must be > 0, got {s['epochs']}")
    if not 0.0 <= s["min_lr_ratio"] <= 1.0:
        raise ConfigError(f"min_lr_ratio must be in [0, 1], got {s['min_lr_ratio']}")
    for key in ("schedule", "precision", "device_optimizer"):
        choices = _OPTIONS_BY_DEST[key].choices
        if s[key] is not None and choices and s[key] not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {s[key]!r}")
    from tinypipe.config import Config

    devices = s["devices"] or [_default_device()]
    precision = s["precision"] or ("bf16" if any(d.startswith("cuda") for d in devices) else "fp32")
    lora = _lora_settings(s, precision)
    cuda = any(d.startswith("cuda") for d in devices)
    # on CUDA with no packing flags (and no --plan) the engine plans for itself; on cpu the defaults
    auto = cuda and s["micro_batch"] is None and s["pack_size"] is None and not s["plan"]
    config = Config(
        devices=devices,
        micro_batch_size=None if auto else (s["micro_batch"] or 1),
        pack_size=None if auto else (s["pack_size"] or 1),
        precision=precision,
        lr=s["lr"],
        weight_decay=s["weight_decay"],
        max_grad_norm=s["max_grad_norm"],
        device_optimizer=s["device_optimizer"],
        resident_packs=s["resident_packs"],
        gpu_memory_bytes=s["gpu_memory"],
        cpu_memory_bytes=s["cpu_memory"],
    )
    _check_devices(config.devices)
    plan = None
    if s["plan"]:
        from tinypipe.schedule.plan import Plan

        try:
            plan = Plan.load(Path(s["plan"]).expanduser())
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"{s['plan']}: not a tinypipe plan ({exc})") from None
        if plan.num_devices != len(config.devices):
            raise ConfigError(f"{s['plan']}: plan is for {plan.num_devices} device(s), --devices lists {len(config.devices)}")
        config = config.replace(micro_batch_size=plan.fwd_micro_batch, backward_micro_batch_size=plan.bwd_micro_batch,
                                prefetch_window=plan.prefetch_window)
    from tinypipe.train.data import read_records
    from tinypipe.train.model_io import resolve_model_path

    resolve_model_path(s["model"])  # a wrong path fails now, not after other work
    data_path = Path(s["data"]).expanduser()

    read_records(data_path, skip_bad_lines=s["skip_bad_lines"])  # malformed data fails before the model loads
    out = _prepare_output(s["output"])

    import torch

    from tinypipe.runtime.engine import Engine
    from tinypipe.train.data import load_dataset
    from tinypipe.train.loop import TrainingInterrupted, read_metrics, train
    from tinypipe.train.model_io import load_model

    torch.manual_seed(s["seed"])
    t0 = time.perf_counter()
    quant = lora.quant_spec if lora is not None else None
    model, tokenizer = load_model(s["model"], quantize=quant)
    n_params = sum(p.numel() for p in model.parameters())
    if quant is not None:  # QLoRA: count the quantized weights' dense elements, not their bytes
        from tinypipe.quant.model import dense_param_count

        n_params = dense_param_count(model)
    _say(f"model: {s['model']} ({type(model).__name__}, {_count(n_params)} parameters) "
         f"loaded in {time.perf_counter() - t0:.1f} s")
    if lora is not None:
        from tinypipe.lora import apply_lora

        model = apply_lora(model, lora)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        cfg = model.peft_config[model.active_adapter]
        _say(f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(sorted(cfg.target_modules))}: "
             f"{_count(trainable)} trainable parameters ({100.0 * trainable / n_params:.2f}%)"
             + (f" over a {quant.label} base" if quant is not None else ""))
        if lora.dropout > 0:
            _say(f"LoRA: dropout {lora.dropout:g} is recorded in adapter_config.json but not applied while "
                 "training (tinypipe runs modules in eval mode so the backward recomputation is exact)")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    seq_len = s["seq_len"] or min(1024, int(max_pos or 1024))
    if max_pos is not None and seq_len > int(max_pos):
        raise ConfigError(f"seq_len {seq_len} exceeds the model's max_position_embeddings {max_pos}")
    dataset, stats = load_dataset(data_path, tokenizer, seq_len, skip_bad_lines=s["skip_bad_lines"])
    per_epoch = dataset.num_batches(s["global_batch"])
    if per_epoch == 0:
        raise ConfigError(
            f"{data_path}: {stats.rows} rows of {seq_len} tokens is fewer than one global batch of "
            f"{s['global_batch']}; lower --global-batch or --seq-len, or add data"
        )
    steps = s["steps"] or max(1, math.ceil((s["epochs"] or 1.0) * per_epoch))
    _say(f"data: {data_path} ({stats.format}, {stats.records} records, {stats.tokens} tokens -> "
         f"{stats.rows} rows of {seq_len}; {per_epoch} steps per epoch of {s['global_batch']} rows)"
         + (f"; {stats.bad_lines_skipped} bad lines skipped" if stats.bad_lines_skipped else ""))

    if cuda and s["gpu_memory"]:
        _cap_gpu_memory(config.devices, s["gpu_memory"])
    if auto or s["gpu_memory"] or s["cpu_memory"]:  # plan for (or check the plan against) the workload
        config = config.replace(seq_len=seq_len, global_batch=s["global_batch"])
    engine = Engine(model, config, plan=plan)
    config = engine.config  # with the planner's knobs
    try:
        if engine.plan_result is not None:
            best = engine.plan_result.best
            _say(f"plan: {best.describe()}; predicted {best.time.tokens_per_s:,.0f} tokens/s, "
                 f"{best.gpu_need / 2**30:.1f} GiB per GPU (tinypipe plan shows the alternatives)")
        _say(f"training: {steps} steps on {', '.join(config.devices)} ({precision}), lr {s['lr']:g} "
             f"({s['schedule']}, {s['warmup_steps']} warm-up steps), pack size {config.pack_size}, "
             f"micro-batch {config.micro_batch_size}"
             + (f", {config.device_optimizer} stepped on the GPU" if config.device_optimizer not in (None, "off") else "")
             + (f", {config.resident_packs} packs resident" if config.resident_packs else ""))
        metrics = out / "metrics.jsonl"
        ckpt_dir = out / "checkpoint"
        start = 0
        if s["resume"]:
            extra = engine.load_checkpoint(ckpt_dir)
            if extra.get("seed") != s["seed"] or extra.get("global_batch") != s["global_batch"]:
                raise ConfigError(f"{ckpt_dir}: checkpoint was made with another --seed/--global-batch")
            start = int(extra["step"])
            _say(f"resuming at step {start} from {ckpt_dir}")
            if metrics.exists():  # drop lines of steps after the checkpoint (they will be redone)
                kept = [r for r in read_metrics(metrics) if r["step"] <= start]
                metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
        try:
            records = train(
                engine, dataset, steps=steps, global_batch=s["global_batch"], lr=s["lr"],
                warmup_steps=s["warmup_steps"], schedule=s["schedule"], min_lr_ratio=s["min_lr_ratio"],
                seed=s["seed"], log_path=metrics, progress=not args.no_progress, append=bool(s["resume"]),
                start_step=start, checkpoint_dir=ckpt_dir, checkpoint_every=s["checkpoint_every"],
            )
        except TrainingInterrupted as stop:
            print(f"{PROG}: {stop}; continue with the same command plus --resume", file=sys.stderr, flush=True)
            return 130
        if s["resume"]:
            records = read_metrics(metrics)  # the whole run's curve, not just the resumed part
        _say(_loss_summary(records))
        _say(engine.memory_report().to_text())
        metrics, png = _save_outputs(engine, tokenizer, records, out)
        if s["merge"]:
            from tinypipe.lora import save_merged

            # QLoRA: the dequantized base + adapter in bf16 (the base never had more precision)
            save_merged(engine, out / "merged", dtype=torch.bfloat16 if quant is not None else torch.float32)
            tokenizer.save_pretrained(str(out / "merged"))
    finally:
        engine.close()
    what = "LoRA adapter (PeftModel.from_pretrained loads it)" if lora is not None else "model"
    _say(f"saved: {what} + tokenizer -> {out}/ ; metrics -> {metrics} ; plots -> {png} , {out / 'timeline.png'}")
    if s["merge"]:
        _say(f"saved: merged model + tokenizer -> {out / 'merged'}/ (AutoModelForCausalLM.from_pretrained loads it)")
    return 0


def _lora_settings(s: dict[str, Any], precision: str = "fp32") -> Any:
    """LoRA settings from the resolved options (None without --lora); bad values fail here,
    before the model loads."""
    given = [k for k in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "merge", "quantize")
             if s[k] not in (None, False)]
    if not s["lora"]:
        if given:
            raise ConfigError(f"{given[0]} needs --lora (LoRA fine-tuning)")
        return None
    from tinypipe.lora.settings import LoraSettings

    defaults = LoraSettings()
    return LoraSettings(
        rank=defaults.rank if s["lora_rank"] is None else s["lora_rank"],
        alpha=defaults.alpha if s["lora_alpha"] is None else s["lora_alpha"],
        dropout=defaults.dropout if s["lora_dropout"] is None else s["lora_dropout"],
        targets=s["lora_targets"],
        quantize=s["quantize"],
        compute_dtype=precision,
    )


def _cap_gpu_memory(devices: Sequence[str], budget: int) -> None:
    """Hold this process to ``budget`` bytes on each CUDA device (the allocator refuses beyond it)."""
    import torch

    for name in sorted({d for d in devices if d.startswith("cuda")}):
        dev = torch.device(name)
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), dev)
