"""A wrecked run stops instead of training on silently: after a step with a gradient norm of exactly
0 or a non-finite loss or norm (``--lr 1e6``: the loss sits at ln(vocabulary), every prediction
uniform, and nothing can move the weights any more), :func:`check_progress` raises
:class:`~tinypipe.errors.StalledError` -- before that step's checkpoint is written, so the last one
is still from a healthy model. A step with no tokens, or one the engine skipped, is not judged.
"""

from __future__ import annotations

import math

from tinypipe.errors import StalledError


def check_progress(record: dict, vocab_size: int | None, lr: float) -> None:
    """Raise StalledError (one line) when the step ``record`` (see ``train``) shows a wrecked model."""
    if record.get("tokens", 0) <= 0 or record.get("skipped"):
        return
    loss, norm = float(record["loss"]), float(record["grad_norm"])
    if math.isfinite(loss) and math.isfinite(norm) and norm > 0.0:
        return
    what = f"gradient norm {norm:g}" if math.isfinite(loss) else f"loss {loss}"
    uniform = ""
    if vocab_size and math.isfinite(loss) and abs(loss - math.log(vocab_size)) < 1e-2:
        uniform = (f" (loss {loss:.4f} = ln of the {vocab_size}-token vocabulary: every prediction is "
                   "uniform)")
    raise StalledError(f"training stalled at step {record['step']}: {what}{uniform}; the model is wrecked "
                       f"(learning rate {lr:g} too high?) and cannot learn on; its checkpoint was not "
                       "written: lower --lr and start over with --overwrite")
