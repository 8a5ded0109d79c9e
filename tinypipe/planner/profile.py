"""``tinypipe profile``: measure this machine for the planner.

Times one real decoder block of the given model shape at compute precision -- forward without
autograd (the engine's forward pass), recompute (forward building the graph) and backward -- and
the fused head (final norm + output embedding + loss, forward and backward), over a grid of
micro-batch sizes and sequence lengths; records the block's parameter bytes and its activation
bytes (saved for backward; on CUDA also the measured allocator peak of recompute + backward);
measures host<->device bandwidth (pinned H2D, D2H, both at once; on a CPU device, memcpy) and the
CPU's fused AdamW rate (:mod:`tinypipe.devices.rates`); with an offload directory, that directory's
direct-I/O read and write rates (:func:`tinypipe.storage.measure_rates`: ``ssd_read_gbps``,
``ssd_write_gbps``). The JSON it writes is a hardware file:
``tinypipe plan --hardware profile.json`` and ``plan_for(..., hardware="profile.json")`` use the
measured per-layer times instead of FLOP-rate estimates.
"""

from __future__ import annotations

import copy
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import transformers

from tinypipe.models.head_loss import HeadLoss
from tinypipe.planner.hardware import PROFILE_FORMAT, HardwareSpec, spec_from_dict
from tinypipe.planner.layer_profile import LayerProfile, ProfilePoint
from tinypipe.planner.probe import saved_tensor_bytes

if TYPE_CHECKING:
    from tinypipe.models.shell import Shell

