"""What a quantized base adds to a step's compute: bitsandbytes dequantizes every weight per pass.

For training-sized micro-batches (more than 256 rows) bitsandbytes' ``gemm_4bit`` dequantizes the
whole weight to the compute dtype and runs a dense GEMM (its fused kernel serves only small
batches), and the backward dequantizes it again for the input gradient. So each micro-batch
pays one dequantization per quantized weight in the forward, and two in the backward (the
recompute's forward, then the gradient): a memory-bound kernel reading ~0.56 bytes and writing 2
bytes per element, outside the GEMM roofline the cost model's FLOP rates cover.
"""

from __future__ import annotations

#: Seconds per dense element per dequantization on an H200: ~2.6 bytes of HBM traffic at ~3 TB/s
#: achieved. An estimate from the kernel's traffic (bench/qlora_bench.py measures the kernel and
#: prints it next to this figure).
DEQUANT_S_PER_PARAM = 0.85e-12
#: The H200's achieved bf16 rate in the hardware presets: other GPUs scale the dequantization by
#: their compute rate relative to it (HBM and matmul throughput move together across these parts:
#: an RTX 4090 has ~1/4.8 of the H200's bandwidth and ~1/4.4 of its achieved rate).
REFERENCE_TFLOPS = 400.0


def dequant_seconds(params: int, passes: int, bf16_tflops: float) -> float:
    """Seconds of dequantization for ``params`` quantized dense elements, ``passes`` times."""
    if params <= 0 or passes <= 0:
        return 0.0
    return params * passes * DEQUANT_S_PER_PARAM * REFERENCE_TFLOPS / max(bf16_tflops, 1e-9)
