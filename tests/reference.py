"""Plain single-device PyTorch training: the ground truth tinypipe must reproduce."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


#: the least distance of any ReLU input from its kink along a reference run that the step checks
#: accept: the engine's rounding differs from the reference's by about 1e-8 there, and one input
#: within that of 0 takes the other branch (measured: an OPT run 1.8e-8 from the kink at step 2 moved
#: the next norms by 2e-4 on one CPU and not another; `kink_margin`)
KINK_MARGIN = 1e-7


@dataclass
class RefRun:
    model: torch.nn.Module
    losses: list[float]
    grad_norms: list[float]
    #: per step, the smallest |input| of any ReLU module (inf for models without one)
    kink_margins: list[float] | None = None


def hf_decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """The parameters Hugging Face Trainer decays, from the installed transformers' own method
    (it does not use ``self``)."""
    from transformers.trainer import Trainer

    return set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]


def hf_param_groups(model: torch.nn.Module, weight_decay: float, decay_all: bool = False) -> list[dict]:
    """torch.optim param groups as HF Trainer builds them: decay / no decay (or one group)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if decay_all:
        return [{"params": [p for _, p in params], "weight_decay": weight_decay}]
    decay = hf_decay_parameter_names(model)
    return [{"params": [p for n, p in params if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}]


class ReferenceTrainer:
    """Plain PyTorch training one step at a time: a deep copy of the model on one ``device``,
    torch.optim.AdamW over the trainable parameters (all of them for full fine-tuning, the adapters
    under LoRA) in HF Trainer's two groups (biases and norm weights not decayed; ``decay_all``: one
    group), loss from the HF model. ``micro_batch_size``: accumulate each step's gradient over
    micro-batches of that many sequences (each loss summed over its tokens / the global batch's
    count, as HF Trainer does), so every layer sees the shapes the engine's micro-batches have."""

    def __init__(self, model: torch.nn.Module, *, lr: float, eps: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), max_grad_norm: float | None = None,
                 decay_all: bool = False, device: str = "cpu", micro_batch_size: int | None = None) -> None:
        self.model = copy.deepcopy(model).to(device)
        _move_int8_statistics(self.model, device)
        self.device, self.max_grad_norm, self.micro_batch_size = device, max_grad_norm, micro_batch_size
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(hf_param_groups(self.model, weight_decay, decay_all), lr=lr, eps=eps,
                                     betas=betas)
        self.kink_margin = float("inf")  # the last step's smallest |ReLU input|
        self.hooks = [m.register_forward_hook(self._record_kink_margin) for m in self.model.modules()
                      if isinstance(m, torch.nn.ReLU)]

    def _record_kink_margin(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self.kink_margin = min(self.kink_margin, float(inputs[0].detach().abs().min()))

    def step(self, batch: dict) -> tuple[float, float]:
        """One optimizer step on ``batch``: (loss, gradient norm before clipping)."""
        self.kink_margin = float("inf")
        b = {k: v.to(self.device) for k, v in batch.items()}
        labels = b.get("labels")
        if labels is None:
            labels = b["input_ids"].clone()
            if "attention_mask" in b:
                labels[b["attention_mask"] == 0] = -100
        loss = _forward_backward(self.model, b, labels, self.micro_batch_size)
        if self.max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params])))
        self.opt.step()
        self.opt.zero_grad()
        return loss, norm


def train_reference(model: torch.nn.Module, batches: list[dict], **kwargs) -> RefRun:
    """``batches`` through a ``ReferenceTrainer(model, **kwargs)``; the trained model on the CPU."""
    trainer = ReferenceTrainer(model, **kwargs)
    steps, margins = [], []
    for b in batches:
        steps.append(trainer.step(b))
        margins.append(trainer.kink_margin)
    for hook in trainer.hooks:  # the returned model is plain again
        hook.remove()
    return RefRun(trainer.model.cpu(), [loss for loss, _ in steps], [norm for _, norm in steps], margins)


def _forward_backward(model: torch.nn.Module, b: dict, labels: torch.Tensor,
                      micro_batch_size: int | None) -> float:
    """The step's loss, its gradient accumulated on the parameters: the whole batch at once (HF's
    mean loss), or in micro-batches, each loss summed over its tokens / the global batch's count."""
    size = micro_batch_size or labels.shape[0]
    count = {} if micro_batch_size is None else {"num_items_in_batch": int((labels[:, 1:] != -100).sum())}
    total = 0.0
    for lo in range(0, labels.shape[0], size):
        part = {k: v[lo:lo + size] for k, v in b.items()}
        # packed documents: transformers builds per-document masks only without a KV cache
        extra = {"position_ids": part["position_ids"], "use_cache": False} if "position_ids" in part else {}
        out = model(input_ids=part["input_ids"], attention_mask=part.get("attention_mask"),
                    labels=labels[lo:lo + size], **count, **extra)
        out.loss.backward()
        total += float(out.loss.detach())
    return total