PROFILE_VERSION = 1
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, reps: int,
           setup: Callable[[], object] | None = None) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up (``setup`` runs untimed
    before each)."""
    times = []
    for i in range(reps + 1):
        if setup is not None:
            setup()
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        if i:
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def _one_block_model(cfg: transformers.PretrainedConfig, device: torch.device,
                     dtype: torch.dtype) -> torch.nn.Module:
    from tinypipe.planner.probe import build_model, set_layers

    c = copy.deepcopy(cfg)
    set_layers(c, 1)
    c._attn_implementation = "sdpa"
    model = build_model(c, str(device), dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
    model.eval()
    return model


@dataclass
class _Bench:
    """One block of the model's shape and its head, run as the engine runs them, with every
    parameter bound to a leaf tensor (``bound``) so that backward fills their gradients."""

    dev: torch.device
    dtype: torch.dtype
    model: torch.nn.Module
    shell: Shell
    bound: dict[str, torch.Tensor]
    block_params: list[torch.Tensor]
    post_params: list[torch.Tensor]
    weight: torch.Tensor | None  # the output embedding (None: no single head weight)
    fast: bool  # the head runs the engine's fused chunk (a plain linear output layer)
    chunk: int  # head token chunk
    hidden: int
    vocab: int
    block_raw: int  # parameters of one block
    attn_width: int  # heads * head_dim
    head_matmul: int  # parameters of the output projection
    head_loss: HeadLoss  # the head's elementwise part, fused on CUDA as in the engine

    def clear_grads(self, *tensors: torch.Tensor) -> None:
        for t in (*self.block_params, *tensors):
            t.grad = None


def _bench(cfg: transformers.PretrainedConfig, dev: torch.device, dtype: torch.dtype,
           compile_blocks: str) -> _Bench:
    from tinypipe.models.compiled import resolve_backend
    from tinypipe.models.decompose import Decomposition
    from tinypipe.models.shell import Shell
    from tinypipe.models.head import chunk_tokens_for, is_plain_linear

    model = _one_block_model(cfg, dev, dtype)
    dec = Decomposition(model)
    shell = Shell(model, dec, dev)
    backend = resolve_backend(compile_blocks, dev.type == "cuda")
    if backend is not None:
        shell.compile_blocks(backend)
    named = dict(model.named_parameters())
    bound: dict[str, torch.Tensor] = {}
    for name in dec.aliases:
        t = named[name].detach().requires_grad_(True)
        bound[name] = t
        shell.bind(name, t)
    block_params = [bound[p.name] for p in dec.blocks[0].params]
    heads = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_head", 0) or 1)
    head_dim = int(getattr(cfg, "head_dim", 0) or 0) or int(cfg.hidden_size) // heads
    vocab, hidden = int(cfg.vocab_size), int(cfg.hidden_size)
    wname = dec.head_weight_name
    weight = bound.get(wname) if wname else None
    return _Bench(
        dev=dev, dtype=dtype, model=model, shell=shell, bound=bound, block_params=block_params,
        post_params=[p for m in shell.post for p in m.parameters()], weight=weight,
        fast=weight is not None and is_plain_linear(shell.lm_head), chunk=chunk_tokens_for(vocab),
        hidden=hidden, vocab=vocab, block_raw=sum(p.numel() for p in block_params),
        attn_width=heads * head_dim, head_matmul=weight.numel() if weight is not None else vocab * hidden,
        head_loss=HeadLoss(backend),
    )


def _time_block(b: _Bench, x: torch.Tensor, call: tuple[tuple, dict], reps: int) -> dict:
    """Forward without autograd, recompute (forward building the graph) and backward of the block on
    ``x``; the bytes autograd saves for backward (not the input, not parameters) and, on CUDA, the
    allocator peak of recompute + backward."""
    with torch.no_grad():
        fwd = _timed(lambda: b.shell.block_forward(0, x, call), b.dev, reps)
    xg = x.detach().requires_grad_(True)
    gout = torch.randn_like(x) * 1e-3
    state: dict[str, torch.Tensor] = {}

    def recompute() -> None:
        with torch.enable_grad():
            state["y"] = b.shell.block_forward(0, xg, call)

    def backward() -> None:
        torch.autograd.backward(state.pop("y"), gout)

    rec = _timed(recompute, b.dev, reps)
    bwd = _timed(backward, b.dev, reps, setup=recompute)
    b.clear_grads(xg)
    skip = {t.untyped_storage().data_ptr() for t in b.bound.values()} | {xg.untyped_storage().data_ptr()}
    peak_extra = None
    if b.dev.type == "cuda":
        _sync(b.dev)
        base = torch.cuda.memory_allocated(b.dev)
        torch.cuda.reset_peak_memory_stats(b.dev)
    saved_bytes = saved_tensor_bytes(recompute, skip)
    backward()
    if b.dev.type == "cuda":
        _sync(b.dev)
        peak_extra = torch.cuda.max_memory_allocated(b.dev) - base
    b.clear_grads(xg)
    return {"forward_s": fwd, "recompute_s": rec, "backward_s": bwd, "saved_bytes": saved_bytes,
            "peak_extra": peak_extra}


def _time_head(b: _Bench, x: torch.Tensor, g: torch.Generator, reps: int) -> float:
    """Norm + logits + loss, forward and backward, in the engine's token chunks."""
    from tinypipe.models.head import fused_head_chunk

    flat = x.reshape(-1, b.hidden)
    labels = torch.randint(0, b.vocab, (flat.shape[0],), generator=g).to(b.dev)
    denom = float(flat.shape[0])
    wacc = torch.zeros_like(b.weight) if b.fast else None

    def head() -> None:
        for c0 in range(0, flat.shape[0], b.chunk):
            c1 = min(flat.shape[0], c0 + b.chunk)
            if b.fast:
                fused_head_chunk(b.shell.post, b.shell.lm_head, flat[c0:c1], labels[c0:c1], denom,
                                 b.post_params, wacc, loss_grad=b.head_loss)
            else:
                xx = flat[c0:c1].detach().requires_grad_(True)
                with torch.enable_grad():
                    loss = torch.nn.functional.cross_entropy(b.shell.head_logits(xx).float(), labels[c0:c1])
                torch.autograd.backward(loss)

    head_s = _timed(head, b.dev, reps)
    for p in b.bound.values():
        p.grad = None
    return head_s


