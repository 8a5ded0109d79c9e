"""tinypipe: fine-tune LLMs larger than GPU memory on the servers people own.

Public API::

    model, tokenizer = tinypipe.load_model("path/to/hf_dir")   # layer by layer, no second copy
    engine = tinypipe.Engine(model, tinypipe.Config(devices=["cuda:0"], ...))
    result = engine.step({"input_ids": ids, "labels": labels})

Nothing here touches hardware at import time.
"""

from tinypipe.config import Config
from tinypipe.errors import (
    BatchError,
    ConfigError,
    NonFiniteError,
    PlanDoesNotFitError,
    TinypipeError,
    UnsupportedModelError,
    WorkerError,
)
from tinypipe.runtime.engine import Engine, StepResult
from tinypipe.train.model_io import ModelLoadError, load_model

__all__ = [
    "BatchError",
    "Config",
    "ConfigError",
    "Engine",
    "ModelLoadError",
    "NonFiniteError",
    "PlanDoesNotFitError",
    "StepResult",
    "TinypipeError",
    "UnsupportedModelError",
    "WorkerError",
    "load_model",
]
__version__ = "0.1.0"
