"""``tinypipe plan``'s text: the chosen plan, its predicted speed, memory per GPU and host by
category, what lives on the SSD (with an offload directory), the Config that realises it and the
time-memory trade-offs."""

from __future__ import annotations

from tinypipe.planner.estimate import PeakBreakdown
from tinypipe.planner.offload import disk_bytes, staging_shape, summary
from tinypipe.planner.search import HOST_BASELINE_BYTES, PlanResult
from tinypipe.planner.spill import HIDDEN_SHARE
from tinypipe.schedule.plan import host_stashed_inputs
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
        *long_context_lines(result),
        f"predicted: {t.step_s:.2f} s/step, {t.tokens_per_s:,.0f} tokens/s "
        f"(fill {t.fill_s:.2f} + forward {t.forward_s:.2f} [{t.forward_limit}] + head {t.head_s:.2f} + "
        f"backward {t.backward_s:.2f} [{t.backward_limit}] + tail {t.tail_s:.2f})",
        f"bound: compute {t.compute_s:.2f} s, upload {t.upload_s:.2f} s, download {t.download_s:.2f} s, "
        f"cpu optimizer {t.optimizer_s:.2f} s"
        + ("" if result.ssd is None else f", ssd read {t.ssd_read_s:.2f} s, ssd write {t.ssd_write_s:.2f} s "
           f"(limited by {t.limit})"),
        *([f"in a step where clipping triggers: {t.clipped_step_s:.2f} s/step, "
           f"{result.global_batch * result.seq / t.clipped_step_s:,.0f} tokens/s (the host AdamW waits for "
           "the global norm" + (f"; the GPU steps {len(b.plan.assisted)} layers' updates on their way up"
                                if b.plan.assisted else "") + ")"]
          if result.max_grad_norm is not None else []),
        "",
        "GPU memory per device (static pools exact, activations estimated):",
    ]
    peaks = result.peak_breakdown()
    for (name, cats), peak in zip(b.memory.devices.items(), peaks):
        act = cats.get("activations_peak", 0)
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in cats.items())
        total = b.memory.device_total(name) + act
        lines.append(f"  {name}: {fmt_bytes(total)} ({parts})")
        lines.append(f"    {breakdown_text(peak)}")
    lines.append(f"  + headroom (CUDA context, fragmentation): need {fmt_bytes(b.gpu_need)} of "
                 f"{fmt_bytes(result.gpu_memory_bytes)} on the fullest device")
    lines.append("host memory:")
    for k, v in b.memory.host.items():
        lines.append(f"  {k:<24} {fmt_bytes(v):>12}")
    lines.append(f"  {'total (tinypipe)':<24} {fmt_bytes(b.memory.host_total):>12}   "
                 f"+ process ~{fmt_bytes(HOST_BASELINE_BYTES)} = {fmt_bytes(b.host_need)} of "
                 f"{fmt_bytes(result.cpu_memory_bytes)}")
    if result.ssd is not None:
        lines += ssd_lines(result)
    kw = result.config_kwargs()
    lines.append("")
    lines.append("tinypipe.Config(" + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")")
    if len(result.pareto) > 1:
        lines.append("")
        clip = " (steps where clipping triggers)" if result.max_grad_norm is not None else ""
        lines.append(f"time-memory trade-offs{clip} ({result.fitting} of {result.considered} plans fit):")
        for c in result.pareto:
            sec = result.seconds(c)
            lines.append(f"  {sec:6.2f} s/step {result.global_batch * result.seq / sec:>9,.0f} tok/s  "
                         f"GPU {gib_text(c.gpu_need):>9}  host {gib_text(c.host_need):>9}  {c.describe()}")
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def breakdown_text(peak: PeakBreakdown) -> str:
    """One device's activation peak taken apart, for a reader: where it is and what it holds."""
    return f"activations peak ({peak.phase}): " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in peak.parts)


def long_context_lines(result: PlanResult) -> list[str]:
    """With chunked MLPs (long sequences): the chunk sizes and the largest MLP intermediate."""
    if not result.mlp_chunk_tokens:
        return []
    from tinypipe.planner.estimate import head_chunk_tokens
    from tinypipe.planner.sizes import dtype_bytes

    s, n, plan = result.sizes, result.mlp_chunk_tokens, result.best.plan
    one = n * s.intermediate * dtype_bytes(result.precision)
    embed = " and the embedding's output" if host_stashed_inputs(plan, True)[0] else ""
    return [f"long context: MLPs in chunks of {n:,} tokens (one intermediate {fmt_bytes(one)}), head and "
            f"loss in chunks of {head_chunk_tokens(s.vocab):,} tokens; micro-batch "
            f"{plan.micro_batch_size} x {result.seq:,} tokens, "
            f"{sum(plan.stash_on_host[1:])} of {plan.num_packs - 1} pack inputs{embed} stashed in host "
            "memory"
            + ("" if not plan.stash_on_ssd else f" ({len(plan.stash_on_ssd)} of them on the SSD)") + "; "
            f"{_attention_text(s.model_type, result.seq)}",
            "caution: at long sequences the GPU estimate's attention backward rests on one measured row "
            "(2 x 64K QLoRA on an H100: docs/long_context.md); leave headroom under the cap"]


