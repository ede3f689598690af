"""Atomic file output (a file appears complete under its name or not at all) and an exclusive folder lock.

Everything is written to a temporary file ``.<name>.XXXX.tmp`` in the destination folder, flushed to disk and
moved into place with ``os.replace`` (atomic on POSIX and Windows). An exception leaves the previous file, if
any, untouched and removes the temporary one; a killed process leaves the temporary file behind, which
:func:`remove_stale_temporaries` clears. With ``keep_previous`` the file being replaced stays available under
a second name.

:class:`DirectoryLock` is an advisory lock on ``<folder>/.lock`` (``flock`` on POSIX, ``msvcrt.locking`` on
Windows). The operating system releases it when the holder exits, however it exits, so the lock file a dead
process leaves behind never blocks anyone.
"""

from __future__ import annotations

import os
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _keep_as(path: Path, previous: Path) -> None:
    """Make ``previous`` the file now at ``path``: a hard link, so ``path`` never goes missing, or a rename
    where the file system has no hard links."""
    link = previous.with_name(f".{previous.name}.{os.getpid()}.tmp")
    try:
        if link.exists():
            link.unlink()
        os.link(path, link)
        os.replace(link, previous)
    except OSError:
        if link.exists():
            link.unlink()
        os.replace(path, previous)


@contextmanager
def atomic_output(path: str | os.PathLike, *, keep_previous: str | os.PathLike | None = None):
    """``with atomic_output(path) as f: ...`` yields a binary file; on success it replaces ``path``.

    ``keep_previous``: where the file being replaced is kept (replacing what was there), moved just before
    the new file lands.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual permissions
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if keep_previous is not None and path.is_file():
            _keep_as(path, Path(keep_previous))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def remove_stale_temporaries(folder: str | os.PathLike, names) -> list[Path]:
    """Delete the temporary files that killed writes of ``folder/<name>`` left (``.<name>.*.tmp``); return them.

    Only safe while no other process writes those files (hold the folder's :class:`DirectoryLock`)."""
    folder = Path(folder)
    removed = []
    for name in names:
        for tmp in folder.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def atomic_write_bytes(path: str | os.PathLike, payload: bytes) -> Path:
    """Write ``payload`` to ``path`` atomically."""
    with atomic_output(path) as f:
        f.write(payload)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


class DirectoryLocked(RuntimeError):
    """Another live process holds the folder's lock."""


class DirectoryLock:
    """Exclusive lock on ``folder`` for as long as it is held: ``with DirectoryLock(folder): ...``.

    ``acquire`` fails at once with :class:`DirectoryLocked` (naming the folder and the holder's pid and host)
    when another process holds it. The lock file stays in place after release: deleting it could let two
    processes lock two different files of the same name.
    """

    NAME = ".lock"

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / self.NAME
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            else:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            try:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "pid unknown"
            except OSError:  # Windows: the locked byte cannot be read
                holder = "pid unknown"
            os.close(fd)
            raise DirectoryLocked(
                f"{self.folder} is in use by another process ({holder}); wait for it to finish or stop it, "
                "or use another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            if fcntl is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            else:
                os.lseek(self._fd, 0, os.SEEK_SET)
                msvcrt.locking(self._fd, msvcrt.LK_UNLCK, 1)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
