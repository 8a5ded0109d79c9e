"""A plan someone already has (a saved plan, a benchmark's), priced and sized like the search's own.

Why: "what would this plan cost on my box, and how far is it from what the planner picks?" comes
before renting a machine, and it is how a measured plan's prediction is checked offline
(``tinypipe plan --evaluate FILE``). The plan is evaluated by the same memory estimator and time
model as every candidate of the search (:func:`~tinypipe.planner.candidate.evaluate`), against the
same budgets; the search's choice stays beside it for comparison.
"""

from __future__ import annotations

import dataclasses

from tinypipe.errors import ConfigError, PlanDoesNotFitError
from tinypipe.planner.candidate import evaluate
from tinypipe.planner.search import PLAN_ONLY_NOTE, PlanResult, ranking_seconds
from tinypipe.schedule.plan import Plan
from tinypipe.units import gib_pair, gib_text


def with_given_plan(result: PlanResult, plan: Plan) -> PlanResult:
    """``result`` (a search for the same model, machine and workload) with ``plan`` as its best
    and only candidate, and a note comparing it with the search's choice. The plan is sized with
    ``result``'s attention tile: search at the tile the engine runs the plan with (a plan given to
    the engine runs ``Config.attention_tile_tokens``, else the default tile). Raises
    :class:`ConfigError` when ``plan`` is not for this model's blocks or this many GPUs, and
    :class:`PlanDoesNotFitError` (saying what it needs) when it does not fit the budgets."""
    blocks = sorted(b for pack in plan.packs for b in pack)
    if blocks != list(range(result.sizes.num_blocks)):
        raise ConfigError(f"the plan's packs hold {len(blocks)} blocks ({blocks[:1]}..{blocks[-1:]}); "
                          f"the model has {result.sizes.num_blocks}: it was made for another model")
    if plan.num_devices != result.gpus:
        raise ConfigError(f"the plan is for {plan.num_devices} GPU(s), --gpus is {result.gpus}")
    cand = evaluate(result.sizes, result.hardware, plan, seq=result.seq, global_batch=result.global_batch,
                    precision=result.precision, max_grad_norm=result.max_grad_norm,
                    mlp_chunk=result.mlp_chunk_tokens)
    if cand.gpu_need > result.gpu_memory_bytes:
        need, have = gib_pair(cand.gpu_need, result.gpu_memory_bytes)
        raise PlanDoesNotFitError(f"this plan ({plan.describe()}) needs {need} on its fullest GPU, "
                                  f"have {have}")
    if cand.host_need > result.cpu_memory_bytes:
        need, have = gib_pair(cand.host_need, result.cpu_memory_bytes)
        raise PlanDoesNotFitError(f"this plan ({plan.describe()}) needs {need} of host memory, have {have}")
    clipping = result.max_grad_norm is not None
    mine, best = ranking_seconds(cand, clipping), ranking_seconds(result.best, clipping)
    note = (f"the planner's own choice for these budgets: {best:.3f} s/step, this plan {mine:.3f} "
            f"({(mine / best - 1) * 100:+.1f} %): {result.best.describe()}")
    parts = (("assisted layers", plan.assisted), ("deferred layers", plan.deferred))
    only = [what for what, on in parts if on]
    searched = PLAN_ONLY_NOTE.format(what="assisted layers")  # said of the search's plan, not this one
    notes = [n for n in result.notes if n != searched]
    notes += [PLAN_ONLY_NOTE.format(what=" and ".join(only))] if only else []
    return dataclasses.replace(result, best=cand, pareto=[cand], notes=[*notes, note])
