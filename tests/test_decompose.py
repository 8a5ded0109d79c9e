"""The generic decomposition: embedding -> blocks -> head through a parameter-less Shell equals the
Hugging Face model's own forward, bit for bit, for every family; the layer specs partition the
parameters."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from model_zoo import FAMILIES, make_batch, make_model
from tinypipe.models.decompose import ALIGN, Decomposition, LayerKind, iter_param_names
from tinypipe.models.shell import Shell


def staged_logits(shell: Shell, dec: Decomposition, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        hidden, calls = shell.embed_forward(ids, mask)
        assert len(calls) == dec.num_blocks
        for i in range(dec.num_blocks):
            hidden = shell.block_forward(i, hidden, calls[i])
        return shell.head_logits(hidden)


def padded_batch(seed: int = 3) -> dict[str, torch.Tensor]:
    b = make_batch(4, 11, seed=seed, pad=True)
    b["attention_mask"][0] = 1  # one full row, the others padded at different lengths
    b["attention_mask"][1, 6:] = 0
    assert (b["attention_mask"] == 0).any()
    return b


@pytest.mark.parametrize("family", FAMILIES)
def test_shell_with_real_parameters_reproduces_the_model(family: str) -> None:
    model = make_model(family, layers=3)
    dec = Decomposition(model)
    shell = Shell(model, dec, torch.device("cpu"))
    # the shell owns no weights until bound
    assert all(p.is_meta for p in shell.model.parameters())
    for name, p in model.named_parameters():  # canonical names; aliases follow
        shell.bind(name, p.detach())
    b = padded_batch()
    with torch.no_grad():
        ref = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        ref_nomask = model(input_ids=b["input_ids"]).logits
    assert torch.equal(staged_logits(shell, dec, b["input_ids"], b["attention_mask"]), ref)
    assert torch.equal(staged_logits(shell, dec, b["input_ids"], None), ref_nomask)


@pytest.mark.parametrize("family", FAMILIES)
def test_shell_bound_to_flat_layer_buffers(family: str) -> None:
    """Bind views of per-layer flat buffers laid out by the specs (as the engine's slots are): the
    layout has no overlaps and the result still equals the model exactly."""
    model = make_model(family, layers=3)
    dec = Decomposition(model)
    named = dict(model.named_parameters())
    shell = Shell(model, dec, torch.device("cpu"))
    for layer in dec.layers:
        flat = torch.full((layer.numel,), float("nan"))
        for p in layer.params:
            view = flat[p.offset : p.offset + p.numel].view(p.shape)
            view.copy_(named[p.name].detach())
            shell.bind(p.name, view)
    b = padded_batch(seed=5)
    with torch.no_grad():
        ref = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert torch.equal(staged_logits(shell, dec, b["input_ids"], b["attention_mask"]), ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_specs_partition_the_parameters(family: str) -> None:
    model = make_model(family, layers=3)
    dec = Decomposition(model)
    canonical = dict(model.named_parameters())  # one name per tensor
    names = list(iter_param_names(dec.layers))
    dupes = [n for n, c in Counter(names).items() if c > 1]
    assert not dupes, dupes
    assert set(names) == set(canonical)
    assert [layer.kind for layer in dec.layers] == [LayerKind.EMBED] + [LayerKind.BLOCK] * 3 + [LayerKind.HEAD]
    assert [layer.index for layer in dec.layers] == list(range(dec.num_blocks + 2))
    assert dec.num_blocks == 3
    for layer in dec.layers:
        end = 0
        for p in layer.params:
            assert p.offset % ALIGN == 0 and p.offset >= end, (layer.name, p.name)
            assert p.numel == canonical[p.name].numel() and p.shape == tuple(canonical[p.name].shape)
            end = p.offset + p.numel
        assert end <= layer.numel < end + ALIGN
        assert layer.param_count == sum(canonical[p.name].numel() for p in layer.params)
    # block i holds exactly the parameters of decoder block i, and blocks are alike
    for i, block in enumerate(dec.blocks):
        assert all(f".{i}." in p.name for p in block.params), block.name
        assert [p.shape for p in block.params] == [p.shape for p in dec.blocks[0].params]
    # the input embedding is in the embedding layer; the output embedding is the head's or borrowed
    emb_name = next(n for n, p in canonical.items() if p is model.get_input_embeddings().weight)
    assert emb_name in {p.name for p in dec.embed.params}
    head_names = {p.name for p in dec.head.params} | {n for n, _ in dec.head.borrowed}
    assert dec.head_weight_name in head_names
    # aliases: every name the model uses (tied duplicates included) maps to a canonical name
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert {a for aliases in dec.aliases.values() for a in aliases} == all_names


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [None, True, False], ids=["default", "tied", "untied"])
def test_tied_models_report_tied(family: str, tied: bool | None) -> None:
    model = make_model(family, layers=2, tied=tied)
    is_tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if tied is not None:
        assert is_tied == tied
    dec = Decomposition(model)
    assert dec.tied == is_tied
    if is_tied:
        assert dec.head.borrowed == [(dec.head_weight_name, 0)]
        assert dec.head_weight_name in {p.name for p in dec.embed.params}
    else:
        assert dec.head.borrowed == []
        assert dec.head_weight_name in {p.name for p in dec.head.params}


def test_decomposition_leaves_the_model_intact() -> None:
    """Probing and building a shell must not alter the model (its blocks and outputs)."""
    model = make_model("llama", layers=2)
    b = padded_batch()
    with torch.no_grad():
        before = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    blocks = list(model.model.layers)
    dec = Decomposition(model)
    Shell(model, dec, torch.device("cpu"))
    assert list(model.model.layers) == blocks
    with torch.no_grad():
        after = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_shell_keeps_no_reference_to_the_embedding_output(family: str) -> None:
    """Once the embedding's output is handed over, the shell holds none of it: the engine frees
    or moves it as the plan says. The trunk's recorder kept the whole batch's output until the
    next step (1 GiB on the GPU at 2 x 64K tokens of the 8B shape, measured at peak on an H100)."""
    import gc
    import weakref

    model = make_model(family, layers=2)
    dec = Decomposition(model)
    shell = Shell(model, dec, torch.device("cpu"))
    for name, p in model.named_parameters():
        shell.bind(name, p.detach())
    with torch.no_grad():
        hidden, calls = shell.embed_forward(make_batch(2, 9)["input_ids"], None)
    gone = weakref.ref(hidden)
    del hidden
    gc.collect()
    assert gone() is None and len(calls) == dec.num_blocks
