#!/usr/bin/env python3
"""Peak host memory (RSS) of loading a model: tinypipe's layer-by-layer loader vs ``from_pretrained``.

    python bench/load_peak.py PATH [--method tinypipe|from_pretrained] [--engine] [--json]

PATH is a Hugging Face model directory (safetensors, single or sharded) or a .gguf file. Run it
once per method (each run is a fresh process: the peak is the kernel's high-water mark, VmHWM,
reset just before the load). Prints the RSS before, the peak and the RSS after, next to the
bytes of the fp32 master weights the engine keeps (the "final store") and of the largest layer:
the loader's bound is ``peak growth <= store + largest layer``. ``--engine`` also builds a
``tinypipe.Engine`` (devices=["cpu"]) on the loaded model and reports the peak through that too
(a CPU "device" holds real copies of the resident embedding/head and the layer slots).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import psutil  # noqa: E402
import torch  # noqa: E402

MB = 1e6


class Peak:
    """Peak RSS from now on: the kernel's VmHWM after resetting it, else a 5 ms sampling thread."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.hwm = self._reset_hwm()
        self.sampled = 0
        self._stop = threading.Event()
        self._thread = None if self.hwm else threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # resets the peak resident set size (Linux >= 4.0)
            return True
        except OSError:
            return False

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.sampled = max(self.sampled, self.proc.memory_info().rss)

    def __enter__(self) -> "Peak":
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def value(self) -> int:
        if self.hwm:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        return max(self.sampled, self.proc.memory_info().rss)


def _load(path: str, method: str) -> torch.nn.Module:
    if method == "tinypipe":
        from tinypipe.train.model_io import load_model

        model, _ = load_model(path, tokenizer=False)
        return model
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _warm_imports(path: str) -> None:
    """Import everything either method needs before the baseline (transformers imports lazily:
    ~90 MB of modules on first use would otherwise count as "loading")."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig  # noqa: F401

    import tinypipe.models.gguf_stream  # noqa: F401
    import tinypipe.models.safetensors_stream  # noqa: F401
    import tinypipe.models.skeleton  # noqa: F401
    from tinypipe.train import model_io  # noqa: F401

    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    else:
        config = AutoConfig.from_pretrained(path)
    AutoModelForCausalLM._model_mapping[type(config)]  # imports the modeling module


def measure(path: str, method: str, engine: bool = False) -> dict:
    _warm_imports(path)
    proc = psutil.Process()
    gc.collect()
    before = proc.memory_info().rss
    t0 = time.perf_counter()
    with Peak() as peak:
        model = _load(path, method)
        load_s = time.perf_counter() - t0
        gc.collect()
        after = proc.memory_info().rss
        load_peak = peak.value()
    from tinypipe.models.decompose import Decomposition

    dec = Decomposition(model)
    store = sum(layer.numel for layer in dec.layers) * 4
    largest = max(layer.numel for layer in dec.layers) * 4
    out = dict(
        path=path, method=method, params=sum(p.numel() for p in model.parameters()),
        rss_before=before, peak=load_peak, rss_after=after, load_s=load_s,
        peak_growth=load_peak - before, store_bytes=store, largest_layer_bytes=largest,
        within_bound=load_peak - before <= store + largest,
        peak_source="VmHWM" if peak.hwm else "sampled",
    )
    if engine:
        import tinypipe

        with Peak() as peak2:
            eng = tinypipe.Engine(model, tinypipe.Config(devices=["cpu"], precision="fp32"))
            gc.collect()
            out["engine_peak"] = max(peak2.value(), load_peak)
            out["engine_rss_after"] = proc.memory_info().rss
            out["engine_host_store_bytes"] = eng.store.master_bytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--method", choices=["tinypipe", "from_pretrained"], default="tinypipe")
    ap.add_argument("--engine", action="store_true", help="also build an Engine on the loaded model")
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    args = ap.parse_args()
    out = measure(args.path, args.method, args.engine)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.method}: {out['params'] / 1e6:.1f} M params in {out['load_s']:.1f} s")
    print(f"  RSS before {out['rss_before'] / MB:.0f} MB, peak {out['peak'] / MB:.0f} MB "
          f"({out['peak_source']}), after {out['rss_after'] / MB:.0f} MB")
    print(f"  peak growth {out['peak_growth'] / MB:.0f} MB; final store (fp32 master) {out['store_bytes'] / MB:.0f} MB "
          f"+ largest layer {out['largest_layer_bytes'] / MB:.0f} MB = "
          f"{(out['store_bytes'] + out['largest_layer_bytes']) / MB:.0f} MB -> "
          f"{'within' if out['within_bound'] else 'ABOVE'} the bound")
    if args.engine:
        print(f"  through Engine(): peak {out['engine_peak'] / MB:.0f} MB, after {out['engine_rss_after'] / MB:.0f} MB")


if __name__ == "__main__":
    main()