def _measure_point(b: _Bench, seq: int, mb: int, g: torch.Generator, reps: int) -> dict:
    """Every measurement at one (sequence length, micro-batch), as the profile's JSON records it."""
    ids = torch.randint(0, b.vocab, (mb, seq), generator=g).to(b.dev)
    with torch.no_grad():
        hidden_in, calls = b.shell.embed_forward(ids, None)
    x = hidden_in.detach().to(b.dtype)
    block = _time_block(b, x, calls[0], reps)
    head_s = _time_head(b, x, g, reps)
    tokens = seq * mb
    saved_bytes = block["saved_bytes"]
    d = {"seq": int(seq), "micro_batch": int(mb), "tokens": tokens, "forward_s": block["forward_s"],
         "recompute_s": block["recompute_s"], "backward_s": block["backward_s"], "head_s": head_s,
         "act_saved_bytes": int(saved_bytes), "act_saved_bytes_per_token": saved_bytes / tokens,
         "stash_bytes": tokens * b.hidden * x.element_size()}
    if block["peak_extra"] is not None:
        d["act_peak_bytes"] = int(block["peak_extra"])
    return d


def _point_line(d: dict) -> str:
    return (f"  seq {d['seq']:>6} x mb {d['micro_batch']:>3}: forward {d['forward_s'] * 1e3:8.2f} ms  "
            f"recompute {d['recompute_s'] * 1e3:8.2f} ms  backward {d['backward_s'] * 1e3:8.2f} ms  "
            f"head {d['head_s'] * 1e3:8.2f} ms  activations {d['act_saved_bytes'] / 2**20:8.1f} MiB")


def profile_layers(cfg: transformers.PretrainedConfig, device: str, precision: str, seq_lens: Sequence[int],
                   micro_batches: Sequence[int], reps: int = 3,
                   log: Callable[[str], None] | None = None,
                   compile_blocks: str = "auto") -> tuple[LayerProfile, list[dict], dict]:
    """Time one block of ``cfg``'s shape and its head at every (seq, micro-batch): returns the
    :class:`LayerProfile`, per-point details (times, activation bytes) and sizes. Blocks run
    as the engine runs them (``compile_blocks``: compiled on CUDA by default)."""
    dev = torch.device(device)
    dtype = _DTYPES[precision]
    b = _bench(cfg, dev, dtype, compile_blocks)
    g = torch.Generator(device="cpu").manual_seed(1)
    points, details = [], []
    for seq in seq_lens:
        for mb in micro_batches:
            d = _measure_point(b, seq, mb, g, reps)
            points.append(ProfilePoint(int(seq), int(mb), d["forward_s"], d["recompute_s"], d["backward_s"],
                                       d["head_s"]))
            details.append(d)
            if log:
                log(_point_line(d))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    act = max((d["act_saved_bytes_per_token"] for d in details), default=0.0) or None
    prof = LayerProfile(precision, int(b.block_raw), int(b.attn_width), int(b.head_matmul), tuple(points),
                        act)
    esize = torch.empty((), dtype=dtype).element_size()
    sizes = {"block_params": int(b.block_raw), "block_param_bytes": int(b.block_raw) * esize,
             "block_master_bytes": int(b.block_raw) * 4, "head_params": int(b.head_matmul),
             "attn_width": int(b.attn_width), "hidden": b.hidden, "vocab": b.vocab}
    del b
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return prof, details, sizes


