"""Atomic file writes: the whole new file or the old one, never a torn one.

Every file vlseq_ext writes for the user (checkpoints, predictions, metrics summaries, plots) goes
through `write_atomically`: a temporary file beside the target, renamed over it with os.replace
(atomic on POSIX and Windows). A failed write (a full disk) removes the temporary and leaves the
old file as it was.

The new file gets the permissions a plain open() would give it (0o666 less the umask), or those
of the file it replaces: mkstemp creates its temporaries 0o600, which would make every checkpoint
and prediction unreadable to the user's group.

A stream (/dev/null, a FIFO, /dev/stdout) is never replaced: `open_stream` appends where it is.
`path_problem` says why a path given on a command line cannot be looked up.
"""
from __future__ import annotations

import errno
import glob
import os
import stat
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import IO, Any, Callable, Dict, Optional, Union

__all__ = ["write_atomically", "is_stream", "is_terminal", "open_stream", "stream_descriptor", "descriptor_problem",
           "fsync_dir", "new_file_mode", "path_problem"]

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


def path_problem(path: PathLike, dangling_ok: bool = False) -> Optional[str]:
    """Why `path` cannot be looked up, in words to follow it in a message, or None: a name in it (or
    the whole) longer than the file system allows, a symbolic link loop, a symbolic link to nothing
    on the way (at the end too, unless dangling_ok: an output is written through a link), no
    permission. A path that does not exist (yet) is no problem here."""
    try:
        os.stat(path)
        return None
    except (FileNotFoundError, NotADirectoryError):  # (missing, or a file on the way: the caller says so)
        for p in [Path(path), *Path(path).parents]:
            if os.path.islink(p) and not os.path.exists(p) and not (dangling_ok and p == Path(path)):
                where = "is" if p == Path(path) else f"goes through {p},"
                return (f"{where} a symbolic link to {os.readlink(p)}, which does not exist: create that, or give "
                        "another path")
        return None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            return _too_long(Path(path))
        if exc.errno == errno.ELOOP:
            loop = next((p for p in [*reversed(Path(path).parents), Path(path)] if _loops(p)), Path(path))
            what = "is a symbolic link loop" if loop == Path(path) else f"goes through {loop}, a symbolic link loop"
            return f"{what}: repair the link, or give another path"
        return f"cannot be looked up: {exc.strerror or exc}"


def _loops(p: Path) -> bool:
    try:
        os.stat(p)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def _too_long(path: Path) -> str:
    known = next((p for p in path.absolute().parents if os.path.isdir(p)), Path("/"))
    try:
        name_max, path_max = os.pathconf(known, "PC_NAME_MAX"), os.pathconf(known, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):
        name_max, path_max = 255, 4096
    for part in path.parts:
        n = len(os.fsencode(part))
        if n > name_max:
            return f"a name in it is {n} bytes long, and the file system allows {name_max}: choose a shorter name"
    n = len(os.fsencode(str(path.absolute())))
    return f"the path is {n} bytes long, and the system allows {path_max - 1}: choose a shorter path"


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` survive a power loss."""
    if os.name == "nt":  # directories cannot be opened for fsync on Windows; os.replace is enough there
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stream_descriptor(path: PathLike) -> Optional[int]:
    """The descriptor of this process that `path` names (/dev/stdout, /dev/stderr, /dev/fd/N,
    /proc/self/fd/N), or None."""
    text = os.path.abspath(str(path))
    named = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}.get(text)
    if named is not None:
        return named
    for base in ("/dev/fd/", "/proc/self/fd/"):
        if text.startswith(base) and text[len(base):].isdigit():
            return int(text[len(base):])
    return None


def descriptor_problem(path: PathLike) -> Optional[str]:
    """Why a descriptor of this process that `path` names cannot be written (not open, or open for
    reading only), in words to follow it in a message; None when it can, or `path` names none."""
    fd = stream_descriptor(path)
    if fd is None:
        return None
    try:
        import fcntl  # (POSIX: the only systems with such paths)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        return f"descriptor {fd} is not open: open it for writing ({fd}> FILE in the shell), or give a file name"
    if flags & os.O_ACCMODE == os.O_RDONLY:
        return f"descriptor {fd} is open for reading only: give a file name"
    return None


def open_stream(path: PathLike, binary: bool = False) -> IO[Any]:
    """A stream output (is_stream) opened for appending where it is. A descriptor of this process
    (/dev/stdout, ...) is written through a duplicate, which shares its offset with everything else
    the process writes there: opened anew, /dev/stdout redirected to a file would start at its
    beginning and the two writers would overwrite each other. Behind a redirect to a regular file it
    appends. A FIFO without a reader says so (a warning) before it waits for one."""
    kw: Dict[str, Any] = {} if binary else {"encoding": "utf-8", "newline": ""}
    mode = "ab" if binary else "a"
    fd = stream_descriptor(path)
    if fd is not None:
        for std, n in ((sys.stdout, 1), (sys.stderr, 2)):
            if fd == n and std is not None:
                std.flush()  # what the process printed there before comes first
        dup = os.dup(fd)
        if stat.S_ISREG(os.fstat(dup).st_mode):
            import fcntl  # (POSIX: the only systems with such paths)
            fcntl.fcntl(dup, fcntl.F_SETFL, fcntl.fcntl(dup, fcntl.F_GETFL) | os.O_APPEND)
        return os.fdopen(dup, mode, **kw)
    if stat.S_ISFIFO(os.stat(path).st_mode):
        try:  # (closing this end again would end the stream for a reader already there)
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
            warnings.warn(f"vlseq_ext: {path} is a FIFO that nothing reads yet: waiting for a reader (e.g. cat {path} "
                          "in another terminal)", RuntimeWarning, stacklevel=2)
        else:
            os.set_blocking(fd, True)
            return os.fdopen(fd, mode, **kw)
    return open(path, mode, **kw)


def is_terminal(path: PathLike) -> bool:
    """`path` is a terminal (/dev/stdout when it is one, /dev/tty, /dev/pts/N)."""
    fd = stream_descriptor(path)
    try:
        if fd is not None:
            return os.isatty(fd)
        if not stat.S_ISCHR(os.stat(path).st_mode):
            return False
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError:
        return False
    try:
        return os.isatty(fd)
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
        with open_stream(path, binary=not text) as fh:
            write(fh)
        return path
    if path.is_symlink():  # write where the link points; replacing the link would leave its target stale
        path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary's name starts with at most 100 bytes of the file's: a name near the file system's
    # limit would leave no room for the rest.
    prefix = "." + os.fsdecode(os.fsencode(path.name)[:100]) + "."
    if clear_stale:
        for stale in path.parent.glob(glob.escape(prefix) + "*.tmp"):
            stale.unlink(missing_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = new_file_mode()
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
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
