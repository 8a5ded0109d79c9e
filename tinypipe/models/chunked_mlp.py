"""Sequence-chunked MLPs: a decoder block's feed-forward network over its tokens a chunk at a time.

Why: at long sequences a block's working set, not its weights, overflows the GPU. For the
Llama-3.1-8B shape one 64K-token sequence gives the MLP gate, up and activation outputs of 1.75 GiB
each (bf16), held together in a forward and again, with their gradients, in the backward. Every op
of the MLP acts on one token (row) alone, so it can run on a chunk of rows at a time:

* without autograd (the engine's forward of a recomputed pack), chunk after chunk into one
  preallocated output: the largest intermediate is a chunk's;
* with autograd (the backward's recompute, a kept pack), each chunk under a non-reentrant
  checkpoint: the graph keeps only the chunk's input -- a view of the MLP's input, which the block
  holds anyway -- and the backward recomputes one chunk's intermediates at a time. Parameter
  gradients accumulate over the chunks through autograd itself (no custom Function), so LoRA
  adapters and the engine's explicit ``autograd.grad(output, params)`` see them as before.

Compiled blocks (:mod:`tinypipe.models.compiled`) leave the chunk loop out of their graph: the loop
runs eagerly with the same checkpoints, each chunk through the MLP compiled on its own
(:meth:`ChunkedMLP.compile_chunks`). Traced into the block's graph, Inductor fuses the chunks'
elementwise kernels across chunks (horizontally: they share the norm's weight) and defers the
weight-gradient products to the graph's end, so every chunk's recomputed intermediates are alive
at once -- about twice an eager block's backward (docs/long_context.md has the measurements).

The result equals the unchunked MLP's to float rounding (a matrix product over fewer rows may be
blocked differently); a micro-batch of at most ``chunk_tokens`` tokens runs the MLP unchunked, so
short runs compute exactly what they did. Dropout inside an MLP (GPT-2's) draws its masks per
chunk -- valid dropout, replayed exactly by the recompute (the checkpoint restores the generator),
but not the unchunked run's masks.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


#: Bytes one MLP intermediate of one chunk (gate, up or activation: chunk tokens x intermediate
#: size, compute dtype) may take when the chunk is chosen automatically: ~256 MiB keeps the three
#: of a forward and their gradients in the backward near 1.5 GiB on any model.
AUTO_CHUNK_BYTES = 256 * 1024**2
#: Sequences of at most this many tokens run their MLPs unchunked when the chunk is chosen
#: automatically: below it a micro-batch's intermediates are what plans were always sized for, and
#: chunking would only add the recompute of each chunk in the backward (one more MLP forward).
LONG_SEQUENCE_TOKENS = 16384


def mlp_chunk_tokens_for(setting: int | None, intermediate: int, elem_bytes: int,
                         seq_len: int | None) -> int:
    """Tokens per MLP chunk for ``Config.mlp_chunk_tokens`` (0: unchunked).

    ``setting`` given (0 = off): that. None (automatic): 0 for sequences of at most
    :data:`LONG_SEQUENCE_TOKENS` tokens or an unknown length, so short runs compute exactly what
    they did; longer ones get the largest power of two of tokens (at least 1024) whose one
    intermediate (``intermediate`` wide, ``elem_bytes`` per element) fits
    :data:`AUTO_CHUNK_BYTES` -- 8192 tokens for the Llama-3.1-8B shape in bf16 (224 MiB)."""
    if setting is not None:
        return int(setting)
    if seq_len is None or seq_len <= LONG_SEQUENCE_TOKENS:
        return 0
    tokens = max(1024, AUTO_CHUNK_BYTES // max(1, intermediate * elem_bytes))
    return 1 << (int(tokens).bit_length() - 1)


class ChunkedMLP(nn.Module):
    """Runs ``mlp`` over at most ``chunk_tokens`` tokens at a time (see the module doc)."""

    def __init__(self, mlp: nn.Module, chunk_tokens: int) -> None:
        super().__init__()
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.mlp = mlp
        self.chunk_tokens = int(chunk_tokens)
        #: ``mlp`` compiled for one chunk (:meth:`compile_chunks`; None: chunks run it eager)
        self.compiled_chunk: Callable[..., Any] | None = None

    def compile_chunks(self, backend: str, replay_random: bool = False) -> None:
        """Run each chunk through ``mlp`` compiled with ``backend`` (a graph per chunk shape and
        grad mode, shared by every layer), the loop itself eager (see the module doc)."""
        from tinypipe.models.compiled import CompiledBlock

        self.compiled_chunk = CompiledBlock(self.mlp, backend, replay_random)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden[..., 0].numel()
        if tokens <= self.chunk_tokens:
            return self.mlp(hidden)
        if torch.compiler.is_compiling():
            return self._chunks_outside_the_graph(hidden)
        return self._chunks(hidden)

    @torch.compiler.disable
    def _chunks_outside_the_graph(self, hidden: torch.Tensor) -> torch.Tensor:
        """The chunk loop as a graph break in a compiled block (see the module doc)."""
        return self._chunks(hidden)

    def _chunks(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden[..., 0].numel()
        flat = hidden.reshape(tokens, hidden.shape[-1])
        grad = torch.is_grad_enabled()
        run = self.compiled_chunk or self.mlp
        out: torch.Tensor | None = None
        lo = 0
        # split, not slices: autograd joins the chunks' input gradients with one concatenation,
        # where a slice's backward writes its chunk into a zeroed copy of the whole input and adds
        # that up -- two passes over the whole input per chunk
        for part in flat.split(self.chunk_tokens):
            y = checkpoint(run, part, use_reentrant=False) if grad else run(part)
            if out is None:
                out = hidden.new_empty((tokens, y.shape[-1]), dtype=y.dtype)
            if grad:
                out = _Place.apply(out, y, lo)
            else:
                out[lo : lo + part.shape[0]] = y
            lo += part.shape[0]
        assert out is not None
        return out.reshape(*hidden.shape[:-1], out.shape[-1])


class _Place(torch.autograd.Function):
    """Writes one chunk's output into the whole output, in place. The backward hands the chunk its
    slice of the output's gradient (a view) and passes the gradient on unchanged: the chunks' slices
    are disjoint and the buffer's first values are never read, so nothing needs zeroing. Why not
    ``out[lo:hi] = y``: autograd's in-place slice copy clones the whole gradient once per chunk."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, y: torch.Tensor, lo: int) -> torch.Tensor:
        ctx.bounds = (lo, lo + y.shape[0])
        out[lo : lo + y.shape[0]].copy_(y)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        lo, hi = ctx.bounds
        return grad, grad[lo:hi], None