def run_profile(device: str = "cpu", model: str | transformers.PretrainedConfig | None = None, *,
                seq_lens: Sequence[int] = (1024, 2048), micro_batches: Sequence[int] = (1, 2, 4),
                precision: str | None = None, reps: int = 3, transfer_bytes: int | None = None,
                adamw_params: int | None = None, log: Callable[[str], None] | None = print,
                offload_dir: str | None = None, ssd_bytes: int = 1 << 30) -> dict:
    """Measure and return the profile as a JSON-able dict (a valid hardware file); with
    ``offload_dir`` also its SSD rates (``ssd_bytes`` written and read back there)."""
    from tinypipe.devices.rates import cpu_copy_gbs, measure
    from tinypipe.planner.presets import load_model_config

    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        from tinypipe.errors import ConfigError

        raise ConfigError(f"device {device}: CUDA is not available")
    precision = precision or ("bf16" if cuda else "fp32")
    t0 = time.perf_counter()
    rates = measure(device, transfer_bytes=transfer_bytes or (1 << 30 if cuda else 64 << 20),
                    adamw_params=adamw_params or (50_000_000 if cuda else 4_000_000),
                    matmul_n=8192 if cuda else 0)
    if cuda:
        h2d, d2h, both = rates.h2d_gbs, rates.d2h_gbs, rates.both_gbs
        dev_name = rates.device_name
        gpu_mem = torch.cuda.get_device_properties(device).total_memory
    else:
        copy_gbs = cpu_copy_gbs(transfer_bytes or (64 << 20))
        h2d = d2h = copy_gbs
        both = copy_gbs
        dev_name = platform.processor() or platform.machine() or "cpu"
        import psutil

        gpu_mem = int(psutil.virtual_memory().total)
    if log:
        log(f"{device} ({dev_name}): H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s, both {both:.1f} GB/s, "
            f"CPU fused AdamW {rates.adamw_gparams_s:.2f} G params/s")
    out: dict = {
        "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": f"profile-{device.replace(':', '')}",
        "description": f"measured by tinypipe profile on {dev_name} ({platform.node()})",
        "device": device, "device_name": dev_name, "gpu_memory_bytes": int(gpu_mem),
        "h2d_gbs": h2d, "d2h_gbs": d2h, "bidir_gbs": both, "cpu_adamw_gparams_s": rates.adamw_gparams_s,
        "matmul_tflops": rates.matmul_tflops or None, "torch": torch.__version__,
    }
    if model is not None:
        cfg = model if isinstance(model, transformers.PretrainedConfig) else load_model_config(str(model))
        name = model if isinstance(model, str) else getattr(cfg, "name_or_path", "") or cfg.model_type
        if log:
            log(f"one {cfg.model_type} block (hidden {cfg.hidden_size}) at {precision}:")
        prof, details, sizes = profile_layers(cfg, device, precision, seq_lens, micro_batches, reps=reps,
                                              log=log)
        best = prof.best_rate("forward") / 1e12
        out["model"] = {"name": str(name), "model_type": cfg.model_type, **sizes}
        out["precision"] = precision
        out["layer_profile"] = prof.as_dict()
        out["points"] = details
        # the FLOP-rate fallback (other precisions) and the presets' convention: achieved block rate
        if precision == "bf16":
            out["bf16_tflops"] = best
        else:
            out["fp32_tflops"] = best
            out["bf16_tflops"] = (rates.matmul_tflops / 2) if rates.matmul_tflops else best
    else:
        out["bf16_tflops"] = (rates.matmul_tflops / 2) if rates.matmul_tflops else 0.1
    if not out["bf16_tflops"] or out["bf16_tflops"] <= 0:
        out["bf16_tflops"] = 0.1
    if offload_dir is not None:
        from tinypipe.storage import check_directory, measure_rates

        ssd = measure_rates(check_directory(offload_dir), ssd_bytes, mixed=True)
        out["ssd_read_gbps"], out["ssd_write_gbps"] = float(ssd["read_gbps"]), float(ssd["write_gbps"])
        out["ssd_mixed_gbps"] = float(ssd["mixed_gbps"])
        out["ssd"] = dict(ssd, directory=str(offload_dir))
        if log:
            log(f"{offload_dir}: SSD read {out['ssd_read_gbps']:.2f} GB/s, "
                f"write {out['ssd_write_gbps']:.2f} GB/s, both at once {out['ssd_mixed_gbps']:.2f} GB/s"
                + ("" if ssd["direct"] else " (buffered: the filesystem refused O_DIRECT)"))
    out["seconds"] = time.perf_counter() - t0
    return out


def hardware_from_profile(d: dict) -> HardwareSpec:
    """The :class:`HardwareSpec` a profile dict describes (what ``--hardware FILE`` loads)."""
    return spec_from_dict(d, d.get("name", "profile"))


def save_profile(d: dict, path: str | Path) -> Path:
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(d, indent=1))
    tmp.replace(p)
    return p
