"""Which parameters AdamW decays: Hugging Face Trainer's rule, as runs of a layer's flat buffer.

HF Trainer (``Trainer.get_decay_parameter_names``, transformers 5.x) decays every parameter
except those inside an ``nn.LayerNorm`` and those whose lower-cased name matches ``bias``,
``layernorm``, ``rmsnorm``, ``(^|.)norm(.|$)`` or ``_norm(.|$)`` -- biases and the weights of
every LayerNorm/RMSNorm variant the supported families use (``input_layernorm``, ``ln_1``,
``q_norm``, ``model.norm``, ``final_layer_norm``, ...). Embeddings and the output embedding are
decayed, as in HF. tests/test_train_semantics.py checks this module against the installed
transformers' own method for every family.

A layer's flat buffer mixes both kinds; :class:`DecayGroups` holds, per layer, the element
ranges that are *not* decayed (alignment gaps join their neighbours: their values and gradients
are zero, so decaying them or not changes nothing), so the optimizer can apply the decay per
run while a layer without such a range still steps in one fused call.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from torch import nn

from tinypipe.models.decompose import LayerSpec

#: Trainer.get_decay_parameter_names' name patterns (transformers 5.23), matched lower-cased
NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def hf_decay_names(model: nn.Module) -> set[str]:
    """Names of the parameters HF Trainer decays (the rule above, with transformers' own walker)."""
    from transformers.trainer_pt_utils import get_parameter_names

    return set(get_parameter_names(model, [nn.LayerNorm], list(NO_DECAY_PATTERNS)))


@dataclass(frozen=True)
class DecayGroups:
    """Per layer index, the sorted, disjoint ``(lo, hi)`` element ranges of its trainable prefix
    that AdamW steps without weight decay (layers absent: everything decayed)."""

    no_decay: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    #: the no-decay parameter names (for checkpoints and messages)
    names: tuple[str, ...] = ()
    rule: str = "all"  # "hf" (the rule above) or "all" (every parameter decayed)

    @staticmethod
    def build(layers: Sequence[LayerSpec], decayed: Iterable[str] | None) -> "DecayGroups":
        """Groups for ``layers`` given the names that are decayed (None: all of them)."""
        if decayed is None:
            return DecayGroups()
        keep = set(decayed)
        out: dict[int, tuple[tuple[int, int], ...]] = {}
        names: list[str] = []
        for spec in layers:
            runs = _no_decay_runs(spec, keep)
            if runs:
                out[spec.index] = runs
            names += [p.name for p in spec.trainable_params if p.name not in keep]
        return DecayGroups(out, tuple(sorted(names)), "hf")

    def runs(self, layer: int) -> tuple[tuple[int, int], ...]:
        return self.no_decay.get(layer, ())

    def pieces(self, layer: int, lo: int, hi: int) -> list[tuple[int, int, bool]]:
        """``lo:hi`` cut into ``(a, b, decayed)`` runs, in order (one piece when not mixed)."""
        runs = self.no_decay.get(layer)
        if not runs:
            return [(lo, hi, True)]
        out, at = [], lo
        for a, b in runs:
            a, b = max(a, lo), min(b, hi)
            if a >= b:
                continue
            if at < a:
                out.append((at, a, True))
            out.append((a, b, False))
            at = b
        if at < hi:
            out.append((at, hi, True))
        return out

    def record(self) -> dict:
        """What a checkpoint stores: the rule and a digest of the no-decay names (plus how many)."""
        digest = hashlib.sha256("\n".join(self.names).encode()).hexdigest()[:16]
        return {"rule": self.rule, "no_decay": len(self.names), "digest": digest}


def _no_decay_runs(spec: LayerSpec, decayed: set[str]) -> tuple[tuple[int, int], ...]:
    """Maximal ranges of not-decayed parameters in ``spec``'s trainable prefix (gaps absorbed)."""
    params = sorted(spec.trainable_params, key=lambda p: p.offset)
    runs: list[list[int]] = []
    for i, p in enumerate(params):
        end = params[i + 1].offset if i + 1 < len(params) else spec.train_numel  # through the gap
        if p.name in decayed:
            continue
        if runs and runs[-1][1] == p.offset:
            runs[-1][1] = end
        else:
            runs.append([p.offset, end])
    return tuple((a, b) for a, b in runs)