def randomize_biases(model: torch.nn.Module, seed: int = 1) -> None:
    """Biases start at zero in HF inits; give them values so relative weight errors are meaningful."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def compare(state: dict[str, torch.Tensor], ref: torch.nn.Module, init: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max per-tensor relative weight error, relative error of the whole update vector)."""
    rsd = ref.state_dict()
    assert set(state) == set(rsd), f"key mismatch: {sorted(set(state) ^ set(rsd))[:5]}"
    worst = max(float((state[k] - rsd[k]).norm() / rsd[k].norm()) for k in rsd)
    diff = sum(float(((state[k] - rsd[k]) ** 2).sum()) for k in rsd) ** 0.5
    delta = sum(float(((rsd[k] - init[k]) ** 2).sum()) for k in rsd) ** 0.5
    return worst, diff / delta


def assert_steps_match(results: list, ref: RefRun, clip: float | None) -> None:
    """Each engine step's loss and gradient norm within 1e-5 relative of the reference's, and
    clipped exactly when the reference's norm exceeds ``clip``. The reference must keep
    :data:`KINK_MARGIN` from every ReLU kink: nearer, one ulp picks the branch, and the comparison
    is of a discontinuous function (choose other data)."""
    assert len(results) == len(ref.losses)
    for k, margin in enumerate(ref.kink_margins or []):
        assert margin >= KINK_MARGIN, f"step {k}: a ReLU input {margin:.1e} from the kink; choose other data"
    for r, loss, norm in zip(results, ref.losses, ref.grad_norms):
        assert abs(r.loss - loss) <= 1e-5 * abs(loss), (r.loss, loss)
        assert abs(r.grad_norm - norm) <= 1e-5 * norm, (r.grad_norm, norm)
        if clip is not None:
            assert r.clipped == (norm + 1e-6 > clip)


def train_both(engine_model: torch.nn.Module, ref_model: torch.nn.Module, batches: list[dict], cfg: dict, *,
               lr: float, eps: float, weight_decay: float, head_chunk_tokens: int = 7) -> tuple:
    """Train ``ref_model`` with plain torch AdamW and ``engine_model`` (same initial weights; the
    same model, or a PEFT wrapper of it) through tinypipe with ``cfg``; every step must match.
    Returns (engine, reference run)."""
    import tinypipe

    clip = cfg.get("max_grad_norm")
    ref = train_reference(ref_model, batches, lr=lr, eps=eps, weight_decay=weight_decay, max_grad_norm=clip,
                          decay_all=cfg.get("decay_all", False))
    engine = tinypipe.Engine(engine_model, tinypipe.Config(lr=lr, eps=eps, weight_decay=weight_decay,
                                                           head_chunk_tokens=head_chunk_tokens, **cfg))
    assert_steps_match([engine.step(b) for b in batches], ref, clip)
    return engine, ref


def train_plan_against_reference(model: torch.nn.Module, plan, batches: list[dict], config) -> tuple:
    """Train ``model`` (its biases randomized, seed 0) through an engine running ``plan`` with
    ``config`` and through plain PyTorch on the same ``batches``: every step's loss and norm must
    match, and the final weights within 1e-5 relative per tensor and the update vector within 1e-4
    (tests/test_equivalence.py's tolerances). Returns (engine, its step results)."""
    import tinypipe

    torch.manual_seed(0)
    randomize_biases(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    clip = config.max_grad_norm
    ref = train_reference(model, batches, lr=config.lr, eps=config.eps, weight_decay=config.weight_decay,
                          max_grad_norm=clip)
    engine = tinypipe.Engine(model, config, plan=plan)
    results = [engine.step(b) for b in batches]
    assert_steps_match(results, ref, clip)
    worst, update_err = compare(engine.state_dict(), ref.model, init)
    assert worst <= 1e-5, f"max per-tensor relative weight error {worst:.2e}"
    assert update_err <= 1e-4, f"relative error of the update {update_err:.2e}"
    return engine, results


def _move_int8_statistics(model: torch.nn.Module, device: str) -> None:
    """``Module.to`` moves an ``Int8Params``' data but leaves its row scales (``SCB``, on the
    parameter or, after a forward, on the module's ``MatmulLtState``) where they were: on an H200
    the LLM.int8() reference then ran a kernel with CPU scales. Point them at ``device``."""
    for m in model.modules():
        w = getattr(m, "weight", None)
        if type(w).__name__ != "Int8Params":
            continue
        if getattr(w, "SCB", None) is not None:
            w.CB, w.SCB = w.data, w.SCB.to(device)
        state = getattr(m, "state", None)
        if state is not None and getattr(state, "SCB", None) is not None:
            state.CB, state.SCB = w.data, state.SCB.to(device)
