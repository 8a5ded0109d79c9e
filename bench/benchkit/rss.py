"""Peak host memory of this process and its children, sampled in a background thread."""

from __future__ import annotations

import threading

import psutil


class RssSampler:
    """Samples RSS (process + children) every ``interval`` seconds; ``peak`` holds the maximum."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peak = 0
        self.peak_self = 0  # this process alone
        self.peak_children = 0  # child processes alone (e.g. compiler workers)
        self.max_children = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tinypipe-rss", daemon=True)
        self._proc = psutil.Process()

    def sample(self) -> int:
        own = self._proc.memory_info().rss
        children = 0
        kids = self._proc.children(recursive=True)
        for child in kids:
            try:
                children += child.memory_info().rss
            except psutil.Error:
                pass
        total = own + children
        self.peak = max(self.peak, total)
        self.peak_self = max(self.peak_self, own)
        self.peak_children = max(self.peak_children, children)
        self.max_children = max(self.max_children, len(kids))
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "RssSampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
