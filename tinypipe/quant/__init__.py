"""Quantized frozen bases (QLoRA): bitsandbytes NF4/FP4/int8 weights stored, moved and used packed.

    model = tinypipe.quant.quantize_model(hf_model, QuantSpec("nf4"))     # in memory, or:
    model, tok = tinypipe.load_model("dir", quantize=QuantSpec("nf4"))   # quantized while streaming
    peft_model = tinypipe.lora.apply_lora(model, LoraSettings(rank=16))  # PEFT's bitsandbytes LoRA
    engine = tinypipe.Engine(peft_model, config)

The frozen base's quantized bytes (packed codes + block scales, one copy) live in the host store,
upload into the device slots as they are and are rebuilt there into bitsandbytes' own parameters;
only the adapters have fp32 masters, AdamW state and gradients. See :mod:`tinypipe.quant.layout`.
"""

from tinypipe.quant.layout import PackedLayout, layout_for
from tinypipe.quant.model import quantizable_linears, quantize_model, spec_of
from tinypipe.quant.spec import SCHEMES, MissingBitsandbytesError, QuantizeError, QuantSpec, spec_for

__all__ = [
    "SCHEMES",
    "MissingBitsandbytesError",
    "PackedLayout",
    "QuantSpec",
    "QuantizeError",
    "layout_for",
    "quantizable_linears",
    "quantize_model",
    "spec_for",
    "spec_of",
]
