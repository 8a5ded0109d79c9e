"""Sequence-chunked MLPs (models/chunked_mlp.py, issue #32): the same losses and gradients as the
unchunked model (fp32, float rounding) for every family with a block ``mlp``, with LoRA adapters
inside it too; what the graph keeps and the largest intermediate are bounded by the chunk; a run
that fits one chunk computes exactly what it did."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model_zoo import make_batch, make_model
from tinypipe.lora import LoraSettings, apply_lora
from tinypipe.models.blocks import find_blocks
from tinypipe.models.chunked_mlp import ChunkedMLP, chunk_mlps

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(find_blocks(model)[1])


def _loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**{"labels": batch["input_ids"], **batch}).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(a: torch.nn.Module, b: torch.nn.Module, batch: dict) -> None:
    la, ga = _loss_and_grads(a, batch)
    lb, gb = _loss_and_grads(b, batch)
    assert torch.allclose(la, lb, rtol=1e-6, atol=0), (la, lb)
    names = {n.replace(".mlp.mlp.", ".mlp.") for n in gb}
    assert names == set(ga)
    for n, g in gb.items():
        ref = ga[n.replace(".mlp.mlp.", ".mlp.")]
        scale = float(ref.abs().max()) or 1.0
        assert float((g - ref).abs().max()) <= 2e-6 * scale, n


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gpt2"])
def test_chunked_equals_unchunked(family: str) -> None:
    """3 x 16 tokens in chunks of 5 (uneven, the last of 3): loss and every gradient."""
    model = make_model(family, layers=2)
    chunked = copy.deepcopy(model)
    assert chunk_mlps(_blocks(chunked), 5) == 2
    _compare(model, chunked, make_batch(3, 16, seed=0, pad=True))


def test_one_chunk_is_the_unchunked_run_bit_for_bit() -> None:
    model = make_model("llama", layers=2)
    chunked = copy.deepcopy(model)
    chunk_mlps(_blocks(chunked), 3 * 16)
    la, ga = _loss_and_grads(model, make_batch(3, 16, seed=1, pad=True))
    lb, gb = _loss_and_grads(chunked, make_batch(3, 16, seed=1, pad=True))
    assert torch.equal(la, lb)
    assert all(torch.equal(g, ga[n.replace(".mlp.mlp.", ".mlp.")]) for n, g in gb.items())


def test_lora_adapters_inside_the_mlp_get_their_gradients() -> None:
    pm = apply_lora(make_model("llama", layers=2), LoraSettings(rank=4, alpha=8.0))
    with torch.no_grad():  # B away from zero so every adapter has a gradient
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    chunked = copy.deepcopy(pm)
    chunk_mlps(_blocks(chunked.base_model.model), 7)
    _compare(pm, chunked, make_batch(3, 16, seed=2))


def test_blocks_without_an_mlp_module_are_left_alone() -> None:
    assert chunk_mlps(_blocks(make_model("opt", layers=2)), 8) == 0  # OPT's layer calls fc1/fc2 itself


def _saved_bytes(run) -> int:  # noqa: ANN001
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())


class _Largest(TorchDispatchMode):
    """The largest tensor any op produced (bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_memory_is_bounded_by_the_chunk() -> None:
    """Llama MLP, hidden 64, intermediate 512, 1024 tokens in chunks of 128: the graph keeps only
    the input (the unchunked one keeps gate, up, activation ... of every token), and no op makes a
    tensor larger than the output or one chunk's intermediate (the unchunked one: every token's)."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=1, vocab_size=97)
    mlp = transformers.models.llama.modeling_llama.LlamaMLP(cfg)
    chunked = ChunkedMLP(mlp, 128)
    x = torch.randn(2, 512, 64, requires_grad=True)
    inter = 2 * 512 * 512 * 4  # one intermediate of every token, fp32
    whole = _saved_bytes(lambda: mlp(x))
    parts = _saved_bytes(lambda: chunked(x))
    assert whole >= 3 * inter, whole
    assert parts <= x.numel() * 4 + 4096, parts  # the input's storage (+ the checkpoints' scalars)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            with _Largest() as big:
                y = chunked(x)
            with _Largest() as big_whole:
                mlp(x)
        assert big.largest <= max(y.numel() * 4, 128 * 512 * 4), big.largest
        assert big_whole.largest >= inter
    # and the chunked backward: gradients equal the unchunked ones
    g = torch.randn_like(y)
    gx, = torch.autograd.grad(chunked(x), x, g)
    gx_whole, = torch.autograd.grad(mlp(x), x, g)
    assert torch.allclose(gx, gx_whole, rtol=1e-5, atol=1e-6)


def _slice_loop(mlp: torch.nn.Module, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The plain way to chunk under autograd: slices in, slice assignments out."""
    from torch.utils.checkpoint import checkpoint

    flat = x.reshape(-1, x.shape[-1])
    out = None
    for lo in range(0, flat.shape[0], chunk):
        y = checkpoint(mlp, flat[lo : lo + chunk], use_reentrant=False)
        if out is None:
            out = flat.new_empty((flat.shape[0], y.shape[-1]))
        out[lo : lo + y.shape[0]] = y
    return out.reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("chunk", [5, 16, 48])
def test_split_chunks_give_the_slice_loops_gradients_bit_for_bit(chunk: int) -> None:
    """ChunkedMLP joins its chunks with a split and an in-place placement whose backward passes the
    gradient on without copies: the input and parameter gradients (LoRA inside the MLP, gradients
    taken with ``autograd.grad`` as the engine does) equal the slice loop's exactly, the output's
    gradient reaching every chunk (a gradient that differs per token, uneven last chunk)."""
    pm = apply_lora(make_model("llama", layers=1), LoraSettings(rank=4, alpha=8.0))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    mlp = _blocks(pm.base_model.model)[0].mlp
    chunked = ChunkedMLP(mlp, chunk)
    x = torch.randn(3, 16, 32, requires_grad=True)
    g = torch.randn(3, 16, 32)
    params = [p for p in mlp.parameters() if p.requires_grad]
    assert params
    got = torch.autograd.grad(chunked(x), [x, *params], g)
    ref = torch.autograd.grad(_slice_loop(mlp, x, chunk), [x, *params], g)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert float(got[0].abs().min()) > 0  # every token's input got its gradient
    # the output's values, too, and a second use of the output adds to the first's gradient
    y = chunked(x)
    assert torch.equal(y, _slice_loop(mlp, x, chunk))
    two, = torch.autograd.grad((y * g).sum() + y.sum(), x)
    ref_two, = torch.autograd.grad(_slice_loop(mlp, x, chunk), x, g + 1)
    assert torch.allclose(two, ref_two, rtol=1e-6, atol=1e-7)


def test_compiled_chunked_block_equals_eager() -> None:
    """A compiled block with a chunked MLP (the loop a graph break, aot_eager: no C compiler
    needed) gives the eager block's gradients."""
    model = make_model("llama", layers=1)
    chunk_mlps(_blocks(model), 5)
    block = _blocks(model)[0]
    compiled = torch.compile(block, backend="aot_eager", dynamic=False)
    x = torch.randn(3, 16, 32, requires_grad=True)
    pos = torch.arange(16)[None].expand(3, 16)
    cos, sin = model.model.rotary_emb(x, pos)
    outs = []
    for run in (block, compiled):
        y = run(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        outs.append(torch.autograd.grad(y.square().sum(), [x, *block.parameters()]))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_compact_kept_block_with_a_chunked_mlp_equals_the_plain_block() -> None:
    """A kept pack's compact graph (models/compact.py: selective checkpointing around the block)
    over a chunked MLP (checkpoints inside it): the same gradients as the plain block."""
    from tinypipe.models.compact import CompactBlock

    model = make_model("llama", layers=1)
    plain = copy.deepcopy(_blocks(model)[0])
    chunk_mlps(_blocks(model), 5)
    block = _blocks(model)[0]
    x = torch.randn(3, 16, 32, requires_grad=True)
    pos = torch.arange(16)[None].expand(3, 16)
    cos, sin = model.model.rotary_emb(x, pos)
    grads = []
    for run, params in ((plain, list(plain.parameters())), (CompactBlock(block), list(block.parameters()))):
        y = run(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        grads.append(torch.autograd.grad(y.square().sum(), [x, *params]))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_no_compiled_graph_spans_two_chunks() -> None:
    """The shell's compiled blocks over long micro-batches (chunked MLP and folded norms): every
    graph the compiler is given holds at most one chunk's matrix products (three, the MLP's), and
    the result is the eager shell's. Why: traced into one graph, Inductor fused the chunks'
    kernels across chunks and held every chunk's intermediates at once in the backward (+22
    [S, H] tensors against eager's +8.4, issue #32; models/chunked_mlp.py)."""
    from tinypipe.models.decompose import Decomposition
    from tinypipe.models.shell import Shell

    products: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        products.append(sum(n.op == "call_function" and "linear" in str(n.target)
                            for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
                            for n in sub.graph.nodes))  # checkpoints' bodies are subgraphs
        return gm.forward

    model = make_model("llama", layers=1)
    chunk = 5
    x = torch.randn(2, 16, 32)  # 32 tokens: 7 chunks (the last of 2)
    results = []
    for backend in (None, counting_backend):
        shell = Shell(model, Decomposition(model), torch.device("cpu"), mlp_chunk_tokens=chunk)
        for name, p in model.named_parameters():
            shell.bind(name, p.detach().clone().requires_grad_(True))
        if backend is not None:
            shell.compile_blocks(backend)
        inp = x.clone().requires_grad_(True)
        pos = torch.arange(16)[None].expand(2, 16)
        cos, sin = model.model.rotary_emb(inp, pos)
        call = ((), dict(position_embeddings=(cos, sin), attention_mask=None, position_ids=pos))
        y = shell.block_forward(0, inp, call)
        results.append((y.detach(), torch.autograd.grad(y.square().sum(), inp)[0]))
    assert products and max(products) <= 3, products
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
