"""What a kept pack's graphs hold (``Plan.keep_activations``): the bytes the memory estimator
counts on the device (or, ``Plan.kept_on_host``, in host memory) and the time model moves over the
link. Its own module: the estimator and the time model both read it."""

from __future__ import annotations

from tinypipe.planner.sizes import ModelSizes, dtype_bytes
from tinypipe.schedule.plan import Plan


def kept_bytes(sizes: ModelSizes, plan: Plan, q: int, *, batch: int, seq: int, precision: str,
               hidden: int | None = None, act_per_token: float | None = None) -> int:
    """Device bytes pack ``q``'s kept graphs hold between its forward and its backward (every
    forward micro-batch of the step): what a kept block saves per token (the probe's
    ``kept_block_bytes``: the compact set, models/compact.py, or the full graph), the inputs of
    the pack's inner blocks, the pack's outputs (each graph is differentiated from its output
    tensor), and -- when the pack reads its input from host
    memory or from another device -- the device copies of its input the graphs may save (an input
    stashed on the device is counted with the stash, alive until the pack's backward anyway)."""
    H = hidden or sizes.hidden
    a = dtype_bytes(precision)
    act_tok = act_per_token or sizes.kept_block_bytes(precision)
    n = len(plan.packs[q])
    tokens = batch * seq
    out = tokens * (act_tok * n + H * a * (n - 1) + H * a)
    owner = plan.embed_device if q == 0 else plan.fwd_device[q]
    if (q > 0 and plan.stash_on_host[q]) or owner != plan.fwd_device[q]:
        out += tokens * H * a
    return int(out)
