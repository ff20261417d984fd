"""A checkpoint with one bit flipped on disk (or in transfer) is refused, not loaded: torch.load never
checks the CRC-32s of the zip archive torch.save writes, so read_checkpoint does, and every reader
(read_checkpoint, load_model, vlseq-predict, vlseq-train --resume) stops with one line naming the
file and the damaged member. Undamaged checkpoints, and archives written without CRCs, still load."""
import struct
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from vlseq_ext import checkpoint, cli, data
from vlseq_ext.checkpoint import CheckpointError, load_model, read_checkpoint
from vlseq_ext.cli import predict

TRAIN = ["--devices", "cpu", "--hidden", "8", "--quiet", "--val-fraction", "0", "--max-steps", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny vlseq-train run (5 features, 2 outputs) and data to predict on."""
    root = tmp_path_factory.mktemp("integrity")
    rng = np.random.default_rng(0)
    seqs = [rng.standard_normal((int(rng.integers(2, 9)), 5)).astype(np.float32) for _ in range(16)]
    data.save_ragged(root / "train.npz", seqs, np.stack([[s.mean(), s[-1, 0]] for s in seqs]))
    data.save_ragged(root / "new.npz", seqs[:5])
    assert cli.main([*TRAIN, "--data", str(root / "train.npz"), "--checkpoint-dir", str(root / "run")]) == 0
    return root


def data_start(raw: bytes, info: zipfile.ZipInfo) -> int:
    """Where a member's bytes begin: after its local header, whose extra field (torch pads it to
    align tensors) may differ from the central directory's."""
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len