def _attention_text(model_type: str, seq: int) -> str:
    """How packed documents attend at this length: per segment (models/segment_attention.py) for
    the families it supports, else through transformers' dense mask, which the estimate lacks."""
    from tinypipe.models.segment_attention import FAMILIES, segment_attention_for

    if segment_attention_for(None, seq) and model_type in FAMILIES:
        return "attention per document (no [S, S] mask)"
    mask = seq * seq  # one bool per (query, key) of a row
    return f"packed documents or padding add a {fmt_bytes(mask)} mask per row (not in the estimate)"


def stash_ssd_lines(result: PlanResult) -> list[str]:
    """Pack inputs stashed on the SSD (``Plan.stash_on_ssd``): how many, their scratch space, their
    bytes per step and their staging pool (nothing without)."""
    from tinypipe.planner.sizes import dtype_bytes
    from tinypipe.schedule.plan import host_gradient_boundaries, host_stashed_inputs
    from tinypipe.storage import stash_layout

    plan = result.best.plan
    n = len(plan.stash_on_ssd)
    if not n:
        return []
    long = bool(result.mlp_chunk_tokens)
    a = dtype_bytes(result.precision)
    B, S, H = result.global_batch, result.seq, result.sizes.hidden
    each = B * S * H * a
    grads = sum(host_gradient_boundaries(plan, long)[q] for q in plan.stash_on_ssd)
    disk = stash_layout.disk_bytes(n, batch=B, seq=S, hidden=H, itemsize=a)
    pool = stash_layout.staging_bytes(n, batch=B, seq=S, hidden=H, itemsize=a,
                                      micro_batch_size=plan.micro_batch_size,
                                      backward_micro_batch_size=plan.backward_micro_batch_size)
    return [f"  pack inputs: {n} of {sum(host_stashed_inputs(plan, long))} host-stashed ones on the SSD "
            f"(boundaries {','.join(map(str, plan.stash_on_ssd))}, {gib_text(each)} each; {grads} with their "
            f"gradient in the same rows), scratch {gib_text(disk)}; per step write "
            f"{gib_text((n + grads) * each)}, "
            f"read {gib_text((2 * n + grads) * each)}; staging pool {gib_text(pool)} "
            "(host memory, counted above)"]


def ssd_lines(result: PlanResult) -> list[str]:
    """The SSD tier: per kind what is where, the staging pool, the scratch file, the bytes per step
    and what bounds the step, and the global batch that hides the I/O."""
    b, ssd, t = result.best, result.ssd, result.best.time
    assert ssd is not None
    where = f"{ssd.directory}; " if ssd.directory else ""
    source = f": {ssd.source}" if ssd.source else ""
    both = (f", both at once {ssd.mixed_gbps:.2f} GB/s" if ssd.mixed_gbps
            else ", reads and writes planned one after the other")
    head = (f"SSD tier ({where}read {ssd.read_gbps:.2f} GB/s, write {ssd.write_gbps:.2f} GB/s{both}"
            f"{source}):")
    if not b.plan.offload and not b.plan.stash_on_ssd:
        return [head, "  nothing on the SSD: the training state fits in host memory"]
    if not b.plan.offload:
        return [head, *stash_ssd_lines(result)] + [
            f"  per step: read {gib_text(t.ssd_read_bytes)} ({t.ssd_read_s:.1f} s), write "
            f"{gib_text(t.ssd_write_bytes)} ({t.ssd_write_s:.1f} s); the step is bound by {t.limit}"]
    lines = [head, f"  {'state':<9} {'layers on SSD':>14} {'on SSD':>12} {'in DRAM':>12}"]
    for k in summary(result.sizes, b.plan, result.precision, retain_grads=result.retain_grads):
        lines.append(f"  {k.kind:<9} {f'{k.on_ssd} of {k.layers}':>14} {gib_text(k.ssd_bytes):>12} "
                     f"{gib_text(k.dram_bytes):>12}")
    pools = staging_shape(result.sizes, b.plan, precision=result.precision)
    disk = disk_bytes(result.sizes, b.plan.offload, result.precision)
    free = "" if ssd.free_bytes is None else f" of {gib_text(ssd.free_bytes)} free"
    parts = [f"{n} x {fmt_bytes(size)} ({what})" for n, size, what in (
        (pools.upload_slots, pools.upload_slot_bytes, "uploads"),
        (pools.update_slots, pools.update_slot_bytes, "optimizer steps")) if n]
    lines.append(f"  staging pools {' + '.join(parts)} = {gib_text(pools.nbytes)} (host memory, "
                 f"counted above); scratch file {gib_text(disk)}{free}")
    lines += stash_ssd_lines(result)
    lines.append(f"  per step: read {gib_text(t.ssd_read_bytes)} ({t.ssd_read_s:.1f} s), write "
                 f"{gib_text(t.ssd_write_bytes)} ({t.ssd_write_s:.1f} s); the step is bound by {t.limit}")
    h = result.hiding
    if h is not None and h.batch is not None:
        fits = "" if h.fits_gpu else f" (but this plan needs {gib_text(h.gpu_need or 0)} GPU memory there)"
        lines.append(f"  I/O hidden (adds < {HIDDEN_SHARE:.0%} to the step) from a global batch of {h.batch} "
                     f"x {result.seq} tokens: {h.step_s:.2f} s/step, {h.tokens_per_s:,.0f} tokens/s, "
                     f"{gib_text(h.ssd_bytes)} on the SSD{fits}" + (f"; {h.note}" if h.note else ""))
    elif h is not None:
        lines.append(f"  I/O not hidden at any global batch: {h.note}")
    return lines
