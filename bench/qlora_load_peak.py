#!/usr/bin/env python3
"""Peak host memory (RSS) of loading a checkpoint quantized on the way in (QLoRA), then the Engine.

    python bench/qlora_load_peak.py PATH [--quantize nf4|fp4|int8] [--precision bf16|fp32] [--json]

PATH is a Hugging Face safetensors directory (any dtype). A fresh process; the kernel's
high-water mark (VmHWM) is reset just before the load, after the imports. Prints the RSS growth
of ``tinypipe.load_model(PATH, quantize=...)`` next to the bound it should meet -- the quantized
model it keeps (quantized block linears + the rest at the compute dtype), plus the largest
checkpoint tensor twice (as read, and at the compute dtype), plus the CPU quantizer's scratch
for one chunk (~24 bytes per element of ``tinypipe.quant.model.CPU_CHUNK``) -- and next to the
dense model's bytes at the compute dtype, which a load that materialised the model first would
exceed. Then the peak through ``tinypipe.Engine(...)`` over a LoRA-wrapped model on the CPU (its
host store takes the payloads over, plus a layer; the "device" slots are host memory there).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import psutil  # noqa: E402
import torch  # noqa: E402
from load_peak import Peak, _warm_imports  # noqa: E402

MB = 1e6
#: Temporaries of bitsandbytes' CPU 4-bit quantizer per element (fp32 copy, scaled values, int32
#: bucket indices, packing): what one chunk holds at once.
SCRATCH_BYTES_PER_ELEMENT = 24


def _checkpoint_facts(path: str) -> tuple[int, int]:
    """(elements of every stored tensor, elements of the largest) from the safetensors headers."""
    from pathlib import Path

    from tinypipe.models.safetensors_stream import read_header, safetensors_files

    entries = [e for f in safetensors_files(Path(path)) for e in read_header(f)]
    sizes = [e.nbytes // torch.empty((), dtype=e.dtype).element_size() for e in entries]
    return sum(sizes), max(sizes)


def measure(path: str, scheme: str, precision: str) -> dict:
    import tinypipe
    from tinypipe.lora import LoraSettings, apply_lora
    from tinypipe.quant import spec_for
    from tinypipe.quant.spec import require_bitsandbytes

    _warm_imports(path)
    require_bitsandbytes()
    import peft  # noqa: F401 - imported before the baseline, as transformers' modules are

    spec = spec_for(scheme, precision)
    total, largest = _checkpoint_facts(path)
    proc = psutil.Process()
    gc.collect()
    before = proc.memory_info().rss
    t0 = time.perf_counter()
    with Peak() as peak:
        model, _ = tinypipe.load_model(path, tokenizer=False, quantize=spec, quantize_device="cpu")
        load_s = time.perf_counter() - t0
        gc.collect()
        after = proc.memory_info().rss
        load_peak = peak.value()
    kept = sum(p.numel() * p.element_size() for p in model.parameters())
    kept += sum(p.quant_state.absmax.numel() * p.quant_state.absmax.element_size()
                for p in model.parameters() if getattr(p, "quant_state", None) is not None)
    pm = apply_lora(model, LoraSettings(rank=8, alpha=16, compute_dtype=precision))
    with Peak() as peak2:
        engine = tinypipe.Engine(pm, tinypipe.Config(devices=["cpu"], precision=precision, pack_size=1,
                                                     micro_batch_size=1))
        gc.collect()
        engine_peak = max(peak2.value(), load_peak)
        frozen = engine.store.frozen_bytes
        engine.close()
    unit = spec.unit
    from tinypipe.quant.model import CPU_CHUNK

    scratch = SCRATCH_BYTES_PER_ELEMENT * min(CPU_CHUNK, largest)
    return dict(
        path=path, scheme=spec.label, precision=precision, load_s=load_s, rss_before=before, peak=load_peak,
        rss_after=after, peak_growth=load_peak - before, kept_bytes=kept, largest_tensor_bytes=largest * unit,
        bound=kept + 2 * largest * unit + scratch, dense_bytes=total * unit, store_frozen_bytes=frozen,
        engine_peak_growth=engine_peak - before, peak_source="VmHWM" if peak.hwm else "sampled",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--quantize", default="nf4", choices=["nf4", "fp4", "int8"])
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    args = ap.parse_args()
    out = measure(args.path, args.quantize, args.precision)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['scheme']} load in {out['load_s']:.1f} s: RSS growth {out['peak_growth'] / MB:.0f} MB "
          f"({out['peak_source']}); bound {out['bound'] / MB:.0f} MB (kept {out['kept_bytes'] / MB:.0f} MB); "
          f"the dense model would be {out['dense_bytes'] / MB:.0f} MB")
    print(f"through Engine(): peak growth {out['engine_peak_growth'] / MB:.0f} MB, "
          f"host store frozen bytes {out['store_frozen_bytes'] / MB:.0f} MB")


if __name__ == "__main__":
    main()
