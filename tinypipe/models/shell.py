"""A device's parameter-less copy of the model, run stage by stage: the embedding (the trunk's own
forward up to the first block), one decoder block, the head's logits.

Its parameters are bound per task to views of a device slot. A model holding quantized weights
(QLoRA) is copied with the quantization layer's helpers its decomposition carries
(:attr:`~tinypipe.models.decompose.Decomposition.quant`, :mod:`tinypipe.models.quant_hooks`).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from tinypipe.errors import UnsupportedModelError
from tinypipe.models.capture import Capture, Recorder, Stop
from tinypipe.models.compact import CompactBlock
from tinypipe.models.decompose import Decomposition
from tinypipe.models.segment_attention import (STARTS_KWARG, segment_attention_supported, segment_starts,
                                                use_segment_attention)


class Shell:
    """A parameter-less copy of the model for one compute device.

    Parameters are meta tensors until :meth:`bind` points them at views of a device buffer;
    buffers (rotary tables, masks) are real and live on the device. One shell per device entry,
    used by one thread, so binding never races.
    """

    def __init__(self, model: nn.Module, decomposition: Decomposition, device: torch.device,
                 dropout: bool = False, mlp_chunk_tokens: int = 0,
                 segment_attention: bool = False, attention_tile_tokens: int | None = None) -> None:
        memo: dict[int, Any] = {}
        # quantized weights (tinypipe.quant): rebuilt from a slot's payload bytes (once per slot)
        self._packed = {p.name: p.packed for s in decomposition.layers for p in s.params
                        if p.packed is not None}
        self._rebuilt: dict[tuple[str, int], Any] = {}  # (name, slot address) -> rebuilt parameter
        # the quantization layer's helpers (a decomposition with quantized layers always has them)
        self._quant = decomposition.quant if self._packed else None
        if self._quant is not None:
            memo.update(self._quant.shell_memo(model))
        for p in model.parameters():
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
        shell = copy.deepcopy(model, memo)
        for module in shell.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[name] = buf.to(device)
        if self._quant is not None:
            self._quant.prepare_shell(shell, device, {lay.scheme for lay in self._packed.values()})
        self.model = shell
        # training mode applies the model's dropout; the engine replays its draws in the recompute
        self.set_dropout(dropout)
        self.device = device
        self.decomposition = decomposition
        trunk = shell.get_submodule(decomposition.trunk_path)
        self.trunk = trunk
        self.blocks: nn.ModuleList = getattr(trunk, decomposition.blocks_attr)
        self.recorder = Recorder(len(self.blocks), stop=True)
        setattr(
            trunk,
            decomposition.blocks_attr,
            nn.ModuleList(Capture(self.recorder, i, b) for i, b in enumerate(self.blocks)),
        )
        self.runners: list[Any] = list(self.blocks)  # what block_forward calls (eager or compiled)
        # what block_forward calls for a kept pack's recorded forward (models/compact.py)
        self.compact_runners: list[Any] = [CompactBlock(b) for b in self.blocks]
        self.compiled = False  # whether the runners go through torch.compile
        self.post = [trunk.get_submodule(n) for n in decomposition.post_names]
        self.lm_head = shell.get_submodule(decomposition.head_path)
        self._slots: dict[str, tuple[nn.Module, str]] = {}
        for canon, names in decomposition.aliases.items():
            for n in names:
                path, attr = n.rsplit(".", 1) if "." in n else ("", n)
                module = self._resolve(shell, path)
                self._slots.setdefault(canon, []).append((module, attr))  # type: ignore[attr-defined]
        #: tokens per chunk of the blocks' MLPs (0: unchunked; models/chunked_mlp.py). Wrapped after
        #: the parameter slots are resolved: they hold the MLP's own modules, which stay as they are
        self.mlp_chunk_tokens = int(mlp_chunk_tokens)
        if self.mlp_chunk_tokens > 0:
            from tinypipe.models.chunked_mlp import FOLDABLE, chunk_mlps, fold_norms

            chunk_mlps(self.blocks, self.mlp_chunk_tokens)
            if getattr(shell.config, "model_type", None) in FOLDABLE:
                for block in self.blocks:
                    fold_norms(block, self.mlp_chunk_tokens)
        #: whether blocks attend per document without dense masks (models/segment_attention.py):
        #: asked for long sequences and honoured for the families it supports
        self.segment_attention = bool(segment_attention) and segment_attention_supported(shell)
        if self.segment_attention:
            use_segment_attention(shell, *self._attention_tiles(attention_tile_tokens, device))

    def _attention_tiles(self, setting: int | None, device: torch.device) -> tuple[int, str]:
        """The attention tile and its kernel for this shell (``Config.attention_tile_tokens``):
        0 (whole segments, with a warning) where no tile kernel agrees with softmax attention."""
        from tinypipe.models.tiled_attention import ATTENTION_TILE_TOKENS, tile_kernel_for

        tile = ATTENTION_TILE_TOKENS if setting is None else int(setting)
        if tile <= 0:
            return 0, ""
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        kernel = tile_kernel_for(device, dtype)
        if not kernel:
            warnings.warn(f"tinypipe: attention tiles do not run on {device} in {dtype} here; "
                          "long documents attend whole (more GPU memory in their backward)",
                          RuntimeWarning, stacklevel=2)
            return 0, ""
        return tile, kernel

    def _resolve(self, shell: nn.Module, path: str) -> nn.Module:
        dec = self.decomposition
        blocks_prefix = f"{dec.trunk_path}.{dec.blocks_attr}." if dec.trunk_path else f"{dec.blocks_attr}."
        if path.startswith(blocks_prefix):
            rest = path[len(blocks_prefix):]
            idx, _, sub = rest.partition(".")
            block = self.blocks[int(idx)]
            return block.get_submodule(sub) if sub else block
        return shell.get_submodule(path)

    @property
    def dropout(self) -> bool:
        """Whether the shell runs in training mode (the model's dropout applied)."""
        return self.model.training

    @property
    def quantized(self) -> bool:
        """Whether the shell holds bitsandbytes weights (a QLoRA base)."""
        return bool(self._packed)

    def set_dropout(self, enabled: bool) -> None:
        """Training mode (``True``) or eval mode for every module, e.g. eval for a forward-only
        evaluation; compiled blocks compile one more graph per mode. Quantized base layers (QLoRA)
        stay in eval mode: they are frozen, and bitsandbytes' int8 kernel differs in training mode."""
        # the blocks left the module tree when the capture wrappers replaced them: set them too
        parts = [self.model, *getattr(self, "blocks", ())]
        for part in parts:
            part.train(enabled)
        if self._quant is not None:
            for part in parts:
                self._quant.freeze_modes(part)

    def compile_blocks(self, backend: str, replay_random: bool = False) -> None:
        """Run the decoder blocks through torch.compile with ``backend`` (see models/compiled.py);
        ``replay_random``: their random ops must draw what eager ones draw."""
        from tinypipe.models.compiled import CompiledBlock

        self.runners = [CompiledBlock(b, backend, replay_random) for b in self.blocks]
        self.compact_runners = [CompiledBlock(CompactBlock(b), backend, replay_random) for b in self.blocks]
        if self.mlp_chunk_tokens > 0:  # long micro-batches: the chunk loops run outside the graphs
            from tinypipe.models.chunked_mlp import ChunkedMLP

            for block in self.blocks:
                for module in block.modules():
                    if isinstance(module, ChunkedMLP):
                        module.compile_chunks(backend, replay_random)
        self.compiled = True

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        """Point every alias of canonical parameter ``name`` at ``tensor`` (a quantized weight's
        payload: at bitsandbytes' parameter rebuilt as views of it)."""
        packed = self._packed.get(name)
        if packed is not None:  # rebuilt once per slot it lands in (~0.1 ms each), then reused
            key = (name, tensor.data_ptr())
            rebuilt = self._rebuilt.get(key)
            if rebuilt is None:
                rebuilt = self._rebuilt[key] = packed.rebuild(tensor)
            for module, attr in self._slots[name]:  # type: ignore[union-attr]
                packed.attach(module, attr, rebuilt)
            return
        for module, attr in self._slots[name]:  # type: ignore[union-attr]
            module._parameters[attr] = tensor  # type: ignore[assignment]

    # -- the three stages -------------------------------------------------------------------

    def embed_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, list[tuple[tuple, dict]]]:
        """Hidden states entering block 0 and the arguments the trunk passes to every block
        (``position_ids``: given to the trunk, which derives positions and masks from them)."""
        rec = self.recorder
        rec.hidden, rec.calls, rec.order = None, [None] * rec.count, []
        extra = {} if position_ids is None else {"position_ids": position_ids}
        try:
            self.trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
        except Stop:
            pass
        if rec.hidden is None or any(c is None for c in rec.calls):
            raise UnsupportedModelError("the trunk's forward did not reach every decoder block")
        calls, hidden = list(rec.calls), rec.hidden
        # the recorder lets go: holding it would keep the whole batch's embedding output on the
        # device until the next step's embedding, whatever the plan does with it
        rec.hidden, rec.calls = None, [None] * rec.count
        if self.segment_attention:  # the trunk built no mask: every block gets the segments instead
            starts = segment_starts(input_ids, attention_mask, position_ids)
            calls = [(args, {**kwargs, STARTS_KWARG: starts}) for args, kwargs in calls]  # type: ignore[misc]
        return hidden, calls  # type: ignore[return-value]

    def block_forward(self, index: int, hidden: torch.Tensor, call: tuple[tuple, dict],
                      compact: bool = False) -> torch.Tensor:
        """Block ``index`` on ``hidden``; ``compact``: saving only what models/compact.py keeps."""
        args, kwargs = call
        out = (self.compact_runners if compact else self.runners)[index](hidden, *args, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        for module in self.post:
            hidden = module(hidden)
        return self.lm_head(hidden)
