"""Causal attention over one long segment in tiles of queries x keys, through the fused kernel's own
forward and backward.

Why: the fused backward SDPA runs over a whole segment (cuDNN's on Hopper) allocated, beside the
block's saved tensors, about seven rows of the query width per token (an H100 at e8bdd13): at 256K
tokens of the 8B shape 14 GiB, more than half a 24 GiB GPU.

Here a segment of ``L`` tokens is cut into blocks of ``T``; tile ``(i, j)``, ``j <= i``, is query
block ``i`` against key block ``j`` -- the diagonal tiles causal (square, so the kernel's causal
alignment is the right one), the others unmasked. The forward merges a query block's tiles by
their log-sum-exp (the softmax over the whole prefix, exact up to rounding); the backward runs the
kernel's backward on every tile with the *merged* output and log-sum-exp, which makes each tile's
gradients those of the whole softmax restricted to its keys, and sums dQ over ``j`` in fp32 at one
block's size and dK/dV over ``i`` in fp32 at the key heads' width. What a backward holds beyond its
inputs is then dQ, the fp32 dK/dV of the key heads and their results, and one tile's temporaries
(:func:`tiled_backward_bytes_per_token`). Where the kernel wants as many key heads as query heads,
keys and values are expanded one key block at a time, never the whole segment.

The kernels (:data:`KERNELS`): cuDNN attention on CUDA (grouped heads native; what SDPA picks on
Hopper, ~1.8x flash's rate there), flash attention on CUDA, the CPU flash kernel on the CPU (what
the tests run). A shell picks one where it runs (:func:`tile_kernel_for`: SDPA's own preference,
checked against softmax attention written out); with none, with dropout, or where a segment fits
one tile, the caller keeps the whole-segment SDPA call.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import repeat_kv

#: Tokens per query / key block. A tile's temporaries are ~18 bytes per query-width element of one
#: block (8K tokens of the 8B shape: ~0.6 GiB); at 8K x 8K a tile keeps the kernel near its rate
#: (flash on an H100: ~20 % under the whole-segment call at 64K tokens, 16K tiles ~2 %).
ATTENTION_TILE_TOKENS = 8192
#: The tiles the planner weighs when ``Config.attention_tile_tokens`` is unset (planner/search.py):
#: larger tiles merge less and run the kernel nearer its whole-segment rate (cuDNN on an H100 at
#: 64K, forward + backward per layer: 252 ms in 8K tiles, 233 in 16K, 226 in 32K, 228 whole), and
#: hold more per tile in the backward (:func:`tiled_backward_bytes_per_token`).
ATTENTION_TILE_OPTIONS = (ATTENTION_TILE_TOKENS, 2 * ATTENTION_TILE_TOKENS, 4 * ATTENTION_TILE_TOKENS)
_HALF = (torch.float16, torch.bfloat16)


#: Tile kernels by name: each runs one tile's forward and backward (:func:`_tile_forward`).
KERNELS = ("cpu", "flash", "cudnn")


def tiles_apply(query: torch.Tensor, key: torch.Tensor, dropout: float, tile: int) -> bool:
    """Whether a segment (``query`` ``[B, Hq, L, D]``) runs in tiles: longer than one tile (0: tiles
    off, or no kernel here), no attention dropout, query heads a multiple of the key heads."""
    return 0 < tile < query.shape[2] and dropout == 0.0 and query.shape[1] % key.shape[1] == 0


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and log-sum-exps are kept in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _reduce(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient at the query heads summed back to the key heads, in the accumulation dtype
    (summed there without an upcast copy of ``dx``)."""
    b, h, n, d = dx.shape
    acc = _accumulation(dx.dtype)
    if groups == 1:
        return dx.to(acc)
    return dx.view(b, h // groups, groups, n, d).sum(2, dtype=acc)


def _tile_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's output (``q``'s dtype) and log-sum-exp (``[B, H, Lq]``, accumulation dtype);
    ``k``/``v`` at the key heads."""
    groups = q.shape[1] // k.shape[1]
    if kernel == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        lse = lse.squeeze(-1)  # [B, H, Lq, 1]
    elif kernel == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, repeat_kv(k, groups), repeat_kv(v, groups), 0.0, causal, False, scale=scale)[:2]
    elif kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, repeat_kv(k, groups), repeat_kv(v, groups), 0.0, causal, scale=scale)
    else:
        raise ValueError(f"unknown attention tile kernel {kernel!r}; one of {KERNELS}")
    return out, lse.to(_accumulation(q.dtype))


def _tile_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, kernel: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's backward for one tile, given the merged output and log-sum-exp of its queries:
    dQ (``q``'s dtype) and dK/dV at the key heads in the accumulation dtype. No dropout: the
    random-state arguments are not read."""
    groups = q.shape[1] // k.shape[1]
    if kernel == "cudnn":
        unused = torch.zeros((), dtype=torch.long, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), unused, unused, None, None, None, q.shape[2],
            k.shape[2], 0.0, causal, scale=scale)
        acc = _accumulation(dk.dtype)
        return dq, dk.to(acc), dv.to(acc)
    kw, vw = repeat_kv(k, groups), repeat_kv(v, groups)
    if kernel == "flash":
        unused = torch.empty((), dtype=torch.long)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, kw, vw, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, unused, unused,
            scale=scale)[:3]
    elif kernel == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, kw, vw, out, lse, 0.0, causal, scale=scale)
    else:
        raise ValueError(f"unknown attention tile kernel {kernel!r}; one of {KERNELS}")
    return dq, _reduce(dk, groups), _reduce(dv, groups)


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, ...]:
    """Causal attention and its gradients written out in fp32, without autograd (the check below
    runs inside whatever autograd or checkpoint context builds the shell)."""
    groups = q.shape[1] // k.shape[1]
    q, k, v, dout = (x.float() for x in (q, k, v, dout))
    kw, vw = repeat_kv(k, groups), repeat_kv(v, groups)
    n = q.shape[2]
    s = (q @ kw.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = s.softmax(-1)
    out = p @ vw
    dp = dout @ vw.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    dq = (ds @ kw) * scale
    dk = _reduce((ds.transpose(-1, -2) @ q) * scale, groups)
    dv = _reduce(p.transpose(-1, -2) @ dout, groups)
    return out, dq, dk, dv


def tiles_agree(device: torch.device, dtype: torch.dtype, kernel: str) -> bool:
    """Whether ``kernel``'s tiles (128 tokens) over a 256-token segment with grouped heads give
    softmax attention's output and gradients within 2 % of their largest value: the private kernel
    entry points are checked where they run, once per shell, instead of trusted."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v, dout = (torch.randn(1, 256, heads, 64, generator=g).to(device, dtype).transpose(1, 2)
                         for heads in (4, 2, 2, 4))
        scale = 64 ** -0.5
        with torch.no_grad():
            out, lse = _forward(q, k, v, scale, 128, kernel)
            grads = _backward(dout, q, k, v, out, lse, scale, 128, kernel)
            want = _softmax_attention(q, k, v, dout, scale)
        for x, y in zip((out, *grads), want):
            if not (x.float() - y).abs().max() <= 2e-2 * y.abs().max():
                return False
        return True
    except (RuntimeError, NotImplementedError):
        return False


def sdpa_choice(query: torch.Tensor, key: torch.Tensor) -> int:
    """The backend SDPA would run a causal grouped-head call on (``SDPBackend`` as an int)."""
    return int(torch._fused_sdp_choice(query, key, key, None, 0.0, True, scale=None, enable_gqa=True))


def _kernel_order(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """CUDA tile kernels in the order SDPA would prefer them for a tile-shaped causal call."""
    flash_first = ("flash", "cudnn")
    try:
        choice = sdpa_choice(torch.empty(1, 32, 8192, 128, device=device, dtype=dtype),
                             torch.empty(1, 8, 8192, 128, device=device, dtype=dtype))
    except (RuntimeError, TypeError, AttributeError):  # a private entry point: never fatal
        return flash_first
    return ("cudnn", "flash") if choice == int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION) else flash_first


def tile_kernel_for(device: torch.device, dtype: torch.dtype) -> str:
    """The tile kernel for a shell on ``device`` computing in ``dtype`` ("" where none agrees with
    softmax attention: the shell then attends whole). The CPU kernel is the one the tests check."""
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda" or dtype not in _HALF:
        return ""
    enabled = {"flash": torch.backends.cuda.flash_sdp_enabled(),
               "cudnn": torch.backends.cuda.cudnn_sdp_enabled()}
    for kernel in _kernel_order(device, dtype):
        if enabled[kernel] and tiles_agree(device, dtype, kernel):
            return kernel
    return ""


def _blocks(length: int, tile: int) -> list[tuple[int, int]]:
    return [(a, min(length, a + tile)) for a in range(0, length, tile)]


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, tile: int,
             kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged output (``q``'s layout and dtype) and log-sum-exp of every query block."""
    blocks = _blocks(q.shape[2], tile)
    acc_dtype = _accumulation(q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=acc_dtype, device=q.device)
    for i, (a, b) in enumerate(blocks):
        qi = q[:, :, a:b]
        acc, acc_lse = None, None
        for j in range(i + 1):
            c, d = blocks[j]
            o, l = _tile_forward(qi, k[:, :, c:d], v[:, :, c:d], i == j, scale, kernel)
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
              out: torch.Tensor, lse: torch.Tensor, scale: float, tile: int,
              kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
            dq_t, dk_t, dv_t = _tile_backward(di, qi, k[:, :, c:d], v[:, :, c:d], oi, li, i == j, scale,
                                              kernel)
            dqi = dq_t.to(acc_dtype, copy=True) if dqi is None else dqi.add_(dq_t)
            dk[:, :, c:d] += dk_t
            dv[:, :, c:d] += dv_t
            del dq_t, dk_t, dv_t
        dq[:, :, a:b] = dqi
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# One opaque operator each way (torch.library): selective checkpointing (a kept pack's compact
# graph, models/compact.py) then sees and saves one attention output and log-sum-exp, as for the
# fused kernel, instead of every tile's -- and the in-place merges stay out of its sight.
@torch.library.custom_op("tinypipe::tiled_causal_attention", mutates_args=())
def tiled_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       tile: int, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, scale, tile, kernel)


