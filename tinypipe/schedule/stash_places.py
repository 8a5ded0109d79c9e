"""Where each pack boundary's stash lives once some are on the SSD (``Plan.stash_on_ssd``): the
host-memory buffers the engine allocates and the planner counts are
:func:`~tinypipe.schedule.plan.host_stashed_inputs`' boundaries less the SSD's
(:mod:`tinypipe.runtime.ssd_stash` keeps those in files behind a staging pool)."""

from __future__ import annotations

from tinypipe.schedule import plan as plan_rules
from tinypipe.schedule.plan import Plan


def host_memory_stashes(plan: Plan, long_sequences: bool) -> tuple[bool, ...]:
    """Per pack boundary ``q`` (0..P): whether a ``[B, S, H]`` host-memory buffer holds pack
    ``q``'s input: :func:`~tinypipe.schedule.plan.host_stashed_inputs` less ``Plan.stash_on_ssd``."""
    on_ssd = set(plan.stash_on_ssd)
    # (looked up on the module: one rule, wherever a caller or a test replaces it)
    stashed = plan_rules.host_stashed_inputs(plan, long_sequences)
    return tuple(h and q not in on_ssd for q, h in enumerate(stashed))
