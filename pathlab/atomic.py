"""Atomic file output: a file appears complete under its name or not at all.

Everything is written to a temporary file in the destination folder, flushed to disk and moved into place
with ``os.replace`` (atomic on POSIX and Windows). A crash or an exception leaves the previous file, if any,
untouched and removes the temporary one.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_output(path: str | os.PathLike):
    """``with atomic_output(path) as f: ...`` yields a binary file; on success it replaces ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual permissions
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, payload: bytes) -> Path:
    """Write ``payload`` to ``path`` atomically."""
    with atomic_output(path) as f:
        f.write(payload)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))