def flip_bit(src: Path, dst: Path, member=None) -> str:
    """Copy `src` to `dst` with one bit flipped in the middle of a member's data (by default the
    largest tensor, i.e. model or optimizer weights); returns the member's name."""
    raw = bytearray(src.read_bytes())
    infos = zipfile.ZipFile(src).infolist()
    if member is None:
        info = max((i for i in infos if i.filename.split("/")[-2:-1] == ["data"]), key=lambda i: i.file_size)
    else:
        info = next(i for i in infos if i.filename == member)
    assert info.compress_type == zipfile.ZIP_STORED and info.file_size > 0
    raw[data_start(bytes(raw), info) + info.file_size // 2] ^= 0x04
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(bytes(raw))
    assert zipfile.ZipFile(dst).testzip() == info.filename  # really damaged, and only there
    return info.filename


def damaged_message(path: Path, member: str) -> str:
    return f"{path}: the checkpoint is damaged: member '{member}' fails its CRC check"


def test_undamaged_checkpoint_still_loads(trained, tmp_path, capsys):
    ckpt = read_checkpoint(trained / "run")
    assert set(checkpoint.RESUME_KEYS) <= set(ckpt)
    model = load_model(trained / "run")
    assert not model.training
    assert torch.equal(model.state_dict()["fc.weight"], ckpt["model"]["fc.weight"])
    rc = predict.main(["--checkpoint", str(trained / "run"), "--data", str(trained / "new.npz"),
                       "--out", str(tmp_path / "p.npy"), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    assert np.load(tmp_path / "p.npy").shape == (5, 2)


def test_flipped_bit_in_weights_is_refused_by_read_checkpoint_and_load_model(trained, tmp_path):
    bad = tmp_path / "flipped.pt"
    member = flip_bit(trained / "run" / "last.pt", bad)
    before = bad.read_bytes()
    for load in (read_checkpoint, lambda p: read_checkpoint(p, need=checkpoint.MODEL_KEYS), load_model):
        with pytest.raises(CheckpointError) as info:
            load(bad)
        msg = str(info.value)
        assert msg.startswith(damaged_message(bad, member)) and "use an earlier copy" in msg, msg
        assert "\n" not in msg
    assert bad.read_bytes() == before  # reading never repairs or rewrites


def test_every_tensor_member_is_checked(trained, tmp_path):
    """Not just the largest: a flip in any tensor (weights, optimizer moments, RNG state) or in the
    pickle that describes them is caught."""
    good = trained / "run" / "last.pt"
    members = [i.filename for i in zipfile.ZipFile(good).infolist()
               if i.file_size and (i.filename.split("/")[-2:-1] == ["data"] or i.filename.endswith("data.pkl"))]
    assert len(members) > 5
    for k, member in enumerate(members):
        bad = tmp_path / f"flip{k}.pt"
        flip_bit(good, bad, member)
        with pytest.raises(CheckpointError, match="fails its CRC check") as info:
            read_checkpoint(bad)
        assert f"member '{member}'" in str(info.value)


def test_flipped_bit_in_a_saved_checkpoint(trained, tmp_path):
    """save_checkpoint's own output (a run's state written again), read back through read_checkpoint."""
    state = checkpoint.load_checkpoint(trained / "run")
    path = checkpoint.save_checkpoint(state, tmp_path / "a" / "last.pt")
    assert torch.equal(read_checkpoint(path)["model"]["fc.weight"], state["model"]["fc.weight"])
    member = flip_bit(path, tmp_path / "b" / "last.pt")
    with pytest.raises(CheckpointError, match=f"member '{member}' fails its CRC check"):
        read_checkpoint(tmp_path / "b")


def test_vlseq_predict_refuses_a_damaged_checkpoint(trained, tmp_path, capsys):
    bad = tmp_path / "flipped.pt"
    member = flip_bit(trained / "run" / "last.pt", bad)
    rc = predict.main(["--checkpoint", str(bad), "--data", str(trained / "new.npz"), "--out", str(tmp_path / "p.npy")])
    _, err = capsys.readouterr()
    assert rc == 2 and err.startswith("vlseq-predict: error: ") and err.count("\n") == 1, err
    assert damaged_message(bad, member) in err and "Traceback" not in err
    assert not (tmp_path / "p.npy").exists()


def test_resume_refuses_a_damaged_checkpoint(trained, tmp_path, capsys):
    bad = tmp_path / "run" / "last.pt"
    member = flip_bit(trained / "run" / "last.pt", bad)
    before = bad.read_bytes()
    rc = cli.main(["--resume", str(bad.parent), "--max-steps", "4"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--resume: {damaged_message(bad, member)}" in err
    assert bad.read_bytes() == before and sorted(p.name for p in bad.parent.iterdir()) == ["last.pt"]


@pytest.mark.skipif(not hasattr(torch.serialization, "set_crc32_options"), reason="torch writes CRCs always")
def test_archive_written_without_crcs_still_loads(trained, tmp_path):
    """torch.serialization.set_crc32_options(False) stores 0 for every CRC: nothing to check, not damage."""
    state = checkpoint.load_checkpoint(trained / "run")
    torch.serialization.set_crc32_options(False)
    try:
        path = checkpoint.save_checkpoint(state, tmp_path / "last.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    assert all(i.CRC == 0 for i in zipfile.ZipFile(path).infolist())
    assert torch.equal(read_checkpoint(path)["model"]["fc.weight"], state["model"]["fc.weight"])


def test_truncated_checkpoint_keeps_its_message(trained, tmp_path):
    raw = (trained / "run" / "last.pt").read_bytes()
    path = tmp_path / "half.pt"
    path.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(CheckpointError, match=f"{path}: truncated or corrupt \\({len(raw) // 2} bytes\\): "):
        read_checkpoint(path)


@pytest.mark.parametrize("start", [b"", b"\x80\x54", b"\x80\x02\x8a\x0a", b"\x80\x54" + checkpoint._LEGACY_MAGIC],
                         ids=["random", "pickle-protocol-84", "pickle-long1", "legacy-magic-unknown-protocol"])
def test_junk_is_one_error_and_no_warning(rand, tmp_path, start):
    """Bytes that are no checkpoint, whatever they start with (a pickle's first opcode, a protocol torch
    does not know, even torch's legacy magic number): one CheckpointError, and none of torch's warnings
    about the file beside it (a second line of vlseq-predict's output)."""
    path = tmp_path / "junk.pt"
    path.write_bytes(start + rand.py.randbytes(3000))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match=f"{path}: (truncated or corrupt|not a vlseq checkpoint)"):
            read_checkpoint(path)
    assert not caught, [str(w.message) for w in caught]


def test_a_checkpoint_in_torchs_legacy_format_still_loads(trained, tmp_path):
    """torch.save's legacy (non-zip) format with its default pickle protocol passes the header check
    (torch.load(weights_only=True) itself reads no other protocol of that format)."""
    state = torch.load(trained / "run" / "last.pt", weights_only=True)
    path = tmp_path / "legacy.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False)
    assert torch.equal(read_checkpoint(path)["model"]["fc.weight"], state["model"]["fc.weight"])


def _central_entry(raw: bytes, member: str) -> int:
    """Offset of `member`'s entry in the zip's central directory."""
    name = member.encode()
    pos = raw.find(b"PK\x01\x02")
    while pos >= 0:
        n = struct.unpack("<H", raw[pos + 28:pos + 30])[0]
        if raw[pos + 46:pos + 46 + n] == name:
            return pos
        pos = raw.find(b"PK\x01\x02", pos + 4)
    raise AssertionError(member)


@pytest.mark.parametrize("damage,match", [
    # the MS-DOS "directory" bit of a tensor's attributes: zipfile's CRCs pass, torch's reader returned garbage
    (lambda raw, at: raw.__setitem__(at + 38, raw[at + 38] ^ 0x10), "is marked as a directory"),
    # "version needed to extract": zipfile raised NotImplementedError (a traceback)
    (lambda raw, at: raw.__setitem__(at + 6, raw[at + 6] ^ 0xFF), "truncated or corrupt"),
])
def test_a_damaged_zip_directory_entry_is_refused(trained, tmp_path, damage, match):
    src = trained / "run" / "last.pt"
    member = max((i for i in zipfile.ZipFile(src).infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(src.read_bytes())
    damage(raw, _central_entry(bytes(raw), member.filename))
    (tmp_path / "bad.pt").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=match):
        load_model(tmp_path / "bad.pt")


OLD = Path(__file__).parent / "data" / "checkpoint-0.2.0"


def test_a_checkpoint_of_version_0_2_0_resumes_where_it_stopped(tmp_path, capsys, monkeypatch):
    """tests/data/checkpoint-0.2.0: step 3 of `vlseq-train --devices cpu:2 --hidden 4 --synthetic-samples 24
    --val-fraction 0.25 --deterministic`, written by vlseq_ext 0.2.0 (commit 1ddcab8), and the metrics of
    the same run straight to step 12 (straight.jsonl, the same version). Resumed by this version, it
    repeats steps 4-12, across the epoch end: the same steps, epochs and sample counts, and the losses and
    gradient norms within float32 rounding of the recorded run. Not bit for bit: the recorded run's CPU
    rounds Adam's update differently from some others (an AMD EPYC with AVX-512 makes step 3's
    weights one ulp apart from the checkpoint's, with the same optimizer state), so only a resume on the
    machine that ran the first steps repeats them exactly (test_cli, test_loop). load_model reads it too."""
    import json
    import shutil

    run_dir = tmp_path / "oldrun"  # the folder the old run used, relative to where it ran
    run_dir.mkdir()
    shutil.copy(OLD / "last.pt", run_dir / "last.pt")
    monkeypatch.chdir(tmp_path)
    assert load_model(run_dir).recurrent.hidden_size == 4
    rc = cli.main(["--resume", "oldrun", "--max-steps", "12"])
    err = capsys.readouterr().err
    assert rc == 0 and "resuming at step 3 (epoch 1, batch 3)" in err, err
    keys = {"step": ("step", "epoch", "loss", "grad_norm", "samples"), "epoch": ("step", "train_loss", "val_loss"),
            "val": ("step", "val_loss")}

    def metrics(path):
        records = [json.loads(line) for line in Path(path).read_text().splitlines()]
        return [(r["type"], [r[k] for k in keys[r["type"]]]) for r in records if r["step"] > 3]

    got, recorded = metrics(run_dir / "metrics.jsonl"), metrics(OLD / "straight.jsonl")
    assert [(t, [v for v in vals if isinstance(v, int)]) for t, vals in got] == \
        [(t, [v for v in vals if isinstance(v, int)]) for t, vals in recorded]
    for (_, vals), (_, want) in zip(got, recorded):
        assert vals == pytest.approx(want, rel=1e-6, abs=0.0)
    saved = read_checkpoint(run_dir)
    assert saved["run"]["step"] == 12 and saved["config"]["run_id"] == torch.load(
        OLD / "last.pt", weights_only=True)["config"]["run_id"]  # still the same run


def _set(*path_and_value):
    """A damage: the checkpoint's entry at path (keys) set to value."""
    *path, key, value = path_and_value

    def damage(ckpt):
        entry = ckpt
        for k in path:
            entry = entry[k]
        entry[key] = value
    return damage


# (damage, what it breaks: "model" (every reader), "resume" (read_checkpoint for a resume) or "train" (what
# vlseq-train alone reads: its options, its history), the message's words)
FIELD_DAMAGE = {
    "huge_hidden": (_set("config", "hidden", 2 ** 40), "model", "config describes a model of 4,835,"),
    "huge_layers": (_set("config", "layers", 10 ** 15), "model", "vlseq-train builds at most 2,147,483,648"),
    "hidden_as_text": (_set("config", "hidden", "8"), "model", "config hidden is a str, not an integer"),
    "no_features": (_set("data", "num_features", 0), "model", "data num_features is 0, outside [1, "),
    "unknown_task": (_set("data", "task", "ranking"), "model", "data task is 'ranking'"),
    "moment_shape": (_set("optimizer", "state", 0, "exp_avg", torch.zeros(3)), "resume",
                     "optimizer state 0 exp_avg has the shape (3,), the run's is (32, 5)"),
    "adam_step_nan": (_set("optimizer", "state", 0, "step", torch.tensor(float("nan"))), "resume",
                      "optimizer state 0 step is nan"),
    "adam_unknown_key": (_set("optimizer", "state", 0, "momentum", torch.zeros(1)), "resume",
                         "optimizer state 0 has the unknown key 'momentum'"),
    "adam_params": (_set("optimizer", "param_groups", 0, "params", [0, 1]), "resume",
                    "param_groups[0] params is not the model's 6 parameters"),
    "adam_eps_huge": (_set("optimizer", "param_groups", 0, "eps", 2 ** 70), "resume",
                      "optimizer eps is 1180591620717411303424, but vlseq-train's Adam has 1e-08"),
    "adam_amsgrad": (_set("optimizer", "param_groups", 0, "amsgrad", torch.zeros(2)), "resume",
                     "optimizer amsgrad is tensor"),
    "adam_state_missing": (lambda c: c["optimizer"]["state"].pop(3), "resume",
                           "optimizer state covers 5 of the model's 6 parameters"),
    "rng_cuda": (_set("rng", "cuda", torch.zeros(2, 3)), "resume", "rng cuda is not a list"),
    "rng_torch": (_set("rng", "torch", torch.zeros(7, dtype=torch.uint8)), "resume", "rng torch has the shape (7,)"),
    "rng_python": (_set("rng", "python", "state", torch.full((625,), 2 ** 40)), "resume",
                   "rng python state holds values outside"),
    "trainer_step": (_set("trainer", "global_step", -1), "resume", "trainer global_step is -1"),
    "trainer_window": (_set("trainer", "micro_step", 2), "resume", "trainer micro_step is 2"),
    "sampler_position": (_set("sampler", "position", 10 ** 9), "resume", "sampler position is 1000000000"),
    "loop_step": (_set("loop", "step", "two"), "resume", "loop step is a str"),
    "run_history": (_set("run", "history", "loss", ["low"]), "train", "run history loss holds a str"),
    "config_lr": (_set("config", "lr", "fast"), "train", "its saved run: --lr must be a number, got 'fast'"),
    "config_reduction": (_set("config", "reduction", "median"), "train", "--reduction must be one of mean, sum"),
    "config_clip": (_set("config", "clip_grad", 2 ** 70), "train", "--clip-grad must be a number or nothing, got 1180"),
}


@pytest.mark.parametrize("case", sorted(FIELD_DAMAGE))
def test_every_checkpoint_field_is_checked_before_anything_is_built(trained, tmp_path, capsys, case):
    """A checkpoint whose zip is whole but one field is not what the run builds (a size that would
    overflow an allocation, a moment of another shape, an RNG state of another generator...): every
    reader that needs the field refuses it in one line naming it, and a resume creates and trains
    nothing (before, some failed only at the first step, after the metrics were written)."""
    damage, breaks, words = FIELD_DAMAGE[case]
    ckpt = torch.load(trained / "run" / "last.pt", weights_only=True)
    damage(ckpt)
    bad = tmp_path / "run" / "last.pt"
    bad.parent.mkdir()
    torch.save(ckpt, bad)
    readers = {"model": [read_checkpoint, lambda p: read_checkpoint(p, need=checkpoint.MODEL_KEYS), load_model],
               "resume": [read_checkpoint], "train": []}[breaks]
    for load in readers:
        with pytest.raises(CheckpointError) as info:
            load(bad)
        assert words in str(info.value) and "\n" not in str(info.value), info.value
    rc = predict.main(["--checkpoint", str(bad), "--data", str(trained / "new.npz"), "--out", str(tmp_path / "p.npy"),
                       "--quiet"])
    _, err = capsys.readouterr()
    if breaks == "model":
        assert rc == 2 and words in err and err.count("\n") == 1 and not (tmp_path / "p.npy").exists(), err
    else:
        assert rc == 0, err
    before = bad.read_bytes()
    rc = cli.main(["--resume", str(bad.parent), "--max-steps", "4", "--data", str(trained / "train.npz")])
    _, err = capsys.readouterr()
    assert rc == 2 and words in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert bad.read_bytes() == before and sorted(p.name for p in bad.parent.iterdir()) == ["last.pt"]
