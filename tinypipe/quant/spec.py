"""What a quantized frozen base looks like, and the checks that refuse what bitsandbytes cannot do.

The formats, quantizers and kernels are bitsandbytes' own (``Linear4bit`` NF4/FP4 with optional
double quantization of the block scales, ``Linear8bitLt`` LLM.int8()); tinypipe only decides
where the bytes live. bitsandbytes is imported when a quantized base is actually asked for,
never at tinypipe's import time.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Iterator

import torch

from tinypipe.errors import ConfigError

SCHEMES = ("nf4", "fp4", "int8")
#: bitsandbytes 4-bit block sizes (elements per fp32 scale).
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
INSTALL = "pip install bitsandbytes==0.50.2 (or tinypipe[qlora])"


class QuantizeError(ConfigError):
    """A quantized base that cannot be built here: unknown scheme, no bitsandbytes, a device or
    model bitsandbytes does not support (one line, exit 2 from the CLI)."""


class MissingBitsandbytesError(QuantizeError, ImportError):
    """bitsandbytes is not installed."""


@dataclass(frozen=True)
class QuantSpec:
    """How the frozen base weights of the decoder blocks are quantized.

    * ``scheme`` -- ``"nf4"`` / ``"fp4"`` (``bnb.nn.Linear4bit``, 0.5 byte/parameter plus block
      scales) or ``"int8"`` (``bnb.nn.Linear8bitLt``, 1 byte/parameter plus a scale per row);
    * ``double_quant`` -- 4-bit only: quantize the fp32 block scales to 8 bits too (QLoRA's
      default; 0.127 instead of 0.5 bits/parameter of scales);
    * ``blocksize`` -- 4-bit only: elements per block scale (bitsandbytes' default 64);
    * ``compute_dtype`` -- what the kernels compute in: bf16, or fp32 for exact tests;
    * ``int8_threshold`` -- int8 only: LLM.int8()'s outlier threshold (transformers' default 6.0).
    """

    scheme: str
    double_quant: bool = True
    blocksize: int = 64
    compute_dtype: torch.dtype = torch.bfloat16
    int8_threshold: float = 6.0

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise QuantizeError(f"quantize must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.blocksize not in BLOCKSIZES:
            raise QuantizeError(f"4-bit blocksize must be one of {BLOCKSIZES}, got {self.blocksize!r}")
        if self.compute_dtype not in COMPUTE_DTYPES.values():
            raise QuantizeError(f"quantized compute dtype must be bf16 or fp32, got {self.compute_dtype}")
        if not isinstance(self.double_quant, bool):
            raise QuantizeError(f"double_quant must be true or false, got {self.double_quant!r}")

    @property
    def four_bit(self) -> bool:
        return self.scheme != "int8"

    @property
    def unit(self) -> int:
        """Bytes per element of the compute dtype: the unit a layer's flat buffers count in."""
        return torch.empty((), dtype=self.compute_dtype).element_size()

    @property
    def label(self) -> str:
        """``nf4``, ``nf4+dq``, ``fp4``, ``int8``: how memory reports name the frozen base."""
        return f"{self.scheme}+dq" if self.four_bit and self.double_quant else self.scheme


def spec_for(scheme: str, precision: str, double_quant: bool = True) -> QuantSpec:
    """The spec of ``scheme`` for an engine of ``precision`` (``"bf16"`` / ``"fp32"``)."""
    if precision not in COMPUTE_DTYPES:
        raise QuantizeError(f"a quantized base computes in bf16 or fp32, not {precision!r}")
    return QuantSpec(scheme, double_quant=double_quant, compute_dtype=COMPUTE_DTYPES[precision])


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Silence one bitsandbytes logger while it imports (on AVX512-BF16 CPUs its CPU backend
    warns that an optional Hub kernel package is missing; nothing tinypipe runs uses it)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def require_bitsandbytes() -> ModuleType:
    """The ``bitsandbytes`` module, or :class:`MissingBitsandbytesError` (one line)."""
    try:
        with _quiet("bitsandbytes.backends.cpu.ops"):
            return importlib.import_module("bitsandbytes")
    except ImportError as exc:
        raise MissingBitsandbytesError(f"a quantized base needs bitsandbytes ({exc}); run: {INSTALL}") \
            from None


def import_quietly() -> None:
    """Import bitsandbytes (if installed) with its CPU-backend warning silenced: PEFT imports it
    for every LoRA model once it is installed, and the warning is about a kernel nothing here uses."""
    if importlib.util.find_spec("bitsandbytes") is not None:
        try:
            require_bitsandbytes()
        except MissingBitsandbytesError:  # installed but broken: PEFT will say so itself
            pass


def check_device(spec: QuantSpec | str, device: torch.device) -> None:
    """Refuse a device bitsandbytes' kernels do not cover for ``spec`` (one line).

    bitsandbytes 0.50 runs NF4/FP4 (quantize, dequantize, ``Linear4bit`` forward and backward)
    on the CPU and on CUDA, LLM.int8() on the CPU; other device types are refused here rather than
    failing inside a kernel mid-step.
    """
    scheme = spec if isinstance(spec, str) else spec.scheme
    bnb = require_bitsandbytes()
    kind = torch.device(device).type
    if kind == "cpu":
        return
    if kind == "cuda":
        from bitsandbytes.cextension import CudaBNBNativeLibrary, lib

        if not isinstance(lib, CudaBNBNativeLibrary):
            raise QuantizeError(f"bitsandbytes {bnb.__version__} found no CUDA library for this GPU/CUDA "
                                f"version: {scheme} cannot run on {device}")
        if scheme == "int8":
            # measured on CUDA (docs/measured.md): int8 trains, its losses equal PEFT + bitsandbytes
            # to 1e-5, but its gradient norm differs by more (MatMul8bitLt's fp16 backward over
            # micro-batches) than the 1e-5 every other scheme meets; until that is pinned down int8
            # stays a CPU scheme
            raise QuantizeError(f"int8 QLoRA is verified on the CPU only; on {device} use --quantize nf4 "
                                "or fp4 (4-bit bases are smaller and as fast)")
        return
    raise QuantizeError(f"{scheme} quantized weights run on cpu or cuda devices with bitsandbytes "
                        f"{bnb.__version__}, not on {device}")
