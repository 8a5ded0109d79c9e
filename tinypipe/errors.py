"""User-facing error types.

Every error a user can cause by bad input derives from :class:`TinypipeError` and carries a
one-line message: the CLI prints it without a traceback (exit code 2).
"""

from __future__ import annotations


class TinypipeError(Exception):
    """Base class for errors caused by input or environment, shown to users as one line."""


class ConfigError(TinypipeError, ValueError):
    """An invalid configuration value or combination."""


class UnsupportedModelError(TinypipeError):
    """The model cannot be decomposed into embedding, blocks and head."""


class PlanDoesNotFitError(TinypipeError):
    """No plan fits the memory budgets; the message says what would be needed."""


class BatchError(TinypipeError, ValueError):
    """A batch passed to ``Engine.step`` is malformed."""


class WorkerError(TinypipeError, RuntimeError):
    """A background worker (upload, compute, download, optimizer) failed; wraps the cause."""


class NonFiniteError(TinypipeError, FloatingPointError):
    """The loss or the gradients became NaN or infinite."""


class WriteError(TinypipeError, OSError):
    """Writing a checkpoint, the model or the metrics failed (disk full, permissions); what was
    already on disk (the previous checkpoint or output) is intact."""

    def __str__(self) -> str:  # one line, without OSError's "[Errno N]" prefix
        return str(self.args[0]) if self.args else "write failed"


class StorageError(TinypipeError, OSError):
    """The SSD tier's scratch storage failed: a missing or unwritable offload directory, too
    little free space, a full disk or an I/O error mid-run, a short read, or a region whose last
    write failed. Scratch is never a checkpoint, so the last checkpoint is intact."""

    def __str__(self) -> str:  # one line, without OSError's "[Errno N]" prefix
        return str(self.args[0]) if self.args else "storage failed"


class StalledError(TinypipeError, FloatingPointError):
    """Training stopped making progress: a gradient norm of 0 or a non-finite loss or norm (a
    learning rate that wrecked the model). Raised before that step's checkpoint, so the last
    checkpoint is from before it."""
