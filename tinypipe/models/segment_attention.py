"""Attention over packed documents and sliding windows without a dense ``[B, 1, S, S]`` mask.

Why: transformers turns packed documents (position ids restarting inside a row), padding and
sliding windows into a dense boolean mask per row -- 16 GiB for one 128K-token sequence, built on
every device that runs a block, and it keeps SDPA off its flash kernel. A long-context run of
packed documents therefore overflowed a 24 GiB GPU before its first block.

Here the trunk builds no mask: the shell's model runs under the attention implementation
:data:`SEGMENT_ATTENTION`, for which transformers' mask builders return ``None``, and the shell
hands every block call the row's segment starts (:func:`segment_starts`: a new document where the
position ids do not continue, a new segment where the padding mask changes). The attention then
runs SDPA with ``is_causal`` on each segment alone -- memory linear in the sequence, the flash
kernel on CUDA -- and, for a sliding window shorter than a segment, on blocks of queries against
the window's keys with a small mask (``window + block`` keys per block). Every real token sees
exactly the keys the dense mask let it see, so results equal the masked attention to float
rounding; padding tokens attend among themselves (never to real tokens, never seen by them), which
changes nothing a loss on the real tokens depends on.

Only the families whose decoder layers hand their keyword arguments through to the attention
function are switched (:data:`FAMILIES`, checked against transformers' modeling code); others keep
the dense masks. A block call without segment starts raises instead of attending across documents.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tinypipe.errors import UnsupportedModelError
from tinypipe.models.chunked_mlp import LONG_SEQUENCE_TOKENS
from tinypipe.models.tiled_attention import tiled_causal_attention, tiles_apply

#: The attention implementation's name in transformers' registry (the shell's config points at it).
SEGMENT_ATTENTION = "tinypipe_segments"
#: The block-call keyword carrying a ``[B, S]`` bool tensor: True where a segment starts.
STARTS_KWARG = "tinypipe_segment_starts"
#: Model families whose layers pass ``**kwargs`` (and ``sliding_window``) on to the attention
#: function and build their masks through ``masking_utils`` (transformers 5).
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
#: The shell config's attributes holding the attention tile (``Config.attention_tile_tokens``; 0:
#: whole segments) and its kernel (models/tiled_attention.py ``KERNELS``).
TILE_ATTR = "tinypipe_attention_tile"
KERNEL_ATTR = "tinypipe_attention_kernel"
#: Queries per block when a sliding window is shorter than a segment (at least the window): each
#: block's mask is block x (block + window) booleans.
WINDOW_BLOCK_TOKENS = 4096


def segment_attention_for(setting: bool | None, seq_len: int | None) -> bool:
    """Whether to ask for segment attention (``Config.segment_attention``): the setting if given,
    else on for sequences longer than :data:`~tinypipe.models.chunked_mlp.LONG_SEQUENCE_TOKENS`
    -- short runs keep transformers' masks and compute bit for bit what they did."""
    if setting is not None:
        return bool(setting)
    return seq_len is not None and seq_len > LONG_SEQUENCE_TOKENS


def segment_attention_supported(model: nn.Module) -> bool:
    """Whether ``model`` (a transformers causal LM) can run :data:`SEGMENT_ATTENTION`: a listed
    family whose attention is SDPA (eager/flash/flex implementations are left as they are)."""
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) in FAMILIES
            and getattr(config, "_attn_implementation", None) == "sdpa")


def use_segment_attention(model: nn.Module, tile: int = 0, kernel: str = "") -> None:
    """Point ``model``'s config (a shell's own deep copy) at :data:`SEGMENT_ATTENTION`, registering
    it with transformers first, with ``tile`` tokens per attention tile run by ``kernel``
    (:mod:`~tinypipe.models.tiled_attention`; 0: whole segments). Registration is transformers'
    extension point: a name mapped to a function, idempotent, not read by anything else."""
    from transformers import AttentionInterface

    if SEGMENT_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(SEGMENT_ATTENTION, segment_attention_forward)
    model.config._attn_implementation = SEGMENT_ATTENTION
    setattr(model.config, TILE_ATTR, int(tile) if kernel else 0)
    setattr(model.config, KERNEL_ATTR, kernel)


