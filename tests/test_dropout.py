"""Dropout in training mode: the backward's recompute draws the forward's masks, bit for bit, and
training equals plain PyTorch autograd given the same masks.

The reference (:func:`reference_run`) is the model's own modules under plain autograd, no
recompute: the trunk's forward up to block 0 (a pre-hook stops it), then every pack's blocks on
every forward micro-batch in the engine's order, each stage from the generator state the engine
documents (:func:`tinypipe.runtime.rng.derive_seed` of the step, stage and forward micro-batch),
then the head and torch AdamW. Its masks are what the engine's *forward* drew; gradients match
only if the engine's recompute drew the same ones -- :func:`test_a_wrong_replay_is_caught` breaks
the replay on purpose and checks that the comparison fails.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
import transformers

import tinypipe
from model_zoo import make_batch, make_config
from reference import RefRun, assert_steps_match, compare, hf_param_groups, randomize_biases, train_reference
from tinypipe.lora import LoraSettings, apply_lora
from tinypipe.runtime.rng import EMBED, PACK, derive_seed, replay_pieces

LR, EPS, WD = 1e-3, 1e-6, 0.1
BATCH, SEQ, STEPS = 5, 12, 3
SEED = 1234


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def gpt2_with_dropout(p: float = 0.1, layers: int = 4) -> torch.nn.Module:
    cfg = make_config("gpt2", layers)
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = p
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize_biases(model)
    return model


def llama_lora_with_dropout(p: float = 0.2) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config("llama"), dtype=torch.float32).eval()
    pm = apply_lora(model, LoraSettings(rank=4, alpha=8.0, dropout=p))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # PEFT starts B at zero, which would hide A's gradients at step 1
        for name, prm in pm.named_parameters():
            if "lora_B" in name:
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.05)
    return pm


def _parts(model: torch.nn.Module) -> tuple[torch.nn.Module, Any, torch.nn.Module, torch.nn.Module]:
    """(trunk, blocks, final norm, output embedding) of a GPT-2 or Llama model (or its PEFT wrapper)."""
    inner = model.base_model.model if hasattr(model, "peft_config") else model
    if hasattr(inner, "transformer"):
        return inner.transformer, inner.transformer.h, inner.transformer.ln_f, inner.lm_head
    return inner.model, inner.model.layers, inner.model.norm, inner.lm_head


class _Stop(Exception):
    pass


def _block_inputs(trunk: torch.nn.Module, blocks: Any, ids: torch.Tensor) -> tuple[torch.Tensor, tuple, dict]:
    """The hidden states and other arguments the trunk passes to block 0 (with autograd)."""
    got: dict[str, Any] = {}

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        got["args"], got["kwargs"] = args, dict(kwargs)
        raise _Stop

    handle = blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        trunk(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    args, kwargs = got["args"], got["kwargs"]
    if args:
        return args[0], tuple(args[1:]), kwargs
    return kwargs.pop("hidden_states"), (), kwargs


def _rows(obj: Any, lo: int, hi: int, batch: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[lo:hi] if obj.ndim >= 2 and obj.shape[0] == batch else obj
    if isinstance(obj, tuple):
        return tuple(_rows(v, lo, hi, batch) for v in obj)
    if isinstance(obj, dict):
        return {k: _rows(v, lo, hi, batch) for k, v in obj.items()}
    return obj


def reference_run(model: torch.nn.Module, batches: list[dict], packs: list[int], micro_batch: int,
                  seed: int = SEED, generator: torch.Generator | None = None) -> RefRun:
    """Plain autograd over the engine's stages in the engine's order, each stage from the
    generator state the engine sets for it (module docstring)."""
    model = copy.deepcopy(model).train()
    gen = generator or torch.default_generator
    trunk, blocks, norm, head = _parts(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(hf_param_groups(model, WD), lr=LR, eps=EPS)  # HF Trainer's decay groups
    losses, norms = [], []
    for step, b in enumerate(batches):
        ids = b["input_ids"]
        B = ids.shape[0]
        gen.manual_seed(derive_seed(seed, step, EMBED))
        x, rest, kwargs = _block_inputs(trunk, blocks, ids)
        first = 0
        for q, size in enumerate(packs):
            outs = []
            for m, lo in enumerate(range(0, B, micro_batch)):
                hi = min(B, lo + micro_batch)
                gen.manual_seed(derive_seed(seed, step, PACK, q, m))
                h = x[lo:hi]
                for layer in range(first, first + size):
                    out = blocks[layer](h, *_rows(rest, lo, hi, B), **_rows(kwargs, lo, hi, B))
                    h = out[0] if isinstance(out, tuple) else out
                outs.append(h)
            x, first = torch.cat(outs), first + size
        logits = head(norm(x)).float()
        targets = ids[:, 1:]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction="sum") / targets.numel()
        loss.backward()
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return RefRun(model, losses, norms)


def _trained(state: dict[str, torch.Tensor], ref: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {n for n, p in ref.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in names}


class _Only:
    def __init__(self, model: torch.nn.Module, keys: dict) -> None:
        self._sd = {k: v for k, v in model.state_dict().items() if k in keys}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._sd


def run_against_reference(make: Callable[[], torch.nn.Module], cfg: dict) -> tinypipe.Engine:
    """Train the engine and the reference on the same batches; every step and the weights must
    match (1e-5 relative, the update vector 1e-4, as tests/test_equivalence.py)."""
    model = make()
    ref_inner = model.base_model.model if hasattr(model, "peft_config") else model
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(STEPS)]
    layers = len(_parts(model)[1])
    size = cfg.get("pack_size", 1)
    packs = [size] * (layers // size) if isinstance(size, int) else list(size)
    ref = reference_run(model, batches, packs, cfg["micro_batch_size"])
    init = {k: v.detach().clone() for k, v in ref_inner.state_dict().items()}
    engine = tinypipe.Engine(model, tinypipe.Config(lr=LR, eps=EPS, weight_decay=WD, head_chunk_tokens=7,
                                                    dropout_seed=SEED, **cfg))
    assert_steps_match([engine.step(b) for b in batches], ref, None)
    ref_model = ref.model.base_model.model if hasattr(ref.model, "peft_config") else ref.model
    trained = _trained(engine.state_dict(), ref_model)
    worst, update_err = compare(trained, _Only(ref_model, trained), {k: init[k] for k in trained})
    assert worst <= 1e-5, f"max per-tensor relative weight error {worst:.2e}"
    assert update_err <= 1e-4, f"relative error of the update {update_err:.2e}"
    return engine


CONFIGS = {
    "one_device_packs2_mb2": dict(devices=["cpu"], pack_size=2, micro_batch_size=2),
    # backward micro-batches straddle forward ones: each is recomputed whole, under its own seed
    "one_device_packs2_mb2_bwd3_host_stash": dict(devices=["cpu"], pack_size=2, micro_batch_size=2,
                                                  backward_micro_batch_size=3, stash="host"),
    "two_devices_packs2_mb2_bwd1": dict(devices=["cpu", "cpu"], pack_size=2, micro_batch_size=2,
                                        backward_micro_batch_size=1, prefetch_window=2),
    "two_devices_layerwise_mb3_bwd2": dict(devices=["cpu", "cpu"], pack_size=1, micro_batch_size=3,
                                           backward_micro_batch_size=2),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpt2_dropout_matches_pytorch_given_the_same_masks(name: str) -> None:
    run_against_reference(gpt2_with_dropout, CONFIGS[name]).close()


@pytest.mark.parametrize("name", ["one_device_packs2_mb2_bwd3_host_stash", "two_devices_packs2_mb2_bwd1"])
def test_lora_dropout_matches_peft_given_the_same_masks(name: str) -> None:
    engine = run_against_reference(llama_lora_with_dropout, CONFIGS[name])
    assert engine.peft_model is not None
    engine.close()


def test_compiled_blocks_draw_the_same_masks() -> None:
    """aot_eager (tests/test_compiled.py's CPU stand-in for Inductor): the no-grad forward graph and
    the grad recompute graph draw eager's masks from the state the engine sets."""
    torch._dynamo.reset()
    try:
        run_against_reference(gpt2_with_dropout, dict(devices=["cpu", "cpu"], pack_size=2, micro_batch_size=2,
                                                      backward_micro_batch_size=3,
                                                      compile_blocks="aot_eager")).close()
    finally:
        torch._dynamo.reset()


def test_a_wrong_replay_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replaying the neighbouring micro-batch's masks leaves the forward (and the loss) alone but
    changes the gradients: the reference comparison must fail."""
    import tinypipe.runtime.compute_handlers as handlers

    real = handlers.replay_pieces

    def shifted(rows: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
        return [((m + 1) % len(rows), a, b) for m, a, b in real(rows, lo, hi)]

    monkeypatch.setattr(handlers, "replay_pieces", shifted)
    with pytest.raises(AssertionError):
        run_against_reference(gpt2_with_dropout, CONFIGS["one_device_packs2_mb2"])


def _block_outputs(engine: tinypipe.Engine, batch: dict) -> dict[int, list[tuple[bool, torch.Tensor]]]:
    """Every block call of one step: layer -> [(grad enabled, output)], in call order."""
    seen: dict[int, list[tuple[bool, torch.Tensor]]] = defaultdict(list)
    handles = []
    for dev in engine.devices:
        for i, block in enumerate(dev.shell.blocks):
            def hook(module: torch.nn.Module, args: tuple, out: Any, i: int = i) -> None:
                t = out[0] if isinstance(out, tuple) else out
                seen[i].append((torch.is_grad_enabled(), t.detach().clone()))
            handles.append(block.register_forward_hook(hook))
    engine.step(batch)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("bwd", [2, 3, 1])
def test_recompute_equals_the_forward_bit_for_bit(bwd: int) -> None:
    cfg = dict(devices=["cpu"], pack_size=2, micro_batch_size=2, backward_micro_batch_size=bwd,
               dropout_seed=3)
    batch = make_batch(BATCH, SEQ, seed=0)
    engine = tinypipe.Engine(gpt2_with_dropout(0.3), tinypipe.Config(**cfg))
    seen = _block_outputs(engine, batch)
    off = tinypipe.Engine(gpt2_with_dropout(0.3), tinypipe.Config(**cfg, dropout=False))
    plain = _block_outputs(off, batch)
    frows = [(lo, min(BATCH, lo + 2)) for lo in range(0, BATCH, 2)]
    brows = [(lo, min(BATCH, lo + bwd)) for lo in range(0, BATCH, bwd)]
    replayed = [m for lo, hi in brows for m, _, _ in replay_pieces(frows, lo, hi)]
    for layer, calls in seen.items():
        forward = [t for grad, t in calls if not grad]
        recompute = [t for grad, t in calls if grad]
        assert len(forward) == len(frows) and len(recompute) == len(replayed)
        for t, m in zip(recompute, replayed):
            assert torch.equal(t, forward[m]), (layer, m)
        off = [t for grad, t in plain[layer] if not grad]
        assert not any(torch.equal(a, b) for a, b in zip(forward, off)), "dropout was not applied"
    engine.close()


def test_one_and_two_devices_draw_the_same_masks() -> None:
    """The masks depend on (seed, step, pack, forward micro-batch), not on the devices or the
    lanes' timing: 1 and 2 devices train to the same losses and weights."""
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(2)]
    runs = []
    for devices in (["cpu"], ["cpu", "cpu"]):
        cfg = tinypipe.Config(devices=devices, pack_size=2, micro_batch_size=2, dropout_seed=9, lr=LR)
        engine = tinypipe.Engine(gpt2_with_dropout(), cfg)
        runs.append(([engine.step(b).loss for b in batches], engine.state_dict()))
        engine.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def test_no_dropout_is_eval_mode_and_leaves_the_users_rng_alone() -> None:
    """``dropout=False`` trains as the eval-mode model (plain reference); with dropout on, the
    engine's draws do not move torch's global generator."""
    model = gpt2_with_dropout()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(STEPS)]
    ref = train_reference(model, batches, lr=LR, eps=EPS, weight_decay=WD)
    engine = tinypipe.Engine(model, tinypipe.Config(pack_size=2, micro_batch_size=2, lr=LR, eps=EPS,
                                                    weight_decay=WD, head_chunk_tokens=7, dropout=False))
    assert_steps_match([engine.step(b) for b in batches], ref, None)
    worst, _ = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5
    engine.close()
    engine = tinypipe.Engine(gpt2_with_dropout(), tinypipe.Config(pack_size=2, micro_batch_size=2))
    state = torch.get_rng_state()
    engine.step(batches[0])
    assert torch.equal(torch.get_rng_state(), state)
    engine.close()


