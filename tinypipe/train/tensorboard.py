"""``--report-to tensorboard``: each metrics record as TensorBoard scalars, with torch's own
``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package).

Tags follow Hugging Face Trainer's where it has one (``train/loss``, ``train/learning_rate``,
``train/grad_norm``, ``eval/loss``); tinypipe's own measurements sit under ``perf/`` and
``memory/``. A resumed run purges what the interrupted run had logged past its checkpoint, so
the curves show each step once.
"""

from __future__ import annotations

import os
from pathlib import Path

from tinypipe.errors import ConfigError

#: metrics-record field -> TensorBoard tag
TAGS = {
    "loss": "train/loss",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "seconds": "perf/step_seconds",
    "h2d_gbs": "perf/h2d_GBps",
    "d2h_gbs": "perf/d2h_GBps",
    "ssd_read_gbs": "perf/ssd_read_GBps",  # the SSD tier (--offload-dir)
    "ssd_write_gbs": "perf/ssd_write_GBps",
    "rss_bytes": "memory/host_rss_bytes",
    "gpu_peak_allocated": "memory/gpu_peak_allocated_bytes",
    "gpu_peak_reserved": "memory/gpu_peak_reserved_bytes",
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
}


class TensorBoardReporter:
    """Writes records (see :func:`tinypipe.train.loop.train`) to an event file under ``log_dir``."""

    def __init__(self, log_dir: str | os.PathLike[str], start_step: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError("--report-to tensorboard needs the tensorboard package "
                              "(pip install tensorboard)") from exc
        self.log_dir = Path(log_dir)
        # resumed: drop the interrupted run's events past the checkpoint (they are redone)
        self._writer = SummaryWriter(str(self.log_dir), purge_step=start_step + 1 if start_step else None)

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for field, tag in TAGS.items():
            value = record.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
