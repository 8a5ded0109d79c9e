"""Packed rows never let documents attend to each other, and padding (``--packing off``) instead.

Data: whole examples share rows (an example is split only when longer than a row, and counted),
position ids restart per document, a document's first token is no target of the previous one.
Engine: position ids go through ``Engine.step`` to the model's own trunk, which builds
block-diagonal masks from them (transformers' ``find_packed_sequence_indices``); the loss of a
packed row equals the documents' losses computed one by one, and training on packed rows equals
plain PyTorch given the same position ids -- eager and compiled (aot_eager) blocks, 1 and 2
devices. A model whose trunk builds no such masks (OPT) refuses packed rows.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tinypipe
from model_zoo import VOCAB, make_model
from reference import compare, randomize_biases, train_both
from tinypipe.errors import BatchError
from tinypipe.train.data import DataStats, PackedDataset, pack
from tinypipe.train.tokenizing import IGNORE_INDEX

LR, EPS, WD = 1e-3, 1e-6, 0.1
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")  # OPT: see test_opt_refuses_packed_rows


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _segments(positions: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each document of a row: a new one wherever the position restarts at 0."""
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    return list(zip(starts[:-1], starts[1:]))


def check_rows(ds: PackedDataset, stats: DataStats, pairs: list[tuple[list[int], list[int]]], seq_len: int,
               packing: bool, pad_id: int) -> None:
    """Every invariant of :func:`tinypipe.train.data.pack` (also used by tests/test_data.py's fuzzing)."""
    pieces = [(ids[lo : lo + seq_len], labels[lo : lo + seq_len]) for ids, labels in pairs
              for lo in range(0, len(ids), seq_len)]
    tokens = sum(len(ids) for ids, _ in pairs)
    assert (stats.tokens, stats.rows, stats.dropped_tokens) == (tokens, len(ds), 0)
    assert stats.padding_tokens == len(ds) * seq_len - tokens
    assert stats.split_examples == sum(len(ids) > seq_len for ids, _ in pairs)
    assert stats.packing == packing and ds.seq_len == seq_len
    if not packing:  # one piece per row, in order, padded and masked
        assert ds.position_ids is None and len(ds) == len(pieces)
        for r, (ids, labels) in enumerate(pieces):
            n = len(ids)
            assert ds.input_ids[r, :n].tolist() == ids and ds.labels[r, :n].tolist() == labels
            assert ds.attention_mask[r].tolist() == [1] * n + [0] * (seq_len - n)
            assert (ds.input_ids[r, n:] == pad_id).all() and (ds.labels[r, n:] == IGNORE_INDEX).all()
        return
    assert ds.attention_mask is None
    got: Counter = Counter()
    for r in range(len(ds)):
        positions, ids, labels = (t[r].tolist() for t in (ds.position_ids, ds.input_ids, ds.labels))
        segs = _segments(positions)
        for k, (a, b) in enumerate(segs):
            assert positions[a:b] == list(range(b - a))
            if k == len(segs) - 1 and all(t == pad_id for t in ids[a:b]) and \
                    all(t == IGNORE_INDEX for t in labels[a:b]):
                continue  # the row's padding
            if a > 0:  # no target across documents
                assert labels[a] == IGNORE_INDEX
            got[(tuple(ids[a:b]), tuple(labels[a + 1 : b]))] += 1
    # every piece is one document of one row: an example that fits a row is never split
    assert got == Counter((tuple(ids), tuple(labels[1:])) for ids, labels in pieces)