def segment_starts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   position_ids: torch.Tensor | None) -> torch.Tensor:
    """``[B, S]`` bool: True at every token that starts a segment -- the row's first token, a
    position id that does not continue the previous one (a packed document), a change of the
    padding mask."""
    batch, seq = input_ids.shape[0], input_ids.shape[-1]
    starts = torch.zeros(batch, seq, dtype=torch.bool, device=input_ids.device)
    starts[:, 0] = True
    if position_ids is not None:
        pos = position_ids.expand(batch, -1)
        starts[:, 1:] |= pos[:, 1:] != pos[:, :-1] + 1
    if attention_mask is not None and attention_mask.dim() == 2:
        mask = attention_mask.to(torch.bool)
        starts[:, 1:] |= mask[:, 1:] != mask[:, :-1]
    return starts


def _bounds(starts: torch.Tensor) -> list[tuple[int, ...]]:
    """Per row, the segments' first tokens (one device-to-host copy for the whole micro-batch)."""
    rows, cols = starts.nonzero(as_tuple=True)
    firsts: list[list[int]] = [[] for _ in range(starts.shape[0])]
    for r, c in zip(rows.tolist(), cols.tolist()):
        firsts[r].append(c)
    return [tuple(f) for f in firsts]


def _sdpa(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          mask: torch.Tensor | None, dropout: float, scaling: float | None) -> torch.Tensor:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling,
                                    is_causal=mask is None)
    return out


def _segment(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
             scaling: float | None, window: int | None) -> torch.Tensor:
    """Causal attention within one segment (``[B, H, L, D]`` -> ``[B, L, H, D]``); a key ``j``
    is seen by query ``i`` when ``j <= i`` and, with a window, ``j > i - window`` (transformers'
    sliding-window overlay). A segment longer than the attention tile runs in tiles
    (:mod:`~tinypipe.models.tiled_attention`: its backward holds a tile's temporaries, not the
    whole segment's)."""
    length = q.shape[2]
    if window is None or length <= window:
        config = getattr(module, "config", None)
        tile = int(getattr(config, TILE_ATTR, 0) or 0)
        if tiles_apply(q, k, dropout, tile):
            return tiled_causal_attention(q, k, v, scaling, tile, getattr(config, KERNEL_ATTR))
        return _sdpa(module, q, k, v, None, dropout, scaling)
    block = max(int(window), WINDOW_BLOCK_TOKENS)
    parts = []
    for a in range(0, length, block):
        b = min(length, a + block)
        k0 = max(0, a - window + 1)
        qi = torch.arange(a, b, device=q.device)[:, None]
        kj = torch.arange(k0, b, device=q.device)[None, :]
        mask = (kj <= qi) & (kj > qi - window)
        parts.append(_sdpa(module, q[:, :, a:b], k[:, :, k0:b], v[:, :, k0:b], mask[None, None],
                           dropout, scaling))
    return torch.cat(parts, dim=1)


def _row(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         firsts: tuple[int, ...], dropout: float, scaling: float | None,
         window: int | None) -> torch.Tensor:
    if len(firsts) == 1:  # one segment: no slices (their backward would copy q, k and v's gradients)
        return _segment(module, q, k, v, dropout, scaling, window)
    ends = (*firsts[1:], q.shape[2])
    parts = [_segment(module, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], dropout, scaling, window)
             for s, e in zip(firsts, ends)]
    return torch.cat(parts, dim=1)


@torch.compiler.disable
def segment_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None,
                              dropout: float = 0.0, scaling: float | None = None,
                              sliding_window: int | None = None, **kwargs: Any
                              ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (``query`` ``[B, H, S, D]``; returns
    ``[B, S, H, D]``). Rows whose segments coincide run together. Kept out of torch.compile:
    segment lengths change from batch to batch and would recompile the block every time."""
    starts = kwargs.get(STARTS_KWARG)
    if starts is None:
        raise UnsupportedModelError(
            f"{type(module).__name__}: its decoder layer did not pass the segment starts to the "
            f"attention; long-sequence attention needs a family in {sorted(FAMILIES)}")
    if attention_mask is not None:
        raise UnsupportedModelError(f"{type(module).__name__}: a mask reached segment attention")
    if starts.shape[0] != query.shape[0] or starts.shape[-1] != query.shape[2]:
        raise ValueError(f"segment starts {tuple(starts.shape)} do not match the queries "
                         f"{tuple(query.shape)}")
    window = int(sliding_window) if sliding_window else None
    bounds = _bounds(starts)
    if all(b == bounds[0] for b in bounds):
        return _row(module, query, key, value, bounds[0], dropout, scaling, window), None
    rows = [_row(module, query[i:i + 1], key[i:i + 1], value[i:i + 1], b, dropout, scaling, window)
            for i, b in enumerate(bounds)]
    return torch.cat(rows, dim=0), None
