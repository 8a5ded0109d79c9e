"""Segment attention (``Config.segment_attention``, issue #32): packed documents, padding and sliding
windows attended without transformers' dense ``[B, 1, S, S]`` mask train exactly as plain PyTorch
with the masks (fp32, several steps) for Llama, Qwen2, Qwen3 and Mistral (window 8 < 16 tokens, and
the window's query blocks split inside a document); no block receives a mask; the user's model
keeps its own attention; the automatic choice leaves short sequences on transformers' masks; and a
sabotaged segmentation (documents merged) fails the same tolerances."""

from __future__ import annotations

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import compare, randomize_biases, train_both
from test_long_context import BATCH, SEQ, _packed_batches
from tinypipe.models import segment_attention as sa
from tinypipe.models.decompose import Decomposition
from tinypipe.models.shell import Shell

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LR, EPS, WD = 1e-3, 1e-6, 0.1
STEPS = 3


def _batches(kind: str) -> list[dict[str, torch.Tensor]]:
    if kind == "packed":
        return _packed_batches()
    return [make_batch(BATCH, SEQ, seed=i, pad=kind == "padded" and i != 2) for i in range(STEPS)]


CONFIGS = {
    "recompute": dict(devices=["cpu"], pack_size=2, micro_batch_size=2, backward_micro_batch_size=3),
    "kept_two_devices": dict(devices=["cpu", "cpu"], pack_size=[1, 3], micro_batch_size=2,
                             keep_activations=[False, True], stash="host", max_grad_norm=0.5),
}


def _segmented(engine: tinypipe.Engine) -> bool:
    return all(d.shell.segment_attention for d in engine.devices)


@pytest.mark.parametrize("kind", ["packed", "padded"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_segment_attention_matches_pytorch(family: str, name: str, kind: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Losses/gradient norms per step within 1e-5, final weights within 1e-5 per tensor and the
    update within 1e-4 of plain PyTorch with transformers' dense masks."""
    monkeypatch.setattr(sa, "WINDOW_BLOCK_TOKENS", 3)  # mistral: blocks of 8 queries inside a document
    model = make_model(family)
    if family == "mistral":
        assert model.config.sliding_window < SEQ
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = dict(CONFIGS[name], segment_attention=True)
    engine, ref = train_both(model, model, _batches(kind), cfg, lr=LR, eps=EPS, weight_decay=WD)
    assert _segmented(engine)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()


def test_compiled_blocks_with_segment_attention_match_pytorch() -> None:
    """Compiled blocks (the attention stays eager: segment lengths change per batch) on packed
    documents: the same tolerances against plain PyTorch."""
    torch._dynamo.reset()
    model = make_model("qwen2", layers=2)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = dict(devices=["cpu"], pack_size=2, micro_batch_size=3, compile_blocks="aot_eager",
               segment_attention=True)
    engine, ref = train_both(model, model, _batches("packed")[:2], cfg, lr=LR, eps=EPS, weight_decay=WD)
    assert _segmented(engine)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()
    torch._dynamo.reset()


def test_no_block_gets_a_mask_and_the_model_keeps_its_attention() -> None:
    """The shell's trunk hands every block the segment starts and no mask (nothing [B, 1, S, S] is
    built); the user's model still runs transformers' SDPA."""
    model = make_model("mistral")
    dec = Decomposition(model)
    shell = Shell(model, dec, torch.device("cpu"), segment_attention=True)
    params = dict(model.named_parameters())
    for name in dec.param_index():
        shell.bind(name, params[name].detach())
    batch = _packed_batches()[0]
    _, calls = shell.embed_forward(batch["input_ids"], None, batch["position_ids"])
    starts = sa.segment_starts(batch["input_ids"], None, batch["position_ids"])
    assert int(starts.sum()) > BATCH  # several documents per row
    for args, kwargs in calls:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        assert not any(t.dim() == 4 and t.shape[-1] == SEQ and t.shape[-2] == SEQ for t in tensors)
        assert kwargs.get("attention_mask") is None
        assert torch.equal(kwargs[sa.STARTS_KWARG], starts)
    assert model.config._attn_implementation == "sdpa"


def test_segment_starts() -> None:
    """Documents start where position ids do not continue; padding starts a segment; left padding too."""
    ids = torch.zeros(2, 6, dtype=torch.long)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    got = sa.segment_starts(ids, mask, pos)
    assert got.tolist() == [[True, False, False, True, False, True],
                            [True, False, True, False, False, False]]


def test_automatic_choice_and_unsupported_families() -> None:
    """Automatic: on above 16K tokens per row only; GPT-2 and eager attention keep the masks."""
    assert not sa.segment_attention_for(None, 16384) and sa.segment_attention_for(None, 16385)
    assert not sa.segment_attention_for(None, None) and sa.segment_attention_for(True, 16)
    assert not sa.segment_attention_for(False, 1 << 20)
    auto = tinypipe.Engine(make_model("llama"), tinypipe.Config(seq_len=SEQ, global_batch=BATCH))
    assert not any(d.shell.segment_attention for d in auto.devices)
    auto.close()
    gpt2 = make_model("gpt2")
    assert not Shell(gpt2, Decomposition(gpt2), torch.device("cpu"), segment_attention=True).segment_attention


def test_merged_documents_fail_these_tolerances(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: segments that ignore document starts (documents attend to each other) -- the same
    comparison must fail, so its tolerances can see a wrong segmentation."""
    real = sa.segment_starts

    def merged(input_ids, attention_mask, position_ids):  # type: ignore[no-untyped-def]
        return real(input_ids, attention_mask, None)

    monkeypatch.setattr("tinypipe.models.shell.segment_starts", merged)
    model = make_model("llama")
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = dict(CONFIGS["recompute"], segment_attention=True)
    with pytest.raises(AssertionError):  # the per-step losses, or else the final weights, differ
        engine, ref = train_both(model, model, _batches("packed"), cfg, lr=LR, eps=EPS, weight_decay=WD)
        worst, update_err = compare(engine.state_dict(), ref.model, init)
        engine.close()
        assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
