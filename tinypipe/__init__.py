"""tinypipe: fine-tune LLMs larger than GPU memory on the servers people own.

Public API::

    engine = tinypipe.Engine(hf_model, tinypipe.Config(devices=["cuda:0"], ...))
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

__all__ = [
    "BatchError",
    "Config",
    "ConfigError",
    "Engine",
    "NonFiniteError",
    "PlanDoesNotFitError",
    "StepResult",
    "TinypipeError",
    "UnsupportedModelError",
    "WorkerError",
]
__version__ = "0.1.0"