def random_docs(n: int, seed: int, longest: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        k = int(torch.randint(2, longest + 1, (), generator=g))
        ids = torch.randint(2, VOCAB, (k,), generator=g).tolist()
        docs.append((ids, list(ids)))
    return docs


@pytest.mark.parametrize("packing", [True, False])
def test_pack_invariants(packing: bool) -> None:
    pairs = random_docs(40, seed=0, longest=24) + [(list(range(2, 40)), list(range(2, 40)))]  # one split
    # prompt/completion-like examples: the prompt half unlabelled; none may be cut or attend across
    pairs = [(ids, [IGNORE_INDEX] * (len(ids) // 2) + labels[len(ids) // 2 :]) if i % 3 == 0
             else (ids, labels) for i, (ids, labels) in enumerate(pairs)]
    ds, stats = pack(pairs, 16, packing=packing, pad_id=1)
    check_rows(ds, stats, pairs, 16, packing, 1)
    assert stats.split_examples >= 1
    if packing:  # best-fit decreasing: within 11/9 of the fewest rows possible, plus one
        assert stats.rows <= -(-stats.tokens // 16) * 11 / 9 + 1, stats
    assert "split across rows" in stats.describe()


def _per_document_loss(model: torch.nn.Module, docs: list[tuple[list[int], list[int]]]) -> float:
    """The documents' token cross-entropy, each run through the model on its own."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for ids, _ in docs:
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            total += F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").double()
            count += len(ids) - 1
    return float(total / count)


@pytest.mark.parametrize("family", FAMILIES + ("llama-eager", "gpt2-eager"))
def test_packed_row_loss_equals_the_documents_losses(family: str) -> None:
    """sdpa gets boolean block-diagonal masks, eager attention additive ones."""
    docs = random_docs(14, seed=1, longest=12)
    ds, stats = pack(docs, 16)
    assert stats.rows >= 3 and (ds.position_ids == 0).sum() > stats.rows  # rows do hold several documents
    batch = ds.row_batch(slice(None))
    model = make_model(family.split("-")[0])
    if family.endswith("-eager"):
        model.config._attn_implementation = "eager"
    with torch.no_grad():  # sharper attention than a 0.02-std init: other documents would show
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(5.0)
    expected = _per_document_loss(model, docs)
    cfg = tinypipe.Config(devices=["cpu", "cpu"], pack_size=2, micro_batch_size=2,
                          backward_micro_batch_size=3, lr=0.0, head_chunk_tokens=7)
    with tinypipe.Engine(model, cfg) as engine:
        packed = engine.step(batch).loss
        # the same rows as one sequence each (documents attending to each other) do differ
        crossed = engine.step({"input_ids": batch["input_ids"], "labels": batch["labels"]}).loss
    assert abs(packed - expected) <= 1e-5 * expected, (packed, expected)
    assert abs(crossed - expected) > 1e-3 * expected, (crossed, expected)  # 100x the tolerance


def _packed_batches(steps: int = 3) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(steps):
        ds, _ = pack(random_docs(12, seed=10 + i, longest=12), 16)
        out.append(ds.row_batch(slice(0, 5)))
    return out


CONFIGS = {
    "one_device_packs2": dict(devices=["cpu"], pack_size=2, micro_batch_size=2, backward_micro_batch_size=3),
    "two_devices_layerwise_host_stash": dict(devices=["cpu", "cpu"], pack_size=1, micro_batch_size=2,
                                             stash="host", max_grad_norm=0.5),
    "two_devices_compiled": dict(devices=["cpu", "cpu"], pack_size=[1, 3], micro_batch_size=2,
                                 backward_micro_batch_size=3, compile_blocks="aot_eager"),
}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_on_packed_rows_matches_pytorch(family: str, name: str) -> None:
    """The reference is the HF model given the same position ids (transformers builds the same
    block-diagonal masks); the captured masks reach every block, compiled ones too."""
    torch._dynamo.reset()
    model = make_model(family)
    # biases start at zero: a zero-init bias's relative error is that of its update alone, which for
    # qwen2's k_proj.bias sits at the fp32 noise floor (1.3e-5 with HF's decay groups, 1.4e-5 with
    # one group on 2 threads); with values, as elsewhere, the per-tensor error means something
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    engine, ref = train_both(model, model, _packed_batches(), CONFIGS[name], lr=LR, eps=EPS, weight_decay=WD)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()
    torch._dynamo.reset()


def test_the_last_token_of_a_document_predicts_nothing() -> None:
    """Labels that still hold the next document's first token are ignored there by the engine."""
    ds, _ = pack(random_docs(12, seed=3, longest=12), 16)
    batch = ds.row_batch(slice(0, 4))
    raw = batch["input_ids"].clone()  # labels = inputs: every document start is a (cross) target
    with tinypipe.Engine(make_model("llama"), tinypipe.Config(lr=0.0, micro_batch_size=2)) as engine:
        a = engine.step(batch).loss
        b = engine.step(dict(batch, labels=raw)).loss
    assert a == b


def test_opt_refuses_packed_rows() -> None:
    """transformers' OPT trunk builds its causal mask without the position ids: packing would let
    documents attend to each other, so the engine refuses and names the way out."""
    ds, _ = pack(random_docs(12, seed=4, longest=12), 16)
    with tinypipe.Engine(make_model("opt"), tinypipe.Config()) as engine:
        assert not engine.decomposition.document_masks
        with pytest.raises(BatchError, match="--packing off"):
            engine.step(ds.row_batch(slice(0, 2)))
        padded, _ = pack(random_docs(4, seed=4, longest=12), 16, packing=False)
        assert engine.step(padded.row_batch(slice(None))).loss > 0


def test_position_ids_are_validated() -> None:
    ids = torch.randint(2, VOCAB, (2, 8))
    pos = torch.arange(8).repeat(2, 1)
    packed = torch.tensor([list(range(4)) * 2] * 2)
    bad = {
        "shape": ({"input_ids": ids, "position_ids": pos[:, :4]}, "position_ids must be"),
        "float": ({"input_ids": ids, "position_ids": pos.float()}, "position_ids must be"),
        "negative": ({"input_ids": ids, "position_ids": pos - 1}, r"position_ids must lie in"),
        "beyond_max": ({"input_ids": ids, "position_ids": pos + 125}, r"position_ids must lie in"),
        "packed_and_padded": ({"input_ids": ids, "position_ids": packed,
                               "attention_mask": torch.tensor([[1] * 6 + [0] * 2] * 2)}, "padding"),
    }
    with tinypipe.Engine(make_model("llama"), tinypipe.Config()) as engine:
        for name, (batch, needle) in bad.items():
            with pytest.raises(BatchError, match=needle):
                engine.step(batch)
        # an all-ones mask with packed positions is no padding: accepted
        engine.step({"input_ids": ids, "position_ids": packed, "attention_mask": torch.ones_like(ids)})


def test_finetune_reports_packing_and_pads_with_packing_off(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path, tiny_model_dir: Path) -> None:
    from _data_helpers import CORPUS, write_jsonl
    from test_cli import run_cli

    records = [{"text": CORPUS[i % len(CORPUS)]} for i in range(12)] + [{"text": " ".join(CORPUS) * 2}]
    data = write_jsonl(tmp_path / "train.jsonl", records)
    base = ["finetune", "--model", tiny_model_dir, "--data", data, "--seq-len", "32", "--global-batch", "2",
            "--steps", "1", "--no-progress"]
    code, out, err = run_cli(capsys, *base, "--output", tmp_path / "on")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("data:"))
    assert "packed, documents attend only within themselves" in line
    assert "1 example(s) longer than a row split across rows" in line
    code, out, err = run_cli(capsys, *base, "--output", tmp_path / "off", "--packing", "off", "--no-dropout")
    assert code == 0, err
    assert "one example per row" in next(x for x in out.splitlines() if x.startswith("data:"))


from test_cli import tiny_model_dir  # noqa: E402,F401 - the shared fixture
