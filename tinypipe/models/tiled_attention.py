"""Causal attention over one long segment in tiles of queries x keys, through the fused kernel's own
forward and backward.

Why: the fused (flash) backward over a whole segment allocates, beside the block's saved tensors,
about seven rows of the query width per token -- the output gradient and the kernel's copy of it,
dQ and its fp32 accumulator, and dK/dV expanded to the query heads (grouped-query attention sums
them after). At 256K tokens of the 8B shape that is 14 GiB, more than half a 24 GiB GPU.

Here a segment of ``L`` tokens is cut into blocks of ``T``; tile ``(i, j)``, ``j <= i``, is query
block ``i`` against key block ``j`` -- the diagonal tiles causal (square, so the kernel's causal
alignment is the right one), the others unmasked. The forward merges a query block's tiles by
their log-sum-exp (the softmax over the whole prefix, exact up to rounding); the backward runs the
kernel's backward on every tile with the *merged* output and log-sum-exp, which makes each tile's
gradients those of the whole softmax restricted to its keys, and sums dQ over ``j`` in fp32 at one
block's size and dK/dV over ``i`` in fp32 at the key heads' width. What a backward holds beyond its
inputs is then dQ, the fp32 dK/dV of the key heads and their results, and one tile's temporaries
(:func:`tiled_backward_bytes_per_token`). Keys and values are expanded to the query heads one key
block at a time, never the whole segment.

The kernels: flash attention on CUDA (half precision), the CPU flash kernel on the CPU (which is
also what the tests run). Elsewhere (fp32 on CUDA, dropout, a head size the kernel refuses) the
caller keeps the whole-segment SDPA call (:func:`tiles_apply`).
"""

from __future__ import annotations

import torch

#: Tokens per query / key block. A tile's temporaries are ~22 bytes per query-width element of one
#: block (8K tokens of the 8B shape: ~0.7 GiB); at 8K x 8K a tile keeps the kernel at full rate.
ATTENTION_TILE_TOKENS = 8192
_HALF = (torch.float16, torch.bfloat16)


def tiles_apply(query: torch.Tensor, key: torch.Tensor, dropout: float, tile: int) -> bool:
    """Whether a segment (``query`` ``[B, Hq, L, D]``) runs in tiles: longer than one tile, no
    attention dropout, and a tile kernel for its device and dtype."""
    if tile <= 0 or query.shape[2] <= tile or dropout > 0.0:
        return False
    if query.shape[1] % key.shape[1] != 0:
        return False
    if query.device.type == "cpu":
        return True
    return (query.device.type == "cuda" and query.dtype in _HALF and query.shape[-1] % 8 == 0
            and query.shape[-1] <= 256 and torch.backends.cuda.flash_sdp_enabled())


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and log-sum-exps are kept in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated to the query heads (head ``h`` of the queries reads ``h // groups``),
    contiguous as the kernels want it."""
    if groups == 1:
        return x.contiguous()
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def _reduce(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient at the query heads summed back to the key heads, in the accumulation dtype
    (summed there without an upcast copy of ``dx``)."""
    b, h, n, d = dx.shape
    acc = _accumulation(dx.dtype)
    if groups == 1:
        return dx.to(acc)
    return dx.view(b, h // groups, groups, n, d).sum(2, dtype=acc)


def _tile_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's output (``q``'s dtype) and log-sum-exp (fp32, ``[B, H, Lq]``)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse.to(_accumulation(q.dtype))


def _tile_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's backward for one tile, given the merged output and log-sum-exp of its queries
    (no dropout: the random-state arguments are not read)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    unused = torch.empty((), dtype=torch.long)  # the random state (read only with dropout)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, unused, unused,
        scale=scale)[:3]


def tile_kernel_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the tiles, on ``device`` in ``dtype``, give what the whole-segment kernel gives on a
    small problem (two query blocks, grouped heads): the private kernel entry points they call are
    checked where they run, once per shell (models/shell.py), instead of trusted. The CPU kernel is
    what the tests check; there this is True."""
    if device.type == "cpu":
        return True
    return dtype in _HALF and tiles_agree(device, dtype)


def tiles_agree(device: torch.device, dtype: torch.dtype) -> bool:
    """The check of :func:`tile_kernel_works` (any device): tiles of 128 against one 256-token
    segment, output and gradients within 2 % of the largest value."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v, dout = (torch.randn(1, heads, 256, 64, generator=g).to(device, dtype)
                         for heads in (4, 2, 2, 4))
        scale = 64 ** -0.5
        out, lse = _forward(q, k, v, scale, 128)
        grads = _backward(dout, q, k, v, out, lse, scale, 128)
        kw, vw = _expand(k, 2), _expand(v, 2)
        ref_out, ref_lse = _tile_forward(q, kw, vw, True, scale)
        ref = _tile_backward(dout, q, kw, vw, ref_out, ref_lse, True, scale)
        ref_grads = (ref[0], _reduce(ref[1], 2), _reduce(ref[2], 2))
        for x, y in zip((out, *grads), (ref_out, *ref_grads)):
            y = y.float()
            if not (x.float() - y).abs().max() <= 2e-2 * y.abs().max():
                return False
        return True
    except RuntimeError:
        return False


