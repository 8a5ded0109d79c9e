"""The rows of the GPU acceptance matrix (``bench/acceptance.py``): what each runs and records.

Each row runs in a child process of its own (``acceptance.py --row NAME``), so its GPU and host
peaks are its own, and returns one JSON record; ``acceptance.py`` checks the records. Three kinds:

* ``engine`` -- a real-shape model through ``tinypipe.Engine`` planning for itself
  (``Config(seq_len, global_batch, gpu_memory_bytes[, cpu_memory_bytes, offload_dir])``: what
  ``tinypipe finetune`` does), the GPU capped at the budget: tokens/s, losses, the allocator's
  reserved peak, the process's host peak (RSS sampled, children included), and the planner's
  prediction for the plan it chose (tokens/s, GPU and host need);
* ``cli`` -- ``tinypipe finetune`` through the command line on CUDA: an uninterrupted run, a run
  SIGKILLed mid-way and resumed, the two final models compared bit for bit; a LoRA run whose
  output ``PeftModel.from_pretrained`` loads, with trained (non-zero) ``lora_B``;
* ``tests`` -- ``pytest -m gpu``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class EngineRow:
    """A real-shape engine run. ``shape``: a workload of benchkit.workloads (W1, W3) or a
    Llama-3.1 shape of bench/qlora_bench.py (8b, 70b); ``lora``: None (full fine-tuning),
    ``"bf16"`` (LoRA over a bf16 base) or a quantization scheme (QLoRA)."""

    shape: str
    lora: str | None = None
    devices: tuple[str, ...] = ("cuda:0",)
    max_grad_norm: float | None = None
    cpu_memory_gib: float | None = None
    offload: bool = False
    warmup: int = 2
    steps: int = 3
    lr: float = 1e-5
    rank: int = 16
    seconds: int = 120  # what the row takes on the H200 (the tier's budget adds them up)
    kind: str = "engine"
    seq: int = 2048  # tokens per sequence (a Llama-3.1 shape's rows; W1/W3 keep their workload's)
    batch: int = 16  # sequences per step
    docs: int = 1  # documents packed per sequence (position ids restarting): segment attention
    #: one more step after the timed ones with the CUDA allocator's history recorded: what was
    #: alive at its peak, by the code that allocated it (benchkit/cuda_peak.py), in the raw file.
    #: None: only when the GPU peak exceeded the planner's estimate (the check would fail)
    memory_detail: bool | None = None
    compile_blocks: str = "auto"  # Config.compile_blocks ("off": eager blocks, a diagnostic row)


@dataclasses.dataclass(frozen=True)
class CliRow:
    """``tinypipe finetune`` on CUDA: kill + resume bit-identical, and a LoRA output PEFT loads."""

    steps: int = 8
    every: int = 2
    device: str = "cuda:0"
    seconds: int = 150
    kind: str = "cli"


@dataclasses.dataclass(frozen=True)
class TestsRow:
    """``pytest -m gpu`` (every GPU-marked test)."""

    seconds: int = 420
    kind: str = "tests"


Row = EngineRow | CliRow | TestsRow


# --------------------------------------------------------------------------- engine rows


def _shape_config(shape: str):  # -> transformers.LlamaConfig
    import transformers

    from benchkit.workloads import WORKLOADS

    if shape in WORKLOADS:
        cfg = transformers.LlamaConfig(**WORKLOADS[shape].config)
    else:
        sys.path.insert(0, str(ROOT / "bench"))
        from qlora_bench import SHAPES

        cfg = transformers.LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                       rope_theta=500000.0, **SHAPES[shape])
    cfg._attn_implementation = "sdpa"
    return cfg


def _build(row: EngineRow, device: str):  # -> (model, batch)
    """The model (random weights) and the one batch every step trains on (16 x 2048 tokens)."""
    import torch

    from benchkit.workloads import WORKLOADS, build_model, make_batch

    if row.lora is None and row.shape in WORKLOADS:
        w = WORKLOADS[row.shape]
        return build_model(w), make_batch(w)
    sys.path.insert(0, str(ROOT / "bench"))
    from qlora_bench import build

    from tinypipe.lora import LoraSettings, apply_lora

    cfg = _shape_config(row.shape)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, row.seq)
    scheme = None if row.lora in (None, "bf16") else row.lora
    model = build(cfg, scheme, device, torch.bfloat16)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the generator's scratch is not the engine's
    if row.lora is not None:
        model = apply_lora(model, LoraSettings(rank=row.rank, alpha=2.0 * row.rank, quantize=scheme,
                                               compute_dtype="bf16"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (row.batch, row.seq), generator=g)
    if row.docs <= 1:
        return model, {"input_ids": ids}
    pos = torch.arange(row.seq) % -(-row.seq // row.docs)  # row.docs documents per sequence
    return model, {"input_ids": ids, "position_ids": pos.expand(row.batch, row.seq).clone()}


def _measured_ssd_hardware(directory: Path, scratch: Path, device: str) -> tuple[str, dict[str, float]]:
    """A hardware file: the GPU's preset with ``directory``'s direct-I/O rates measured now (4 GiB
    written and read back), and those rates."""
    from tinypipe.cli.profile import ssd_rates
    from tinypipe.config import Config
    from tinypipe.planner.auto import hardware_for

    rates = ssd_rates([str(directory)], 4 << 30)
    spec = hardware_for(Config(devices=[device])).as_dict()
    spec.update(name=f"{spec['name']} (disk measured)", ssd_read_gbps=rates["ssd_read_gbps"],
                ssd_write_gbps=rates["ssd_write_gbps"], ssd_mixed_gbps=rates["ssd_mixed_gbps"])
    path = scratch / "hardware.json"
    path.write_text(json.dumps(spec))
    return str(path), {k: rates[k] for k in ("ssd_read_gbps", "ssd_write_gbps", "ssd_mixed_gbps")}


def run_engine_row(row: EngineRow, scratch: Path, cap_gib: float) -> dict[str, Any]:
    import torch

    import tinypipe
    from benchkit.rss import RssSampler

    cuda = row.devices[0].startswith("cuda")
    budget = int(cap_gib * GiB)
    if cuda:
        for dev in sorted(set(row.devices)):
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), torch.device(dev))
    torch.manual_seed(0)
    with RssSampler() as rss:
        t0 = time.perf_counter()
        model, batch = _build(row, row.devices[0])
        build_s = time.perf_counter() - t0
        kw: dict[str, Any] = {}
        if row.cpu_memory_gib is not None:
            kw["cpu_memory_bytes"] = int(row.cpu_memory_gib * GiB)
        ssd = None
        if row.offload:
            off = scratch / "offload"
            off.mkdir(parents=True, exist_ok=True)
            kw["offload_dir"] = str(off)
            # the disk's rates measured in this call, as `tinypipe profile --offload-dir` does: lent
            # machines' drives differ (the same W3 plan took 39.9 s/step in session 5, 30.3 s at
            # 698da54), so the preset's stated rates cannot check the planner's prediction
            kw["hardware"], ssd = _measured_ssd_hardware(off, scratch, row.devices[0])
        config = tinypipe.Config(devices=list(row.devices), precision="bf16", lr=row.lr, weight_decay=0.0,
                                 seq_len=int(batch["input_ids"].shape[1]),
                                 global_batch=int(batch["input_ids"].shape[0]),
                                 gpu_memory_bytes=budget if cuda else None, max_grad_norm=row.max_grad_norm,
                                 compile_blocks=row.compile_blocks,
                                 document_tokens=row.seq // row.docs if row.docs > 1 else None, **kw)
        t1 = time.perf_counter()
        engine = tinypipe.Engine(model, config)
        engine_s = time.perf_counter() - t1
        results = []
        for i in range(row.warmup + row.steps):
            r = engine.step(batch)
            results.append(r)
            print(f"  step {i + 1}: loss {r.loss:.4f} {r.seconds:.2f} s{' clipped' if r.clipped else ''}"
                  f"{' (warm-up)' if i < row.warmup else ''}", flush=True)
        engine.synchronize()
    gpu_peak = max((torch.cuda.max_memory_reserved(d) for d in set(row.devices)), default=0) if cuda else 0
    best = engine.plan_result.best if engine.plan_result is not None else None
    at_peak = None
    # after the row's own measurements (the recording's host memory and time are not the row's)
    if cuda and (row.memory_detail or (row.memory_detail is None and best is not None
                                       and gpu_peak > best.gpu_need)):
        from benchkit.cuda_peak import record_step

        at_peak = record_step(lambda: engine.step(batch), row.devices[0])
        for g in at_peak["groups"][:8]:
            print(f"    {g['bytes'] / GiB:6.2f} GiB in {g['blocks']:4d}: {g['ours']} | {g['library']} | "
                  f"{g['innermost']}", flush=True)
    # the planner's activation peak taken apart, beside what the allocator held at the measured peak
    estimated = engine.plan_result.peak_breakdown() if engine.plan_result is not None else []
    for b in estimated:
        print(f"  estimate ({b.phase}): " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in b.parts), flush=True)
    timed = results[row.warmup:]
    seconds = sum(r.seconds for r in timed) / len(timed)
    tokens = timed[0].tokens
    clipped = sum(bool(r.clipped) for r in timed)
    predicted_s = None
    if best is not None:
        predicted_s = best.time.step_s
        if clipped * 2 > len(timed) and best.time.clipped_step_s is not None:
            predicted_s = best.time.clipped_step_s
    report = engine.memory_report()
    out = {
        "kind": "engine", "row": dataclasses.asdict(row), "plan": engine.plan.describe(),
        "plan_settings": engine.plan.as_dict(), "tokens_per_s": tokens / seconds, "seconds_per_step": seconds,
        "losses": [r.loss for r in results], "steps_s": [r.seconds for r in results], "clipped_steps": clipped,
        "timed_steps": len(timed),
        "gpu_peak_reserved": gpu_peak,
        "gpu_cap": budget, "host_peak": rss.peak, "build_s": build_s, "engine_s": engine_s,
        "predicted_tokens_per_s": tokens / predicted_s if predicted_s else None,
        "predicted_s": predicted_s,
        "gpu_need": best.gpu_need if best is not None else None,
        "host_need": best.host_need if best is not None else None,
        "kept_packs": [q for q in range(engine.plan.num_packs) if engine.plan.kept(q)],
        "mlp_chunk_tokens": engine.mlp_chunk,
        "segment_attention": all(d.shell.segment_attention for d in engine.devices),
        "ssd_rates": ssd,
        # what the SSD tier moved in each step, measured by the engine (bytes; GB/s while in flight)
        "ssd_io": [{"read_bytes": r.ssd_read_bytes, "write_bytes": r.ssd_write_bytes,
                    "read_gbps": r.ssd_read_gbps, "write_gbps": r.ssd_write_gbps} for r in results]
        if row.offload else None,
        "memory_report": report.as_dict(),
        "memory_at_peak": at_peak,
        "activation_estimate": [{"phase": b.phase, "parts": dict(b.parts)} for b in estimated],
        "torch": torch.__version__,
        "gpu_name": torch.cuda.get_device_name(torch.device(row.devices[0])) if cuda else "cpu",
    }
    engine.close()
    return out


# --------------------------------------------------------------------------- the CLI row


def _cli(argv: list[str], log: Path, kill_after_lines: int | None = None, metrics: Path | None = None) -> int:
    """Run ``tinypipe ARGV`` in a process of its own; SIGKILL it once ``metrics`` has that many
    records. Returns its exit code (-9 when killed)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", HF_HUB_OFFLINE="1")
    with log.open("a") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "tinypipe.cli", *argv], env=env, stdout=fh,
                                stderr=subprocess.STDOUT)
        if kill_after_lines is None:
            return proc.wait(timeout=600)
        assert metrics is not None
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after_lines:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        return proc.wait(timeout=60)


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _small_model(root: Path) -> tuple[Path, Path]:
    """A random-init 8-block Llama (hidden 512) with a byte-level BPE tokenizer trained on the
    bundled demo corpus, saved like a hub checkpoint, and the corpus as JSONL."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = (ROOT / "tinypipe" / "data" / "demo_corpus.txt").read_text(encoding="utf-8")
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200][:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(paras, trainers.BpeTrainer(vocab_size=2048, special_tokens=["<s>", "</s>", "<pad>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                                   tie_word_embeddings=False, bos_token_id=fast.bos_token_id,
                                   eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    torch.manual_seed(0)
    model_dir = root / "base"
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in paras), encoding="utf-8")
    return model_dir, data


def run_cli_row(row: CliRow, scratch: Path, cap_gib: float) -> dict[str, Any]:
    import torch

    model_dir, data = _small_model(scratch)
    log = scratch / "cli.log"
    common = ["finetune", "--model", str(model_dir), "--data", str(data), "--seq-len", "256", "--global-batch", "8",
              "--steps", str(row.steps), "--lr", "3e-4", "--warmup-steps", "1", "--devices", row.device,
              *(["--gpu-memory", f"{cap_gib:g}GiB"] if row.device.startswith("cuda") else []), "--max-grad-norm", "1.0", "--checkpoint-every", str(row.every),
              "--no-progress"]
    t0 = time.perf_counter()
    whole, killed = scratch / "whole", scratch / "killed"
    rc_whole = _cli([*common, "--output", str(whole)], log)
    kill_at = row.steps // 2 + 1  # past the first checkpoint, before the end
    rc_kill = _cli([*common, "--output", str(killed)], log, kill_after_lines=kill_at,
                   metrics=killed / "metrics.jsonl")
    rc_resume = _cli([*common, "--output", str(killed), "--resume"], log)
    identical = None
    differing: list[str] = []
    if rc_whole == 0 and rc_resume == 0:
        a, b = _tensors(whole), _tensors(killed)
        differing = sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))
        identical = not differing and set(a) == set(b)
    losses = [json.loads(line)["loss"] for line in (whole / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line] if (whole / "metrics.jsonl").exists() else []
    # LoRA: the output is a PEFT adapter that PeftModel.from_pretrained loads over the base, with
    # adapters that moved from their zero init (not an empty adapter)
    lora_out = scratch / "lora"
    rc_lora = _cli([*common[:-3], "--no-progress", "--lora", "--lora-rank", "8", "--output", str(lora_out)], log)
    peft_loads, peft_err = None, None
    if rc_lora == 0:
        try:
            import peft
            import transformers

            base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
            pm = peft.PeftModel.from_pretrained(base, lora_out)
            trained = sum(float(p.abs().sum()) for n, p in pm.named_parameters() if "lora_B" in n)
            peft_loads = trained > 0  # the adapters moved from their zero init: not an empty adapter
        except Exception as exc:  # noqa: BLE001 - reported in the row
            peft_loads, peft_err = False, f"{type(exc).__name__}: {exc}"
    return {"kind": "cli", "row": dataclasses.asdict(row), "rc": [rc_whole, rc_kill, rc_resume, rc_lora],
            "killed_with": rc_kill, "identical": identical, "differing": differing[:10], "losses": losses,
            "peft_loads": peft_loads, "peft_error": peft_err, "seconds": time.perf_counter() - t0,
            "log_tail": log.read_text()[-3000:] if log.exists() else ""}


# --------------------------------------------------------------------------- the tests row


def run_tests_row(row: TestsRow, scratch: Path, cap_gib: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    import importlib.util

    # several workers: the GPU tests are short and mostly compile (CPU); each is a process of its own
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") is not None else []
    # no:logging: a failure's captured log (torch's DEBUG trace lines) would bury its assertion
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
                           "-p", "no:logging", "--durations=20", *workers, "-m", "gpu", "tests"], cwd=ROOT,
                          capture_output=True,
                          text=True, timeout=row.seconds * 2 + 60)
    text = proc.stdout + proc.stderr
    summary = next((line for line in reversed(text.splitlines()) if " passed" in line or " failed" in line), "")

    def count(word: str) -> int:
        for part in summary.replace("=", "").split(","):
            bits = part.split()
            if len(bits) >= 2 and bits[1].startswith(word):
                return int(bits[0])
        return 0

    failures = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"kind": "tests", "row": dataclasses.asdict(row), "rc": proc.returncode, "summary": summary,
            "passed": count("passed"), "failed": count("failed"), "errors": count("error"),
            "failures": failures[:20], "failure_text": failure_text(text), "seconds": time.perf_counter() - t0,
            "log_tail": text[-4000:], "slowest": _slowest(text)}


def _slowest(text: str) -> list[str]:
    """pytest's ``--durations`` lines (the slowest GPU tests): where the row's minutes go."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "slowest" in line and "durations" in line), None)
    if start is None:
        return []
    return [line.strip() for line in lines[start + 1:start + 30] if re.match(r"\s*\d+\.\d+s ", line)]


def failure_text(text: str, limit: int = 16000) -> str:
    """pytest's FAILURES section (each failure's traceback and assertion), cut to ``limit``
    characters: what a failed gpu-tests row must show without another device call."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("=") and " FAILURES " in line), None)
    if start is None:
        start = next((i for i, line in enumerate(lines) if line.startswith("=") and " ERRORS " in line), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("=")
                and ("short test summary" in lines[i] or "warnings summary" in lines[i])), len(lines))
    return "\n".join(lines[start:end])[:limit]


RUNNERS: dict[str, Callable[[Any, Path, float], dict[str, Any]]] = {
    "engine": run_engine_row, "cli": run_cli_row, "tests": run_tests_row,
}


def run_row(row: Row, cap_gib: float) -> dict[str, Any]:
    """Run ``row`` in this process (a scratch directory of its own, removed after)."""
    with tempfile.TemporaryDirectory(prefix="tinypipe-acceptance-") as tmp:
        return RUNNERS[row.kind](row, Path(tmp), cap_gib)


def finite(xs: list[float]) -> bool:
    return bool(xs) and all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)
