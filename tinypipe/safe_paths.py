"""File names read from files (a checkpoint's ``state.json``, a model index's ``weight_map``) name
files inside that directory only: an absolute name or one with ``..`` would make tinypipe read (or
trust) a file elsewhere on the machine, so it is refused in one line."""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath

from tinypipe.errors import ConfigError


def inside(folder: Path, name: object, source: Path) -> Path:
    """``folder / name`` when ``name`` is a plain relative file name; one-line ConfigError naming
    ``source`` (the file that listed it) otherwise."""
    text = str(name)
    parts = PurePosixPath(text).parts + PureWindowsPath(text).parts
    if (not isinstance(name, str) or not text or PurePosixPath(text).is_absolute()
            or PureWindowsPath(text).is_absolute() or ".." in parts):
        raise ConfigError(f"{source}: lists the file {text!r}, which is not inside {folder} (an absolute "
                          "or '..' path): refusing to read it; the file was edited or is not tinypipe's")
    return folder / text
