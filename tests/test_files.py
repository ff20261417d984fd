"""Atomic writes (vlseq_ext.files): every file the user gets has the permissions a plain open()
gives, or those of the file it replaces; a failed write leaves the old file whole; a symbolic link
is written through. Checkpoints, predictions, metrics summaries and plots all go this way."""
import errno
import importlib.util
import os
import stat

import pytest
import torch

from vlseq_ext import files
from vlseq_ext.checkpoint import save_checkpoint

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o640
    os.umask(old)


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_file_mode_follows_the_umask(umask_027):
    assert files.new_file_mode() == umask_027


@pytest.mark.parametrize("text", [False, True])
def test_a_new_file_gets_what_open_would_give(tmp_path, umask_027, text):
    path = files.write_atomically(tmp_path / "sub" / "f", lambda fh: fh.write("x" if text else b"x"), text=text)
    assert path.read_bytes() == b"x"
    with open(tmp_path / "plain", "w"):
        pass
    assert mode(path) == mode(tmp_path / "plain") == umask_027


def test_a_replaced_file_keeps_its_mode(tmp_path, umask_027):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    os.chmod(path, 0o604)
    files.write_atomically(path, lambda fh: fh.write(b"new"), durable=True)
    assert path.read_bytes() == b"new" and mode(path) == 0o604


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")

    def full_disk(fh):
        fh.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        files.write_atomically(path, full_disk)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_symbolic_link_is_written_through(tmp_path):
    target = tmp_path / "store" / "preds.csv"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "preds.csv"
    link.symlink_to(target)
    files.write_atomically(link, lambda fh: fh.write("new"), text=True)
    assert link.is_symlink() and target.read_text() == "new"


def test_stale_temporaries_are_cleared_only_when_asked(tmp_path):
    path = tmp_path / "last.pt"
    stale = tmp_path / ".last.pt.abc123.tmp"
    stale.write_bytes(b"left by a killed writer")
    files.write_atomically(path, lambda fh: fh.write(b"1"))
    assert stale.exists()
    files.write_atomically(path, lambda fh: fh.write(b"2"), clear_stale=True)
    assert not stale.exists() and path.read_bytes() == b"2"


def test_checkpoints_are_readable_as_the_umask_allows(tmp_path, umask_027):
    # mkstemp makes 0o600 files: before the fix every checkpoint was private to its writer
    path = save_checkpoint({"w": torch.ones(3)}, tmp_path / "run" / "last.pt")
    assert mode(path) == umask_027
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_a_plot_that_fails_to_save_leaves_the_old_plot(tmp_path, monkeypatch, umask_027):
    from matplotlib.figure import Figure

    from vlseq_ext.cli.reporting import write_plot

    history = {"step": [1, 2, 3], "loss": [1.0, 0.5, 0.25], "val_step": [3], "val_loss": [0.3],
               "val_accuracy": [None]}
    path = tmp_path / "loss.png"
    write_plot(path, history, "run")
    old = path.read_bytes()
    assert old.startswith(b"\x89PNG") and mode(path) == umask_027
    real = Figure.savefig

    def full_disk(self, fh, **kw):
        real(self, fh, **kw)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(OSError):
        write_plot(path, history, "run")
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]


@pytest.mark.filterwarnings("ignore:vlseq_ext.*FIFO that nothing reads yet")  # (the reader may open later)
def test_a_stream_is_written_in_place_never_replaced(tmp_path):
    # os.replace over /dev/null (vlseq-predict --metrics /dev/null --overwrite) made it a regular file
    import threading

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()
    files.write_atomically(fifo, lambda fh: fh.write("streamed"), text=True)
    reader.join(30)
    assert got == [b"streamed"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert files.is_stream("/dev/null") and files.is_stream("/dev/stdout") and not files.is_stream(tmp_path)
    # by what it is, not where: /dev/shm holds ordinary files, which keep their atomic replace
    if os.path.isdir("/dev/shm"):
        shm = f"/dev/shm/vlseq-test-{os.getpid()}"
        try:
            with open(shm, "w") as fh:
                fh.write("old")
            assert not files.is_stream(shm)
            with pytest.raises(OSError):
                files.write_atomically(shm, lambda fh: (fh.write("to"), (_ for _ in ()).throw(OSError(28, "full"))),
                                       text=True)
            assert open(shm).read() == "old"
        finally:
            os.unlink(shm)


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_a_plot_titled_with_a_non_utf8_file_name_is_written(tmp_path):
    # a data file named with bytes that are not UTF-8 reaches the title as surrogate escapes
    from vlseq_ext.cli.reporting import write_plot

    history = {"step": [1, 2], "loss": [1.0, 0.5], "val_step": [], "val_loss": [], "val_accuracy": []}
    write_plot(tmp_path / "loss.png", history, "vlseq-train: caf\udce9.npz")
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
