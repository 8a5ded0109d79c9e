"""sha256 of each checkpoint file, recorded in ``state.json`` and verified before the file is loaded:
a flipped byte or a swapped file is one line naming the file, never trained on.

Saving hashes each layer file in a background thread while the next one is written (``hashlib``
releases the GIL; the file is still in the page cache), so a save costs about one file's hash more
than before, not one pass over the whole checkpoint (bench/checkpoint_hash_cost.py measures it).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from tinypipe.errors import ConfigError


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class BackgroundHasher:
    """Hashes files in one background thread, in the order submitted; :meth:`digests` waits."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinypipe-hash")
        self._pending: dict[str, Future[str]] = {}

    def submit(self, path: Path) -> None:
        self._pending[path.name] = self._pool.submit(sha256_file, path)

    def digests(self) -> dict[str, str]:
        """File name -> sha256 hex of every submitted file (re-raises a failed read)."""
        return {name: future.result() for name, future in self._pending.items()}

    def __enter__(self) -> "BackgroundHasher":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def verify(path: Path, expected: str | None, record: str = "state.json") -> None:
    """One-line ConfigError when ``path``'s sha256 is not ``expected`` (None: a checkpoint written
    before checksums were recorded, not checked); ``record``: the file that lists the checksum."""
    if expected is None:
        return
    try:
        got = sha256_file(path)
    except OSError as exc:
        raise ConfigError(f"{path}: unreadable checkpoint file ({exc.strerror or exc})") from exc
    if got != expected:
        raise ConfigError(f"{path}: checksum mismatch (sha256 {got[:12]}..., {record} records "
                          f"{expected[:12]}...): the file changed after it was written (a damaged disk "
                          "or copy); restore the checkpoint from a copy or start over with --overwrite")
