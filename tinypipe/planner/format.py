"""``tinypipe plan``'s text: the chosen plan, its predicted speed, memory per GPU and host by
category, the Config that realises it and the time-memory trade-offs."""

from __future__ import annotations

from tinypipe.planner.search import HOST_BASELINE_BYTES, PlanResult
from tinypipe.units import fmt_bytes, gib_text


def format_plan(result: PlanResult) -> str:
    """Human-readable plan: the choice, predicted speed, memory per GPU and host by category."""
    b = result.best
    s = result.sizes
    t = b.time
    lines = [
        f"model: {result.model_name or s.model_type} ({s.model_type}, {s.param_count / 1e9:.2f} B params, "
        f"{s.num_blocks} blocks, hidden {s.hidden}, vocab {s.vocab}{', tied embeddings' if s.tied else ''})",
        f"hardware: {result.gpus} x {result.hardware.name} ({gib_text(result.gpu_memory_bytes)} each), "
        f"host {gib_text(result.cpu_memory_bytes)}; {result.precision}, "
        f"{result.global_batch} x {result.seq} tokens/step"
        + (f", clip {result.max_grad_norm}" if result.max_grad_norm is not None else ""),
        f"plan: {b.describe()}",
        f"predicted: {t.step_s:.2f} s/step, {t.tokens_per_s:,.0f} tokens/s "
        f"(fill {t.fill_s:.2f} + forward {t.forward_s:.2f} [{t.forward_limit}] + head {t.head_s:.2f} + "
        f"backward {t.backward_s:.2f} [{t.backward_limit}] + tail {t.tail_s:.2f})",
        f"bound: compute {t.compute_s:.2f} s, upload {t.upload_s:.2f} s, download {t.download_s:.2f} s, "
        f"cpu optimizer {t.optimizer_s:.2f} s",
        *([f"in a step where clipping triggers: {t.clipped_step_s:.2f} s/step, "
           f"{result.global_batch * result.seq / t.clipped_step_s:,.0f} tokens/s (the host AdamW waits for "
           "the global norm)"] if result.max_grad_norm is not None else []),
        "",
        "GPU memory per device (static pools exact, activations estimated):",
    ]
    for name, cats in b.memory.devices.items():
        act = cats.get("activations_peak", 0)
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in cats.items())
        total = b.memory.device_total(name) + act
        lines.append(f"  {name}: {fmt_bytes(total)} ({parts})")
    lines.append(f"  + headroom (CUDA context, fragmentation): need {fmt_bytes(b.gpu_need)} of "
                 f"{fmt_bytes(result.gpu_memory_bytes)} on the fullest device")
    lines.append("host memory:")
    for k, v in b.memory.host.items():
        lines.append(f"  {k:<24} {fmt_bytes(v):>12}")
    lines.append(f"  {'total (tinypipe)':<24} {fmt_bytes(b.memory.host_total):>12}   "
                 f"+ process ~{fmt_bytes(HOST_BASELINE_BYTES)} = {fmt_bytes(b.host_need)} of "
                 f"{fmt_bytes(result.cpu_memory_bytes)}")
    kw = result.config_kwargs()
    lines.append("")
    lines.append("tinypipe.Config(" + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")")
    if len(result.pareto) > 1:
        lines.append("")
        lines.append(f"time-memory trade-offs ({result.fitting} of {result.considered} plans fit):")
        for c in result.pareto:
            lines.append(f"  {c.time.step_s:6.2f} s/step {c.tokens_per_s:>9,.0f} tok/s  "
                         f"GPU {gib_text(c.gpu_need):>9}  host {gib_text(c.host_need):>9}  {c.describe()}")
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
