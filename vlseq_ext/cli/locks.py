"""A run holds its folder and its output files (file rules live-folder and live-output), from the
checks to the end of the run: two runs can never write one file."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List, Sequence, Tuple

from ..files import is_stream
from . import file_rules
from .checks import CLIError, missing_dirs, remove_empty_dirs

__all__ = ["RunLock", "check_not_held"]


class RunLock:
    """An exclusive flock on the run folder (the directory itself: no lock file is left behind) and on
    each output file of the run (metrics, plot; a stream is not held). An output that does not exist
    yet is created empty to be held, and removed again on release if the run left it empty; so are
    folders made for the lock. Locks die with the process however it ends. Where flock is missing
    (Windows, some network file systems) runs are not guarded.

    An output is held by its inode, which the run keeps while it runs: the metrics are appended to and
    trimmed in place; the plot is written (renamed over) at the end only."""

    def __init__(self, folder: Path, created: Sequence[Path] = (), outputs: Sequence[Tuple[str, Path]] = ()) -> None:
        """created: folders the configuration made for this run already (deepest first); outputs:
        (flag, path) of the run's output files."""
        self.fds: List[int] = []
        self.made: List[List[Path]] = [list(created)]  # folders made, each list deepest first
        self.placeholders: List[Path] = []
        try:
            import fcntl  # noqa: F401
        except ImportError:
            return
        try:
            self.made.append(missing_dirs(folder))
            folder.mkdir(parents=True, exist_ok=True)
            self._hold(os.open(folder, os.O_RDONLY), lambda: file_rules.refuse("live-folder", dir=folder))
            for flag, path in outputs:
                self._hold_file(flag, path)
        except BaseException:
            self.release()
            raise

    def _hold(self, fd: int, busy: Callable[[], None]) -> bool:
        """flock fd (kept open until release); busy() (which refuses) if another process holds it. False
        where the file system has no flock."""
        import fcntl
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            busy()
        except OSError:
            os.close(fd)
            return False
        self.fds.append(fd)
        return True

    def _hold_file(self, flag: str, path: Path) -> None:
        if is_stream(path):
            return
        real = Path(os.path.realpath(path))  # (a symbolic link: its target is what is written)
        self.made.append(missing_dirs(real.parent))
        real.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(8):  # until the inode held is the one at the path (another run may rename over it)
            try:
                fd, made = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), True
            except FileExistsError:
                fd, made = self._open(real, flag, path), False
            if not self._hold(fd, lambda: file_rules.refuse("live-output", flag=flag, path=path)):
                return
            try:
                if os.path.samestat(os.fstat(fd), os.stat(real)):
                    if made:  # (only once held: a file another run holds is never removed)
                        self.placeholders.append(real)
                    return
            except OSError:
                pass
            self.fds.remove(fd)
            os.close(fd)
        file_rules.refuse("live-output", flag=flag, path=path)

    @staticmethod
    def _open(real: Path, flag: str, path: Path) -> int:
        try:
            return os.open(real, os.O_WRONLY)
        except OSError as exc:
            raise CLIError(f"{flag} {path}: cannot be opened for writing: {exc.strerror or exc}") from None

    def release(self) -> None:
        """Remove what the run made and left empty, then let go of every lock."""
        for p in self.placeholders:
            try:
                if p.stat().st_size == 0:
                    p.unlink()
            except OSError:
                pass
        self.placeholders = []
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        for made in reversed(self.made):
            remove_empty_dirs(made)
        self.made = []


def check_not_held(outputs: Sequence[Tuple[str, Path]]) -> None:
    """No output is a file a live run holds (live-output), for a command that replaces files without
    holding them (vlseq-predict): the run would go on writing into the file replaced."""
    try:
        import fcntl
    except ImportError:
        return
    for flag, path in outputs:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (O_NONBLOCK: a FIFO opens at once)
        except OSError:
            continue  # not there (or not readable): nothing held
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            file_rules.refuse("live-output", flag=flag, path=path)
        except OSError:
            pass
        finally:
            os.close(fd)