def chunk_mlps(blocks: Iterable[nn.Module], chunk_tokens: int) -> int:
    """Wrap the ``mlp`` of every block that has one in a :class:`ChunkedMLP` (again: re-chunk);
    returns how many blocks were wrapped. A block without an ``mlp`` submodule (OPT's decoder layer
    calls its ``fc1``/``fc2`` directly) is left as it is."""
    count = 0
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        if not isinstance(mlp, nn.Module):
            continue
        inner = mlp.mlp if isinstance(mlp, ChunkedMLP) else mlp
        block.mlp = ChunkedMLP(inner, chunk_tokens)
        count += 1
    return count


def _tokens(x: torch.Tensor, lead: int) -> int:
    """Tokens in ``x``: the product of its first ``lead`` dimensions' sizes (batch, sequence)."""
    n = 1
    for d in x.shape[:lead]:
        n *= int(d)
    return n


class _ShortOnly(nn.Module):
    """``norm`` for a micro-batch of at most ``chunk_tokens`` tokens, else the identity: the
    readers of its output apply it inside their chunks (:func:`fold_norms`)."""

    def __init__(self, norm: nn.Module, chunk_tokens: int, lead: int = 2) -> None:
        super().__init__()
        self.norm, self.chunk_tokens, self.lead = norm, int(chunk_tokens), int(lead)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) if _tokens(x, self.lead) <= self.chunk_tokens else x


