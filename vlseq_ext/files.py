"""Atomic file writes: the whole new file or the old one, never a torn one.

Every file vlseq_ext writes for the user (checkpoints, predictions, metrics summaries, plots) goes
through `write_atomically`: a temporary file beside the target, renamed over it with os.replace
(atomic on POSIX and Windows). A failed write (a full disk) removes the temporary and leaves the
old file as it was.

The new file gets the permissions a plain open() would give it (0o666 less the umask), or those
of the file it replaces: mkstemp creates its temporaries 0o600, which would make every checkpoint
and prediction unreadable to the user's group.
"""
from __future__ import annotations

import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import IO, Any, Callable, Union

__all__ = ["write_atomically", "is_stream", "fsync_dir", "new_file_mode"]

PathLike = Union[str, Path]
_umask_lock = threading.Lock()


def new_file_mode() -> int:
    """0o666 less the process's umask: the mode open() gives a new file."""
    try:  # Linux >= 4.7 reports the umask without changing it
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:  # elsewhere the only way to read it is to set it
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` survive a power loss."""
    if os.name == "nt":  # directories cannot be opened for fsync on Windows; os.replace is enough there
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_stream(path: PathLike) -> bool:
    """A device, FIFO or socket, or a name for an open descriptor (/dev/stdout, /dev/fd/N,
    /proc/self/fd/N, which may point at a regular file the shell redirected to): written in place and
    appended to, never replaced. Renaming a file over /dev/null would turn it into a regular file.
    Decided by what the path is, not where: /dev/shm holds ordinary files."""
    text = os.path.abspath(str(path))
    if text in ("/dev/stdout", "/dev/stderr") or text.startswith(("/dev/fd/", "/proc/self/fd/")):
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def write_atomically(path: PathLike, write: Callable[[IO[Any]], None], *, text: bool = False,
                     durable: bool = False, clear_stale: bool = False) -> Path:
    """write(fh) into a temporary file beside `path`, then rename it over `path`.

    text: fh is a UTF-8 text file with newline="" (csv and JSON writers), else binary.
    durable: fsync the file before the rename and the directory after it (checkpoints).
    clear_stale: first remove temporaries of this path left by a killed writer; only for callers
    that hold the folder alone (a training run holds its run folder).
    A symbolic link is written through: its target gets the new file, and the link stays. A stream
    (is_stream: /dev/null, a FIFO, /dev/stdout) is written in place.
    Raises the OSError of a failed write; `path` is then unchanged and no temporary is left."""
    path = Path(path)
    kw = {"newline": "", "encoding": "utf-8"} if text else {}
    if is_stream(path):
        with open(path, "a" if text else "ab", **kw) as fh:  # append: stdout redirected to a file keeps the rest
            write(fh)
        return path
    if path.is_symlink():  # write where the link points; replacing the link would leave its target stale
        path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    if clear_stale:
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            stale.unlink(missing_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = new_file_mode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, mode)
        with os.fdopen(fd, "w" if text else "wb", **kw) as fh:
            fd = -1  # the file object owns it now
            write(fh)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = ""
        if durable:
            fsync_dir(path.parent)
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp:
            Path(tmp).unlink(missing_ok=True)
    return path
