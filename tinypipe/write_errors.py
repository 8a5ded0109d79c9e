"""Failed writes as one line, whatever library wrote.

safetensors (0.8) reports a full disk or the file-size limit (``ulimit -f``) as a
``SafetensorError`` that is not an :class:`OSError` ("... (os error 28)"): :func:`os_errors` turns
it back into one, so every writer (checkpoints, the model, the adapter) catches ``OSError`` alone
and :func:`describe` words it the same way everywhere.
"""

from __future__ import annotations

import errno
import re
from contextlib import contextmanager
from typing import Iterator

from safetensors import SafetensorError

_OS_ERROR = re.compile(r"\(os error (\d+)\)")

#: The errnos a user can do something about (space, limits, permissions): one line, exit 2.
DISK_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EROFS, errno.EACCES,
                         errno.EPERM, errno.EFBIG})


def as_os_error(exc: BaseException) -> OSError | None:
    """``exc`` as an OSError with its errno (itself if it is one); None for another failure."""
    if isinstance(exc, OSError):
        return exc
    found = _OS_ERROR.search(str(exc)) if isinstance(exc, SafetensorError) else None
    if found is None:
        return None
    code = int(found.group(1))
    import os

    return OSError(code, os.strerror(code))


@contextmanager
def os_errors() -> Iterator[None]:
    """Inside: a SafetensorError that carries an OS error is raised as that OSError."""
    try:
        yield
    except SafetensorError as exc:
        converted = as_os_error(exc)
        if converted is None:
            raise
        raise converted from exc


def describe(exc: OSError) -> str:
    """``disk full`` / ``permission denied`` / ... for an OSError, for one-line messages."""
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return "disk full (no space left on device)"
    if exc.errno == errno.EFBIG:
        return "file too large (the file-size limit, ulimit -f)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.EROFS:
        return "read-only file system"
    return " ".join(str(exc.strerror or exc).split())