@tiled_attention_op.register_fake
def _(q, k, v, scale, tile, kernel):  # type: ignore[no-untyped-def]
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=_accumulation(q.dtype))


@torch.library.custom_op("tinypipe::tiled_causal_attention_backward", mutates_args=())
def tiled_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, scale: float, tile: int,
                                kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, lse, scale, tile, kernel)


@tiled_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, scale, tile, kernel):  # type: ignore[no-untyped-def]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, scale, tile, kernel = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.tile, ctx.kernel = scale, tile, kernel


def _grad(ctx, dout, dlse):  # type: ignore[no-untyped-def]
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = tiled_attention_backward_op(dout, q, k, v, out, lse, ctx.scale, ctx.tile, ctx.kernel)
    return dq, dk, dv, None, None, None


tiled_attention_op.register_autograd(_grad, setup_context=_setup)


def tiled_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                           tile: int = ATTENTION_TILE_TOKENS, kernel: str | None = None) -> torch.Tensor:
    """Causal attention of one segment in tiles (``[B, Hq, L, D]`` -> ``[B, L, Hq, D]``, the layout
    transformers' attention functions return); ``scale`` None: ``D ** -0.5``; ``kernel`` None: the
    CPU kernel on the CPU, flash attention elsewhere."""
    s = float(scale) if scale is not None else q.shape[-1] ** -0.5
    name = kernel or ("cpu" if q.device.type == "cpu" else "flash")
    return tiled_attention_op(q, k, v, s, int(tile), name)[0].transpose(1, 2)


def tiled_backward_bytes_per_token(q_width: int, kv_width: int, dtype_bytes: int,
                                   length: int, tile: int = ATTENTION_TILE_TOKENS) -> float:
    """What the tiled backward allocates per token of a segment of ``length`` beside its saved
    inputs (the planner's attention phase). For the whole segment: the output gradient handed in,
    dQ, the fp32 dK/dV accumulators and their results at the key heads' width. For one tile,
    spread over the segment: the key block's K/V expanded to the query heads, the kernel's dQ, dK,
    dV and its fp32 dQ accumulator, the query block's fp32 dQ sum, and the fp32 key-head sums.
    Checked on an H100 with flash tiles, one 128K-token row (tests/test_tiled_attention.py)."""
    whole = 2 * q_width * dtype_bytes + 2 * kv_width * (4 + dtype_bytes)
    one_tile = q_width * (5 * dtype_bytes + 4 + 4) + 2 * kv_width * 4
    return whole + one_tile * min(tile, length) / length
