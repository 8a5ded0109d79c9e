"""Evaluation during training: ``Engine.evaluate`` (forward only, through the engine's own slots and
uploads) equals the model's own Hugging Face loss; it changes no state; the training loop reports
it (metrics.jsonl, the progress line, loss.png, the summary)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from test_cli import tiny_model_dir  # noqa: F401 - the fixture
from tinypipe.lora import LoraSettings, apply_lora

LR = 1e-3

CASES = {
    "1dev_layerwise": dict(devices=["cpu"], pack_size=1, micro_batch_size=2),
    "1dev_packs_mb3_host_stash": dict(devices=["cpu"], pack_size=2, micro_batch_size=3, stash="host",
                                      prefetch_window=2),
    "2dev_uneven_window0": dict(devices=["cpu"] * 2, pack_size=[3, 1], micro_batch_size=1, prefetch_window=0),
    "3dev_clipped": dict(devices=["cpu"] * 3, pack_size=1, micro_batch_size=2, max_grad_norm=1e-3),
    "device_optimizer_resident": dict(devices=["cpu"], pack_size=2, micro_batch_size=2,
                                      device_optimizer="both", resident_packs=1, max_grad_norm=1e-3),
}


def _hf_loss(model: torch.nn.Module, batch: dict) -> float:
    with torch.no_grad():
        return float(model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                           labels=batch["labels"]).loss)


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "qwen3"])
@pytest.mark.parametrize("name", list(CASES))
def test_evaluate_equals_the_models_own_loss(family: str, name: str) -> None:
    model = make_model(family, layers=4)
    with tinypipe.Engine(model, tinypipe.Config(lr=LR, weight_decay=0.1, head_chunk_tokens=7,
                                                **CASES[name])) as engine:
        engine.step(make_batch(5, 12, seed=0))
        batch = make_batch(5, 12, seed=7, pad=True)
        # straight after the step: a clipped step's update may still be running in the background
        r, want = _evaluate_against_hf(engine, model, batch)
        assert r.tokens == int((batch["labels"][:, 1:] != -100).sum())
        assert abs(r.perplexity - torch.exp(torch.tensor(want)).item()) <= 1e-5 * r.perplexity


def _evaluate_against_hf(engine: tinypipe.Engine, model, batch: dict) -> tuple:
    """``engine.evaluate(batch)`` (straight after a step) and the loss HF computes on the model's
    synced weights, checked equal to 1e-6 relative; returns both."""
    r = engine.evaluate(batch)
    engine.synchronize()
    want = _hf_loss(model, batch)
    assert abs(r.loss - want) <= 1e-6 * want, (r.loss, want)
    return r, want


def test_evaluate_under_lora_and_tied_embeddings() -> None:
    for model in (apply_lora(make_model("llama", layers=3), LoraSettings(rank=2, alpha=4.0)),
                  make_model("qwen2", layers=3)):  # qwen2's tiny config ties its embeddings
        with tinypipe.Engine(model, tinypipe.Config(devices=["cpu"], pack_size=1, micro_batch_size=2,
                                                    lr=LR)) as engine:
            engine.step(make_batch(4, 10, seed=0))
            batch = make_batch(4, 10, seed=5, pad=True)
            _evaluate_against_hf(engine, model, batch)


def test_evaluate_changes_nothing_and_the_next_step_is_the_same() -> None:
    """No optimizer work, no gradient work: weights, moments, step counts and gradient buffers are
    untouched, and the training that follows is bit-identical to a run that never evaluated."""
    cfg = dict(devices=["cpu"] * 2, pack_size=2, micro_batch_size=2, lr=LR, max_grad_norm=1e-3)
    a = tinypipe.Engine(make_model("llama", layers=4), tinypipe.Config(**cfg))
    b = tinypipe.Engine(make_model("llama", layers=4), tinypipe.Config(**cfg))
    for e in (a, b):
        e.step(make_batch(4, 8, seed=0))
    weights = {k: v.clone() for k, v in a.state_dict().items()}
    moments = {k: (v["exp_avg"].clone(), v["exp_avg_sq"].clone(), v["step"])
               for k, v in a.optimizer_state().items()}
    # bit patterns: the accumulators' unused tails are uninitialised memory (NaN != NaN)
    grads = [[g.view(torch.int32).clone() for g in d.pool.grad_slots] for d in a.devices]
    a.evaluate(make_batch(6, 8, seed=9))
    assert a.step_count == 1
    assert all(torch.equal(v, weights[k]) for k, v in a.state_dict().items())
    for k, v in a.optimizer_state().items():
        m, s, n = moments[k]
        assert torch.equal(m, v["exp_avg"]) and torch.equal(s, v["exp_avg_sq"]) and n == v["step"]
    for d, before in zip(a.devices, grads):
        assert all(torch.equal(g.view(torch.int32), h) for g, h in zip(d.pool.grad_slots, before))
    for i in (1, 2):
        ra, rb = a.step(make_batch(4, 8, seed=i)), b.step(make_batch(4, 8, seed=i))
        assert ra.loss == rb.loss and ra.grad_norm == rb.grad_norm
    sb = b.state_dict()
    assert all(torch.equal(v, sb[k]) for k, v in a.state_dict().items())
    a.close()
    b.close()


def test_evaluate_rejects_a_malformed_batch() -> None:
    with tinypipe.Engine(make_model("llama", layers=2), tinypipe.Config(devices=["cpu"], pack_size=1,
                                                                        micro_batch_size=2)) as engine:
        with pytest.raises(tinypipe.BatchError):
            engine.evaluate({"input_ids": torch.zeros(2, 1, dtype=torch.long)})


# ---------------------------------------------------------------------------------- in the training loop

def test_split_is_seeded_disjoint_and_complete() -> None:
    from tinypipe.train.data import PackedDataset
    from tinypipe.train.evaluation import split_eval

    ids = torch.arange(50 * 4).view(50, 4)
    ds = PackedDataset(ids, ids.clone())
    train_a, held_a = split_eval(ds, 0.1, seed=3)
    train_b, held_b = split_eval(ds, 0.1, seed=3)
    _, held_c = split_eval(ds, 0.1, seed=4)
    assert len(held_a) == 5 and len(train_a) == 45
    assert torch.equal(held_a.input_ids, held_b.input_ids)
    assert torch.equal(train_a.input_ids, train_b.input_ids)
    assert not torch.equal(held_a.input_ids, held_c.input_ids)
    rows = sorted(int(r[0]) for r in torch.cat([train_a.input_ids, held_a.input_ids]))
    assert rows == [4 * i for i in range(50)]
    assert torch.equal(train_a.input_ids[:, 0], train_a.input_ids[:, 0].sort().values)  # order kept
    with pytest.raises(tinypipe.ConfigError):
        split_eval(ds, 1.0, seed=0)


def test_finetune_reports_the_held_out_loss(capsys, tiny_model_dir,  # type: ignore # noqa: F811
                                            tmp_path) -> None:
    """--eval-split / --eval-every: eval fields in metrics.jsonl at every Nth and the last step, on
    the progress line and in the summary; the final value is the saved model's own HF loss over
    the held-out rows."""
    import transformers

    from _data_helpers import CORPUS, write_jsonl
    from test_cli import run_cli
    from tinypipe.train.data import load_dataset
    from tinypipe.train.evaluation import eval_batches, split_eval
    from tinypipe.train.loop import read_metrics

    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "finetune", "--model", tiny_model_dir, "--data", data,
                                "--output", out, "--seq-len", "16", "--global-batch", "4", "--micro-batch",
                                "2", "--steps", "5", "--lr", "1e-3", "--devices", "cpu", "--eval-split",
                                "0.25", "--eval-every", "2")
    assert code == 0, err
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4, 5]
    assert all("eval_loss" not in r for r in records if r["step"] in (1, 3))
    last = records[-1]
    assert "eval=" in err  # the progress bar (stderr) carries the held-out loss
    assert f"held-out: loss {last['eval_loss']:.4f}" in stdout and "rows held out" in stdout

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    full, _ = load_dataset(data, tok, 16)
    _, held = split_eval(full, 0.25, seed=0)
    assert held.position_ids is not None  # packed rows: the reference runs each document alone
    loss_sum, tokens = 0.0, 0
    for b in eval_batches(held, 4):
        s, n = _documents_loss_sum(model, b)
        loss_sum += s
        tokens += n
    assert last["eval_tokens"] == tokens
    assert abs(last["eval_loss"] - loss_sum / tokens) <= 1e-5 * last["eval_loss"]


def _documents_loss_sum(model: torch.nn.Module, batch: dict) -> tuple[float, int]:
    """(summed token loss, labelled tokens) of ``batch`` with every document of a packed row (a run
    of position ids from 0) through the HF model on its own. (transformers 5.23's own
    ``model(**batch)`` over such rows is not always per-document: on 2 rows with 2-token documents
    it gave 5.9592 where the documents give 5.9623, the engine's value.)"""
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
            starts = [int(i) for i in (pos == 0).nonzero().squeeze(1)] + [len(ids)]
            for lo, hi in zip(starts, starts[1:]):
                targets = labels[lo + 1 : hi]
                keep = targets != -100
                if hi - lo < 2 or not bool(keep.any()):
                    continue
                logits = model(input_ids=ids[lo:hi].unsqueeze(0)).logits[0, :-1].float()
                total += float(F.cross_entropy(logits[keep], targets[keep], reduction="sum"))
                count += int(keep.sum())
    return total, count


def test_eval_flags_are_checked(capsys, tiny_model_dir, tmp_path) -> None:  # type: ignore # noqa: F811
    from _data_helpers import CORPUS, write_jsonl
    from test_cli import assert_one_line_error, run_cli

    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    base = ["finetune", "--model", tiny_model_dir, "--data", data, "--output", tmp_path / "o",
            "--devices", "cpu"]
    for flags, needle in ((["--eval-every", "2"], "eval_every needs held-out data"),
                          (["--eval-split", "1.5"], "eval_split must be in (0, 1)"),
                          (["--eval-split", "0.1", "--eval-data", data], "not both"),
                          (["--eval-data", tmp_path / "missing.jsonl"], "missing.jsonl")):
        code, _, err = run_cli(capsys, *base, *flags)
        assert code == 2, flags
        assert_one_line_error(err, needle)


def test_eval_data_file_and_epochs_count_only_the_training_rows(  # type: ignore
        capsys, tiny_model_dir, tmp_path) -> None:  # noqa: F811
    import re

    from _data_helpers import CORPUS, write_jsonl
    from test_cli import run_cli
    from tinypipe.train.loop import read_metrics

    data = write_jsonl(tmp_path / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    held = write_jsonl(tmp_path / "held.jsonl", [{"text": CORPUS[(i + 3) % len(CORPUS)]} for i in range(6)])
    base = ["finetune", "--model", tiny_model_dir, "--data", data, "--seq-len", "16", "--global-batch", "4",
            "--micro-batch", "2", "--devices", "cpu", "--no-progress"]
    code, stdout, err = run_cli(capsys, *base, "--output", tmp_path / "a", "--eval-data", held,
                                "--steps", "2")
    assert code == 0, err
    assert f"eval: {held}" in stdout
    records = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in records if "eval_loss" in r] == [2]
    code, stdout, err = run_cli(capsys, *base, "--output", tmp_path / "b", "--eval-split", "0.5",
                                "--epochs", "1")
    assert code == 0, err
    held_rows = int(re.search(r"eval: (\d+) rows held out", stdout).group(1))
    total_rows = int(re.search(r"-> (\d+) rows \(", stdout).group(1))
    per_epoch = int(re.search(r"(\d+) steps per epoch", stdout).group(1))
    assert per_epoch == (total_rows - held_rows) // 4
    assert len(read_metrics(tmp_path / "b" / "metrics.jsonl")) == per_epoch


# ---------------------------------------------------------------------------------- with main's runtime:
# the SSD tier, QLoRA, packed rows, dropout

def _offload_plan(cfg: tinypipe.Config, model: torch.nn.Module, kinds: tuple[str, ...]):  # type: ignore
    import dataclasses

    from tinypipe.planner.auto import manual_plan

    blocks = model.config.num_hidden_layers
    plan = manual_plan(cfg, num_blocks=blocks, tied=bool(model.config.tie_word_embeddings))
    return dataclasses.replace(plan, offload=tuple((layer, k) for layer in range(blocks + 2) for k in kinds))


def _lora_llama() -> torch.nn.Module:
    pm = apply_lora(make_model("llama", layers=4), LoraSettings(rank=2, alpha=4.0))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # PEFT starts B at zero: the adapters would change nothing
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return pm


SSD_CASES = {
    "full_all_kinds_2dev_clipped": (lambda: make_model("llama", layers=4), ("master", "moments", "grad"),
                                    dict(devices=["cpu"] * 2, pack_size=2, micro_batch_size=2,
                                         max_grad_norm=1e-3)),
    "lora_frozen_moments": (_lora_llama, ("moments", "frozen"),
                                   dict(devices=["cpu"], pack_size=1, micro_batch_size=2)),
}


@pytest.mark.parametrize("name", list(SSD_CASES))
def test_evaluate_reads_offloaded_masters_through_the_ssd_tier(tmp_path, name: str) -> None:  # type: ignore
    """Masters (or a LoRA base) on the SSD: evaluate reads them through the tier's upload pool and
    gives the DRAM engine's loss bit for bit (which is the HF loss); the pool comes back whole, so
    the steps after are the DRAM engine's too."""
    make, kinds, cfg = SSD_CASES[name]
    dram_cfg = tinypipe.Config(lr=LR, weight_decay=0.1, head_chunk_tokens=7, **cfg)
    ssd_cfg = dram_cfg.replace(offload_dir=str(tmp_path))
    dram_model, ssd_model = make(), make()
    a = tinypipe.Engine(dram_model, dram_cfg, plan=_offload_plan(dram_cfg, make_model("llama", layers=4), ()))
    b = tinypipe.Engine(ssd_model, ssd_cfg, plan=_offload_plan(ssd_cfg, make_model("llama", layers=4), kinds))
    try:
        for e in (a, b):
            e.step(make_batch(4, 12, seed=0))
        batch = make_batch(5, 12, seed=7, pad=True)
        totals = b.optimizer.tier.off.ssd.stats.totals
        before = totals()
        # straight after the step: a clipped step's update (and its SSD write-back) may still run
        ra, rb = a.evaluate(batch), b.evaluate(batch)
        read = (totals() - before).read_bytes
        # every offloaded master / frozen base came from the SSD
        off = b.store.offload
        want_read = sum(off.nbytes((layer, n)) for layer in range(len(b.store.layers))
                        for n in ("master", "frozen") if off.has(layer, n))
        assert want_read > 0 and read >= want_read, (read, want_read)
        assert rb.loss == ra.loss and rb.tokens == ra.tokens
        a.synchronize()
        want = _hf_loss(dram_model, batch)
        assert abs(ra.loss - want) <= 1e-6 * want, (ra.loss, want)
        for i in (1, 2):
            sa, sb = a.step(make_batch(4, 12, seed=i)), b.step(make_batch(4, 12, seed=i))
            assert (sa.loss, sa.grad_norm) == (sb.loss, sb.grad_norm)
        sa_, sb_ = a.state_dict(), b.state_dict()
        assert all(torch.equal(sb_[k], v) for k, v in sa_.items())
    finally:
        a.close()
        b.close()
    assert not list(tmp_path.iterdir()), "scratch left behind after close"


@pytest.mark.parametrize("offload", [(), ("frozen",)], ids=["dram", "frozen_on_ssd"])
def test_evaluate_over_a_quantized_base(tmp_path, offload: tuple[str, ...]) -> None:  # type: ignore
    """QLoRA (NF4 with double quantization, fp32 compute): evaluate uploads the quantized bytes into
    the slots and the shells rebuild bitsandbytes' weights from them, as a training step does --
    the loss is PEFT + bitsandbytes' own (in eval mode), and the same from the SSD."""
    pytest.importorskip("bitsandbytes")
    from test_qlora import NF4, qlora_model

    cfg = tinypipe.Config(devices=["cpu"] * 2, pack_size=2, micro_batch_size=2, lr=LR, head_chunk_tokens=7,
                          offload_dir=str(tmp_path) if offload else None)
    pm = qlora_model("llama", NF4)
    ref = copy.deepcopy(pm).eval()  # the same quantized bytes; the engine's host model may lose them
    batch = make_batch(5, 12, seed=7, pad=True)
    with tinypipe.Engine(pm, cfg, plan=_offload_plan(cfg, make_model("llama", layers=4), offload)) as engine:
        r0 = engine.evaluate(batch)
        want = _hf_loss(ref, batch)
        assert abs(r0.loss - want) <= 1e-5 * want, (r0.loss, want)
        engine.step(make_batch(4, 12, seed=0))
        r1 = engine.evaluate(batch)
        assert r1.loss != r0.loss  # the adapters moved, the base did not
        assert all(d.shell.dropout for d in engine.devices)  # back in training mode


def test_evaluate_on_packed_rows_is_the_documents_loss() -> None:
    """Rows packing several documents (position ids restarting): each attends within itself and
    its last token predicts nothing of the next one -- the loss is the documents' own, evaluated
    one by one; the same rows without position ids (one sequence each) differ. evaluate_dataset
    over a packed split keeps the positions too."""
    from test_packing import _per_document_loss, random_docs
    from tinypipe.train.data import pack
    from tinypipe.train.evaluation import evaluate_dataset, split_eval

    docs = random_docs(14, seed=1, longest=12)
    ds, stats = pack(docs, 16)
    assert stats.rows >= 3 and (ds.position_ids == 0).sum() > stats.rows
    model = make_model("llama")
    with torch.no_grad():  # sharper attention than a 0.02-std init: other documents would show
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(5.0)
    expected = _per_document_loss(model, docs)
    cfg = tinypipe.Config(devices=["cpu", "cpu"], pack_size=2, micro_batch_size=2, lr=0.0,
                          head_chunk_tokens=7)
    batch = ds.row_batch(slice(None))
    with tinypipe.Engine(model, cfg) as engine:
        packed = engine.evaluate(batch).loss
        crossed = engine.evaluate({"input_ids": batch["input_ids"], "labels": batch["labels"]}).loss
        whole = evaluate_dataset(engine, ds, 2)["eval_loss"]
        train_rows, held = split_eval(ds, 0.3, seed=0)
        assert held.position_ids is not None and train_rows.position_ids is not None
        split = evaluate_dataset(engine, held, 2)["eval_loss"]
        assert abs(split - engine.evaluate(held.row_batch(slice(None))).loss) <= 1e-6 * split
    assert abs(packed - expected) <= 1e-5 * expected, (packed, expected)
    assert abs(whole - expected) <= 1e-5 * expected, (whole, expected)
    assert abs(crossed - expected) > 1e-3 * expected, (crossed, expected)  # 100x the tolerance


def test_evaluate_runs_without_dropout_and_leaves_the_training_masks_alone() -> None:
    """A model with dropout (GPT-2, p=0.1) trained with it: evaluate runs in eval mode (the same
    value twice, the HF model's eval-mode loss), puts training mode back, and the training after
    it draws the masks a run that never evaluated draws (losses and weights bit-identical)."""
    from test_dropout import gpt2_with_dropout

    cfg = tinypipe.Config(devices=["cpu"] * 2, pack_size=2, micro_batch_size=2, lr=LR, dropout_seed=1234)
    a = tinypipe.Engine(gpt2_with_dropout(0.1), cfg)
    b = tinypipe.Engine(gpt2_with_dropout(0.1), cfg)
    try:
        assert all(d.shell.dropout for d in a.devices)
        for e in (a, b):
            e.step(make_batch(4, 10, seed=0))
        batch = make_batch(5, 10, seed=7, pad=True)
        first, again = a.evaluate(batch).loss, a.evaluate(batch).loss
        assert first == again
        assert all(d.shell.dropout for d in a.devices)
        a.synchronize()
        host = a.model.eval()
        want = _hf_loss(host, batch)
        assert abs(first - want) <= 1e-6 * want, (first, want)
        host.train()
        noisy = _hf_loss(host, batch)  # dropout on: what a training-mode evaluation would see
        assert abs(noisy - want) > 1e-4 * want  # 100x the tolerance above
        host.eval()
        for i in (1, 2):
            ra, rb = a.step(make_batch(4, 10, seed=i)), b.step(make_batch(4, 10, seed=i))
            assert (ra.loss, ra.grad_norm) == (rb.loss, rb.grad_norm)
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.equal(v, sb[k]) for k, v in sa.items())
    finally:
        a.close()
        b.close()