def _blocks(length: int, tile: int) -> list[tuple[int, int]]:
    return [(a, min(length, a + tile)) for a in range(0, length, tile)]


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged output (``q``'s layout and dtype) and log-sum-exp of every query block."""
    groups = q.shape[1] // k.shape[1]
    blocks = _blocks(q.shape[2], tile)
    acc_dtype = _accumulation(q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=acc_dtype, device=q.device)
    for i, (a, b) in enumerate(blocks):
        qi = q[:, :, a:b]
        acc, acc_lse = None, None
        for j in range(i + 1):
            c, d = blocks[j]
            o, l = _tile_forward(qi, _expand(k[:, :, c:d], groups), _expand(v[:, :, c:d], groups),
                                 i == j, scale)
            if acc is None:
                acc, acc_lse = o.to(acc_dtype, copy=True), l
                continue
            # softmax over the union of the key blocks: weights exp(lse_part - lse_union)
            new_lse = torch.logaddexp(acc_lse, l)
            acc.mul_(torch.exp(acc_lse - new_lse).unsqueeze(-1))
            acc.add_(o.to(acc_dtype) * torch.exp(l - new_lse).unsqueeze(-1))
            acc_lse = new_lse
        out[:, :, a:b] = acc
        lse[:, :, a:b] = acc_lse
    return out, lse


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, scale: float,
              tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = q.shape[1] // k.shape[1]
    blocks = _blocks(q.shape[2], tile)
    acc_dtype = _accumulation(q.dtype)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
    for i, (a, b) in enumerate(blocks):
        # views: the kernels read [B, L, H, D]-strided rows as they are; the log-sum-exp
        # must be contiguous (torch's ring attention found wrong gradients otherwise)
        qi, oi, di = q[:, :, a:b], out[:, :, a:b], dout[:, :, a:b]
        li = lse[:, :, a:b].contiguous()
        dqi = None
        for j in range(i + 1):
            c, d = blocks[j]
            dq_t, dk_t, dv_t = _tile_backward(di, qi, _expand(k[:, :, c:d], groups),
                                              _expand(v[:, :, c:d], groups), oi, li, i == j, scale)
            dqi = dq_t.to(acc_dtype, copy=True) if dqi is None else dqi.add_(dq_t)
            dk[:, :, c:d] += _reduce(dk_t, groups)
            dv[:, :, c:d] += _reduce(dv_t, groups)
            del dq_t, dk_t, dv_t
        dq[:, :, a:b] = dqi
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# One opaque operator each way (torch.library): selective checkpointing (a kept pack's compact
# graph, models/compact.py) then sees and saves one attention output and log-sum-exp, as for the
# fused kernel, instead of every tile's -- and the in-place merges stay out of its sight.
@torch.library.custom_op("tinypipe::tiled_causal_attention", mutates_args=())
def tiled_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, scale, tile)


@tiled_attention_op.register_fake
def _(q, k, v, scale, tile):  # type: ignore[no-untyped-def]
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=_accumulation(q.dtype))


@torch.library.custom_op("tinypipe::tiled_causal_attention_backward", mutates_args=())
def tiled_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, scale: float,
                                tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, lse, scale, tile)


@tiled_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, scale, tile):  # type: ignore[no-untyped-def]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, scale, tile = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.tile = scale, tile


def _grad(ctx, dout, dlse):  # type: ignore[no-untyped-def]
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = tiled_attention_backward_op(dout, q, k, v, out, lse, ctx.scale, ctx.tile)
    return dq, dk, dv, None, None


tiled_attention_op.register_autograd(_grad, setup_context=_setup)


def tiled_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                           tile: int = ATTENTION_TILE_TOKENS) -> torch.Tensor:
    """Causal attention of one segment in tiles (``[B, Hq, L, D]`` -> ``[B, L, Hq, D]``, the layout
    transformers' attention functions return); ``scale`` None: ``D ** -0.5``."""
    s = float(scale) if scale is not None else q.shape[-1] ** -0.5
    return tiled_attention_op(q, k, v, s, int(tile))[0].transpose(1, 2)


def tiled_backward_bytes_per_token(q_width: int, kv_width: int, dtype_bytes: int,
                                   length: int, tile: int = ATTENTION_TILE_TOKENS) -> float:
    """What the tiled backward allocates per token of a segment of ``length`` beside its saved
    inputs (the planner's attention phase). For the whole segment: the output gradient handed in,
    dQ, the fp32 dK/dV accumulators and their results at the key heads' width. For one tile,
    spread over the segment: the key block's K/V expanded to the query heads, the kernel's dQ, dK,
    dV and its fp32 dQ accumulator, the query block's fp32 dQ sum, and the fp32 key-head sums."""
    whole = 2 * q_width * dtype_bytes + 2 * kv_width * (4 + dtype_bytes)
    one_tile = q_width * (5 * dtype_bytes + 4 + 4) + 2 * kv_width * 4
    return whole + one_tile * min(tile, length) / length