def test_dropout_setting_is_validated() -> None:
    with pytest.raises(tinypipe.ConfigError, match="dropout"):
        tinypipe.Config(dropout="yes")  # type: ignore[arg-type]
    with pytest.raises(tinypipe.ConfigError, match="dropout_seed"):
        tinypipe.Config(dropout_seed=1.5)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_gpu_compiled_dropout_matches_pytorch() -> None:
    """On CUDA with Inductor (fallback_random for graphs with random ops): eager's kernels draw from
    the device generator in the compiled forward and the compiled recompute; fp32 training matches
    the reference run on the same GPU from the same generator states."""
    device = torch.device("cuda:0")
    torch._dynamo.reset()
    model = gpt2_with_dropout()
    batches = [{k: v.to(device) for k, v in make_batch(BATCH, SEQ, seed=i).items()} for i in range(STEPS)]
    ref = reference_run(copy.deepcopy(model).to(device), batches, [2, 2], 2,
                        generator=torch.cuda.default_generators[0])
    engine = tinypipe.Engine(model, tinypipe.Config(devices=["cuda:0"], pack_size=2, micro_batch_size=2,
                                                    backward_micro_batch_size=3, lr=LR, eps=EPS,
                                                    weight_decay=WD, head_chunk_tokens=7, dropout_seed=SEED,
                                                    compile_blocks="inductor", precision="fp32"))
    results = [engine.step({k: v.cpu() for k, v in b.items()}) for b in batches]
    for r, loss, norm in zip(results, ref.losses, ref.grad_norms):  # TF32-free fp32, GPU reduction orders
        assert abs(r.loss - loss) <= 1e-4 * abs(loss), (r.loss, loss)
        assert abs(r.grad_norm - norm) <= 1e-3 * norm, (r.grad_norm, norm)
    engine.close()


def test_resume_draws_the_uninterrupted_runs_masks(tmp_path) -> None:  # noqa: ANN001
    """The masks follow from (dropout_seed, step count): a checkpoint restores the step count, so
    a resumed run equals the uninterrupted one."""
    batches = [make_batch(BATCH, SEQ, seed=i) for i in range(3)]
    cfg = tinypipe.Config(pack_size=2, micro_batch_size=2, dropout_seed=11, lr=LR)
    with tinypipe.Engine(gpt2_with_dropout(), cfg) as engine:
        straight = [engine.step(b).loss for b in batches]
        final = engine.state_dict()
    with tinypipe.Engine(gpt2_with_dropout(), cfg) as engine:
        first = engine.step(batches[0]).loss
        engine.save_checkpoint(tmp_path / "ckpt")
    with tinypipe.Engine(gpt2_with_dropout(), cfg) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        resumed = [first] + [engine.step(b).loss for b in batches[1:]]
        assert resumed == straight
        state = engine.state_dict()
        assert all(torch.equal(state[k], final[k]) for k in final)
