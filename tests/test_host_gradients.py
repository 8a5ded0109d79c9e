"""Boundary gradients in their host stash's rows (``schedule/plan.py`` host_gradient_boundaries,
issue #32): at long sequences (MLPs in chunks) the gradient of a host-stashed pack input reuses the
stash's rows instead of a whole-batch device buffer. Training is unchanged: plain PyTorch within
1e-5 (fp32, three steps, a kept pack among recomputed ones), and with dropout replayed over two
forward micro-batches per backward one the same as with device buffers to 1e-6."""

from __future__ import annotations

import pytest
import torch

import tinypipe
from model_zoo import make_batch, make_model
from reference import compare, randomize_biases, train_both
from tinypipe.schedule import plan as plan_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LR, EPS, WD = 1e-3, 1e-6, 0.1
BATCH, SEQ, STEPS = 5, 16, 3
CHUNK = 5


def _spy(monkeypatch: pytest.MonkeyPatch, rule=None) -> list[int]:  # type: ignore[no-untyped-def]
    """Count the boundaries the runtime put on the host, per step."""
    real = rule or plan_module.host_gradient_boundaries
    seen: list[int] = []

    def spy(plan, long_sequences):  # type: ignore[no-untyped-def]
        out = real(plan, long_sequences)
        seen.append(sum(out))
        return out

    monkeypatch.setattr("tinypipe.runtime.step.host_gradient_boundaries", spy)
    return seen


@pytest.mark.parametrize("mb", [(1, 2), (2, 2)], ids=["bwd2_fwd1", "bwd2_fwd2"])
def test_host_gradients_match_pytorch(mb: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy(monkeypatch)
    model = make_model("qwen2")
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = dict(devices=["cpu"], pack_size=1, micro_batch_size=mb[0], backward_micro_batch_size=mb[1],
               stash="host", mlp_chunk_tokens=CHUNK, keep_activations=[False, False, True, False])
    batches = [make_batch(BATCH, SEQ, seed=i, pad=i == 1) for i in range(STEPS)]
    engine, ref = train_both(model, model, batches, cfg, lr=LR, eps=EPS, weight_decay=WD)
    assert seen and all(n == 4 for n in seen), seen  # boundaries 0..3 of 4 packs (0: the embedding's)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5 and update_err <= 1e-4, (worst, update_err)
    engine.close()


def _dropout_run(stash: str, fwd: int, bwd: int) -> dict[str, torch.Tensor]:
    from test_dropout import llama_lora_with_dropout

    engine = tinypipe.Engine(llama_lora_with_dropout(), tinypipe.Config(
        devices=["cpu"], pack_size=1, micro_batch_size=fwd, backward_micro_batch_size=bwd, stash=stash,
        mlp_chunk_tokens=CHUNK, lr=LR, eps=EPS, weight_decay=WD, dropout=True, dropout_seed=11))
    for i in range(STEPS):
        engine.step(make_batch(BATCH, SEQ, seed=i))
    state = engine.state_dict()
    engine.close()
    return state


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).norm()) / max(float(b[k].norm()), 1e-12) for k in b)


def test_dropout_replays_read_live_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA dropout, forward micro-batches of 1, backward ones of 2 (each replays two forward
    micro-batches): host gradients equal device ones within 1e-6."""
    seen = _spy(monkeypatch)
    host = _dropout_run("host", 1, 2)
    assert seen and all(n > 0 for n in seen)
    device = _dropout_run("device", 1, 2)
    assert _close(host, device) <= 1e-6