class _HeadNorm(nn.Module):
    """A per-head norm (Qwen3's ``q_norm``/``k_norm``) applied to a flat projection's output."""

    def __init__(self, norm: nn.Module, head_dim: int) -> None:
        super().__init__()
        self.norm = norm
        self.head_dim = int(head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.unflatten(-1, (-1, self.head_dim))).flatten(-2)


class _FoldedProjection(nn.Module):
    """q/k/v's projection reading the residual stream: for a long micro-batch the block's first
    norm, the projection (and a per-head norm) in checkpointed token chunks; for a short one the
    projection alone on the normed input, as unfolded (bit for bit)."""

    def __init__(self, norm: nn.Module, proj: nn.Module, head_norm: nn.Module | None,
                 head_dim: int, chunk_tokens: int) -> None:
        super().__init__()
        self.proj = proj
        parts = [norm, proj] + ([_HeadNorm(head_norm, head_dim)] if head_norm is not None else [])
        self.chunked = ChunkedMLP(nn.Sequential(*parts), chunk_tokens)
        self.chunk_tokens = int(chunk_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _tokens(x, 2) <= self.chunk_tokens:
            return self.proj(x)
        return self.chunked(x)


#: Decoder layers computing ``x + attn(norm1(x))`` then ``h + mlp(norm2(h))`` with norm1 feeding
#: only ``self_attn``'s q/k/v projections (and Qwen3's per-head q/k norms right after them), as
#: transformers 5 writes them for these families.
FOLDABLE = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def fold_norms(block: nn.Module, chunk_tokens: int) -> bool:
    """Move a block's RMSNorms into token chunks for long micro-batches (returns whether it did).

    Why: with the MLP chunked, a recomputed block still saves each norm's fp32 input, its
    normalised copy and its output -- about 8 x hidden bytes per token each, most of what the
    attention half keeps. A norm acts on one token alone, so it can run inside the chunks of
    what reads it: ``input_layernorm`` inside each of q/k/v's projections (per-head q/k norms
    after them), ``post_attention_layernorm`` inside the chunked MLP. Under autograd each chunk is
    a checkpoint that keeps only its input (the residual stream, which the block holds anyway), so
    the backward recomputes a chunk's norm and projection at a time: one more norm and q/k/v
    forward per block. A micro-batch of at most ``chunk_tokens`` tokens runs the unfolded
    computation, op for op. Same modules, same parameters: long micro-batches equal the unfolded
    block's to float rounding (products over fewer rows; the first norm's gradient summed from
    three chunked backwards)."""
    attn = getattr(block, "self_attn", None)
    norm1 = getattr(block, "input_layernorm", None)
    norm2 = getattr(block, "post_attention_layernorm", None)
    mlp = getattr(block, "mlp", None)
    projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if not all(isinstance(m, nn.Module) for m in (attn, norm1, norm2, mlp, *projs)):
        return False
    if isinstance(norm1, _ShortOnly):  # folded already
        return False
    head_dim = int(getattr(attn, "head_dim", 0))
    for name, proj, head in (("q_proj", projs[0], "q_norm"), ("k_proj", projs[1], "k_norm"),
                             ("v_proj", projs[2], None)):
        head_norm = getattr(attn, head, None) if head else None
        if not (isinstance(head_norm, nn.Module) and head_dim):
            head_norm = None
        else:  # [B, S, heads, head_dim]: tokens are its first two dimensions as well
            setattr(attn, head, _ShortOnly(head_norm, chunk_tokens))
        setattr(attn, name, _FoldedProjection(norm1, proj, head_norm, head_dim, chunk_tokens))
    block.input_layernorm = _ShortOnly(norm1, chunk_tokens)
    inner = mlp.mlp if isinstance(mlp, ChunkedMLP) else mlp
    block.mlp = ChunkedMLP(nn.Sequential(norm2, inner), chunk_tokens)
    block.post_attention_layernorm = nn.Identity()
    return True
