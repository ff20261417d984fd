"""vlseq_ext.data: ragged .npz round trip and validation (after the cast to float32, class labels,
prediction-only files), synthetic data, .ts loading through aeon, and the resumable length-bucketed
samplers."""
import importlib.util
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from vlseq_ext import data
from vlseq_ext.data import DataError
from vlseq_ext.data import samplers
from vlseq_ext.data.samplers import LengthBucketSampler

HAS_AEON = importlib.util.find_spec("aeon") is not None
needs_aeon = pytest.mark.skipif(not HAS_AEON, reason="aeon is not installed (pip install 'vlseq_ext[ts]')")


def ragged(n=5, d=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((int(rng.integers(1, 9)), d)).astype(np.float32) for _ in range(n)]


def write_npz(path, **arrays):
    np.savez(path, **arrays)
    return path


def test_save_load_roundtrip_regression(tmp_path):
    seqs, y = ragged(), np.arange(5, dtype=np.float32)
    data.save_ragged(tmp_path / "r.npz", seqs, y)
    ds = data.load_ragged(tmp_path / "r.npz")
    assert (len(ds), ds.num_features, ds.task, ds.output_dim) == (5, 3, "regression", 1)
    assert ds.lengths.tolist() == [len(s) for s in seqs]
    for i, s in enumerate(seqs):
        x, t = ds[i]
        assert torch.equal(x, torch.from_numpy(s)) and t.dtype == torch.float32 and t.shape == (1,) and t.item() == i


def test_save_load_roundtrip_classification_from_tensors(tmp_path):
    seqs = [torch.from_numpy(s) for s in ragged()]
    data.save_ragged(tmp_path / "c.npz", seqs, torch.tensor([0, 2, 1, 2, 0]))
    ds = data.load_ragged(tmp_path / "c.npz")
    assert (ds.task, ds.output_dim) == ("classification", 3)
    x, t = ds[1]
    assert torch.equal(x, seqs[1]) and t.dtype == torch.int64 and t.dim() == 0 and t.item() == 2
    assert data.load_ragged(tmp_path / "c.npz", task="regression").task == "regression"


def good_arrays():
    seqs = ragged()
    lengths = [len(s) for s in seqs]
    return dict(values=np.concatenate(seqs), offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                targets=np.zeros(5, np.float32))


def corrupt(arrays):
    arrays["values"] = arrays["values"].copy()
    arrays["values"][arrays["offsets"][3] + 0, 1] = np.nan  # sample 3, step 0
    return arrays


@pytest.mark.parametrize("case, expect", [
    ("values_1d", "'values' must have shape (total_steps, features)"),
    ("targets_short", "'targets' must have one row per sample (5)"),
    ("offsets_not_monotone", "'offsets' are not monotone: offsets[2]="),
    ("offsets_bad_end", "'offsets' must start at 0 and end at total_steps"),
    ("offsets_float", "'offsets' must be a 1-D integer array"),
    ("zero_length", "sample 1 has length 0"),
    ("missing_array", "missing array(s) targets"),
    ("nan", "sample 3 has a non-finite value (NaN or inf) at step 0; pass drop_nonfinite=True"),
    ("nan_target", "sample 2 has a non-finite value (NaN or inf) in its target"),
])
def test_npz_validation_errors(tmp_path, case, expect):
    a = good_arrays()
    if case == "values_1d":
        a["values"] = a["values"][:, 0]
    elif case == "targets_short":
        a["targets"] = a["targets"][:4]
    elif case == "offsets_not_monotone":
        a["offsets"][2] = a["offsets"][3] + 1
    elif case == "offsets_bad_end":
        a["offsets"][-1] -= 1
    elif case == "offsets_float":
        a["offsets"] = a["offsets"].astype(np.float64)
    elif case == "zero_length":
        a["offsets"][1] = a["offsets"][2]
    elif case == "missing_array":
        del a["targets"]
    elif case == "nan":
        a = corrupt(a)
    elif case == "nan_target":
        a["targets"][2] = np.inf
    path = write_npz(tmp_path / f"{case}.npz", **a)
    with pytest.raises(DataError) as err:
        data.load_ragged(path)
    msg = str(err.value)
    assert expect in msg and str(path) in msg and "\n" not in msg


def test_drop_nonfinite_skips_and_counts(tmp_path):
    a = corrupt(good_arrays())
    a["targets"] = np.arange(5, dtype=np.float32)
    ds = data.load_ragged(write_npz(tmp_path / "nan.npz", **a), drop_nonfinite=True)
    assert ds.dropped == 1 and len(ds) == 4
    assert [t.item() for _, t in (ds[i] for i in range(4))] == [0, 1, 2, 4]
    assert torch.isfinite(ds.values).all()
    assert torch.equal(ds[3][0], torch.from_numpy(a["values"][a["offsets"][4]:a["offsets"][5]]))


@pytest.mark.parametrize("kind", ["missing", "garbage", "truncated", "npy"])
def test_unreadable_files(tmp_path, kind):
    path = tmp_path / "d.npz"
    if kind == "garbage":
        path.write_bytes(b"definitely not a zip archive" * 10)
    elif kind == "truncated":
        write_npz(path, **good_arrays())
        path.write_bytes(path.read_bytes()[:200])
    elif kind == "npy":
        np.save(tmp_path / "d.npy", np.zeros(3))
        (tmp_path / "d.npy").rename(path)
    with pytest.raises(DataError) as err:
        data.load_ragged(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert {"missing": "no such file", "garbage": "not an .npz", "truncated": "corrupt or truncated",
            "npy": "not an .npz"}[kind] in str(err.value)


def test_synthetic_is_deterministic_and_learnable_shape():
    a, b, c = data.synthetic(40, seed=3), data.synthetic(40, seed=3), data.synthetic(40, seed=4)
    assert torch.equal(a.values, b.values) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.targets, c.targets)
    assert a.num_features == 36 and a.task == "regression" and a.output_dim == 1
    assert a.lengths.min() >= 50 and a.lengths.max() <= 500
    # the target follows the sequence level: far from noise
    means = torch.stack([a[i][0].mean(0) for i in range(len(a))])
    fit = torch.linalg.lstsq(means, a.targets).solution
    resid = (means @ fit - a.targets).var() / a.targets.var()
    assert resid < 0.5


def test_split_is_deterministic_and_disjoint():
    ds = data.synthetic(50, seed=0)
    tr, va = data.split(ds, 0.2, seed=1)
    tr2, va2 = data.split(ds, 0.2, seed=1)
    assert (len(tr), len(va)) == (40, 10)
    assert np.array_equal(va.starts, va2.starts)
    assert not set(tr.starts.tolist()) & set(va.starts.tolist())
    assert data.split(ds, 0.0)[1] is None


def test_data_errors_name_the_parameter_they_are_about(tmp_path):
    """The data layer's advice speaks of its own parameters; a command replaces it (with_hint)."""
    with pytest.raises(DataError) as err:
        data.split(data.synthetic(3), 0.9)
    assert err.value.option == "val_fraction" and str(err.value).endswith("; give a smaller val_fraction")
    assert err.value.with_hint({"val_fraction": "lower --v"}) == f"{err.value.problem}; lower --v"
    with pytest.raises(DataError) as err:
        data.open_dataset("japanese_vowels", task="regression")
    assert err.value.option == "task" and "--" not in str(err.value)
    with pytest.raises(DataError) as err:
        data.open_dataset(str(tmp_path / "nope"))
    assert err.value.option == "data" and "--" not in str(err.value)
    assert err.value.with_hint({}) == str(err.value)  # no advice of the caller's: the library's stays


def test_sequence_lengths_of_a_generic_dataset():
    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.zeros(i + 2, 4), torch.zeros(1)

    assert data.sequence_lengths(Plain()).tolist() == [2, 3, 4]


# ------------------------------------------------------------------------------------------------
# sampler


def test_sampler_covers_every_sample_longest_first_similar_lengths():
    lengths = np.random.default_rng(0).integers(1, 1000, 1003)
    s = LengthBucketSampler(lengths, batch_size=8, seed=0, bucket_batches=20)
    batches = list(s)
    assert len(batches) == len(s) == 126
    assert sorted(i for b in batches for i in b) == list(range(1003))
    assert lengths.max() in lengths[batches[0]]
    spread = np.mean([np.ptp(lengths[b]) for b in batches if len(b) == 8])
    assert spread < 0.1 * np.ptp(lengths)  # sortish buckets: batches of similar lengths
    starts = [int(lengths[b].max()) for b in batches[1:]]
    assert starts != sorted(starts, reverse=True)  # ...but a shuffled order
    assert list(s) == []  # the epoch is used up until set_epoch


def test_sampler_epochs_and_seed_are_deterministic():
    lengths = np.arange(1, 101)
    a = LengthBucketSampler(lengths, 4, seed=1, bucket_batches=5)
    b = LengthBucketSampler(lengths, 4, seed=1, bucket_batches=5)
    assert a.batches(0) == b.batches(0) and a.batches(0) != a.batches(1)
    assert LengthBucketSampler(lengths, 4, seed=2).batches(0) != a.batches(0)


def test_sampler_resumes_at_the_next_batch():
    lengths = np.random.default_rng(1).integers(1, 50, 97)
    full = LengthBucketSampler(lengths, 5, seed=7, bucket_batches=3)
    full.set_epoch(2)
    expected = list(full)
    s = LengthBucketSampler(lengths, 5, seed=7, bucket_batches=3)
    s.set_epoch(2)
    it = iter(s)
    head = [next(it) for _ in range(6)]
    state = s.state_dict()
    assert state["epoch"] == 2 and state["position"] == 6
    resumed = LengthBucketSampler(lengths, 5, seed=7, bucket_batches=3)
    resumed.load_state_dict(state)
    assert head + list(resumed) == expected
    with pytest.raises(ValueError, match="batch_size"):
        LengthBucketSampler(lengths, 4, seed=7).load_state_dict(state)


def test_sampler_stops_iterating_when_the_epoch_changes():
    s = LengthBucketSampler(np.arange(1, 21), 2)
    seen = []
    for b in s:
        seen.append(b)
        if len(seen) == 3:
            s.set_epoch(1)
    assert len(seen) == 3 and s.position == 0 and s.epoch == 1


# ------------------------------------------------------------------------------------------------
# .ts through aeon


@needs_aeon
def test_japanese_vowels_ts_unequal_length():
    train, test = data.japanese_vowels()
    assert (len(train), len(test)) == (270, 370)
    assert train.num_features == 12 and train.task == "classification" and train.output_dim == 9
    assert train.class_names == [str(i) for i in range(1, 10)]
    lengths = np.concatenate([train.lengths, test.lengths])
    assert lengths.min() == 7 and lengths.max() == 29
    x, y = train[0]
    assert x.shape == (20, 12) and y.item() == 0  # first series: 20 steps, speaker "1"
    assert abs(x[0, 0].item() - 1.860936) < 1e-6  # (time, channel) layout, not aeon's (channel, time)


@needs_aeon
def test_ts_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        data.load_ts(tmp_path / "missing.ts")
    bad = tmp_path / "bad.ts"
    bad.write_text("@problemName x\n@classLabel true a b\n@data\n1,2,3:a\nnot,a,number:b\n")
    with pytest.raises(DataError, match="bad.ts"):
        data.load_ts(bad)
    nan = tmp_path / "nan.ts"
    nan.write_text("@problemName x\n@univariate true\n@equalLength false\n@classLabel true a b\n@data\n"
                   "1,2,3:a\n4,?,6,7:b\n1,2:b\n")
    with pytest.raises(DataError, match="sample 1 has a non-finite value"):
        data.load_ts(nan)
    ds = data.load_ts(nan, drop_nonfinite=True)
    assert ds.dropped == 1 and ds.lengths.tolist() == [3, 2] and ds.output_dim == 2


# ------------------------------------------------------------------------------------------------
# checked after the cast to float32; class labels; targets; what --data points at


@pytest.mark.parametrize("where", ["values", "targets"])
def test_float64_beyond_float32_is_caught_after_the_cast(tmp_path, where):
    a = good_arrays()
    a["values"], a["targets"] = a["values"].astype(np.float64), a["targets"].astype(np.float64)
    if where == "values":
        a["values"][a["offsets"][2] + 1, 2] = -1e39  # sample 2, step 1: finite in float64, -inf in float32
    else:
        a["targets"][4] = 5e38
    path = write_npz(tmp_path / "f64.npz", **a)
    with pytest.raises(DataError) as err:
        data.load_ragged(path)
    msg = str(err.value)
    at = "sample 2 has the value -1e+39 at step 1" if where == "values" else "sample 4 has the value 5e+38 in its target"
    assert str(path) in msg and at in msg and "overflows float32" in msg and "drop_nonfinite=True" in msg, msg
    # a command puts its own advice in place of the library's
    assert err.value.option == "drop_nonfinite" and "drop_nonfinite" not in err.value.with_hint({"drop_nonfinite": "X"})
    assert err.value.with_hint({"drop_nonfinite": "X"}).endswith("; rescale the data; X")
    ds = data.load_ragged(path, drop_nonfinite=True)
    assert ds.dropped == 1 and len(ds) == 4 and torch.isfinite(ds.values).all() and torch.isfinite(ds.targets).all()
    b = good_arrays()
    b["values"], b["targets"] = b["values"].astype(np.float64), b["targets"].astype(np.float64)
    b["values"][0, 0], b["targets"][1] = 3e38, -3e38  # large but representable in float32: fine
    ok = data.load_ragged(write_npz(tmp_path / "ok.npz", **b))
    assert ok.dropped == 0 and ok.values.dtype == torch.float32 and ok.values[0, 0].item() == pytest.approx(3e38)


def test_class_labels_far_beyond_the_number_of_classes_are_refused(tmp_path):
    a = good_arrays()
    for labels, expect in ((np.array([0, 1, 1_000_000_000, 1, 0]), "sample 2 has class label 1000000000, far beyond "
                                                                    "the 3 distinct labels"),
                           (np.array([0, 1, 2, 3, 150]), "sample 4 has class label 150, far beyond the 5"),
                           (np.array([0.0, 1.0, 1e39, 1.0, 0.0]), "sample 2 has class label 1e+39")):
        path = write_npz(tmp_path / "ids.npz", **{**a, "targets": labels})
        with pytest.raises(DataError, match="remap the labels to 0..") as err:
            data.load_ragged(path, task="classification")
        assert expect in str(err.value), err.value
    # many classes, used densely, are fine: 300 labels among 300 classes
    seqs = [np.ones((2, 3), np.float32)] * 300
    data.save_ragged(tmp_path / "many.npz", seqs, np.arange(300))
    assert data.load_ragged(tmp_path / "many.npz").output_dim == 300


def test_targets_without_values_per_sample(tmp_path):
    a = good_arrays()
    path = write_npz(tmp_path / "t0.npz", **{**a, "targets": np.zeros((5, 0), np.float32)})
    with pytest.raises(DataError, match=r"'targets' has shape \(5, 0\): no target values per sample"):
        data.load_ragged(path)


def test_prediction_files_may_lack_targets(tmp_path):
    seqs = ragged()
    data.save_ragged(tmp_path / "x.npz", seqs)  # no targets
    with pytest.raises(DataError, match="missing array\\(s\\) targets"):
        data.load_ragged(tmp_path / "x.npz")  # training needs them
    ds = data.load_ragged(tmp_path / "x.npz", task="classification", targets_required=False, num_classes=4)
    assert not ds.has_targets and (ds.task, ds.output_dim, len(ds)) == ("classification", 4, 5)
    assert torch.equal(ds[2][0], torch.from_numpy(seqs[2]))
    with pytest.raises(DataError, match="no task to predict"):
        data.load_ragged(tmp_path / "x.npz", targets_required=False)
    data.save_ragged(tmp_path / "y.npz", seqs, np.array([0, 1, 5, 1, 0]))
    with pytest.raises(DataError, match="sample 2 has class label 5, but the model has 4 classes"):
        data.load_ragged(tmp_path / "y.npz", task="classification", targets_required=False, num_classes=4)
    assert data.load_ragged(tmp_path / "y.npz", targets_required=False).has_targets


def test_data_paths_that_are_not_files(tmp_path):
    with pytest.raises(DataError, match="is a directory, not a data file"):
        data.open_dataset(str(tmp_path))
    (tmp_path / "d.npz").mkdir()
    with pytest.raises(DataError, match="d.npz: is a directory"):
        data.open_dataset(str(tmp_path / "d.npz"))
    if Path("/dev/null").exists():
        with pytest.raises(DataError, match="/dev/null: is not a regular file"):
            data.open_dataset("/dev/null")
    with pytest.raises(DataError, match="no such file"):
        data.open_dataset(str(tmp_path / "nope.npz"))


def test_distributed_sampler_lives_next_to_the_bucket_sampler():
    s = samplers.DistributedLengthSampler(np.arange(1, 21), 2, 2)
    assert isinstance(s, LengthBucketSampler) and s.batch_size == 4 and len(s) == 5


@needs_aeon
def test_ts_messages_speak_ts(tmp_path):
    headerless = tmp_path / "h.ts"
    headerless.write_text("1,2,3:a\n4,5,6:b\n")
    with pytest.raises(DataError) as err:
        data.load_ts(headerless)
    assert "no @data line" in str(err.value) and "offsets" not in str(err.value)
    empty = tmp_path / "e.ts"
    empty.write_text("@problemName x\n@univariate true\n@classLabel true a b\n@data\n")
    with pytest.raises(DataError, match="no series after the @data line"):
        data.load_ts(empty)
    unknown = tmp_path / "u.ts"
    unknown.write_text("@problemName x\n@univariate true\n@classLabel true a b\n@data\n1,2,3:a\n4,5,6:c\n")
    with pytest.raises(DataError) as err:
        data.load_ts(unknown)
    assert "sample 1 has label 'c', not one of @classLabel ['a', 'b']" in str(err.value) and "np.str_" not in str(err.value)
    # prediction: no labels at all, or labels mapped to the trained model's classes (in its order)
    bare = tmp_path / "b.ts"
    bare.write_text("@problemName x\n@univariate true\n@equalLength false\n@classLabel false\n@data\n1,2,3\n4,5,6,7\n")
    ds = data.load_ts(bare, task="regression", targets_required=False)
    assert not ds.has_targets and ds.lengths.tolist() == [3, 4]
    ds = data.load_ts(unknown, targets_required=False, class_names=["c", "a"])
    assert ds.targets.tolist() == [1, 0] and ds.output_dim == 2


@needs_aeon
def test_ts_prediction_without_class_names_maps_integer_labels_by_value(tmp_path):
    """A model trained on a .npz knows class indices 0..C-1, no names: a .ts file's labels "2", "0",
    "1" are those indices, whatever order its @classLabel lists them in (which maps them at training)."""
    path = tmp_path / "t.ts"
    path.write_text("@problemName x\n@univariate true\n@equalLength false\n@classLabel true 2 0 1\n@data\n"
                    "1,2,3:0\n4,5:1\n6,7:2\n8,9:0\n")
    ds = data.load_ts(path, task="classification", targets_required=False)  # as vlseq-predict calls it
    assert ds.targets.tolist() == [0, 1, 2, 0] and ds.output_dim == 3 and ds.class_names is None
    assert data.load_ts(path, task="classification", targets_required=False, num_classes=5).output_dim == 5
    with pytest.raises(DataError, match="sample 2 has class label 2, but the model has 2 classes"):
        data.load_ts(path, task="classification", targets_required=False, num_classes=2)
    train = data.load_ts(path)  # training: the header order defines the classes (and their names)
    assert train.targets.tolist() == [1, 2, 0, 1] and train.class_names == ["2", "0", "1"]
    named = tmp_path / "n.ts"
    named.write_text("@problemName x\n@univariate true\n@equalLength false\n@classLabel true a b\n@data\n1,2:a\n3:b\n")
    with pytest.raises(DataError) as err:
        data.load_ts(named, task="classification", targets_required=False)
    msg = str(err.value)
    assert "sample 0 has label 'a'" in msg and "trained without class names" in msg and "\n" not in msg, msg


@needs_aeon
@pytest.mark.parametrize("labels, expect", [("A a B", "labels 'A', 'a' differ only in case"),
                                            ("x y x", "lists the label 'x' more than once")])
def test_ts_class_labels_that_collide_are_refused(tmp_path, labels, expect):
    """aeon lowercases labels: A and a would be merged into one class, a repeated label adds a phantom one."""
    path = tmp_path / "c.ts"
    path.write_text(f"@problemName x\n@univariate true\n@equalLength false\n@classLabel true {labels}\n@data\n"
                    "1,2,3:x\n4,5:y\n")
    for kwargs in ({}, {"targets_required": False, "class_names": ["a", "b"]}):
        with pytest.raises(DataError) as err:
            data.load_ts(path, **kwargs)
        assert expect in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value), err.value


def test_subset_takes_boolean_masks_and_refuses_other_indices():
    ds = data.synthetic(20, num_features=2, min_length=1, max_length=9)
    mask = ds.lengths > 5
    sub = ds.subset(mask)
    assert 0 < len(sub) < len(ds) and sub.lengths.tolist() == ds.lengths[mask].tolist()
    assert torch.equal(sub.targets, ds.targets[torch.from_numpy(mask)])
    assert len(ds.subset(torch.from_numpy(mask))) == len(sub)
    assert ds.subset([3, 1]).lengths.tolist() == ds.lengths[[3, 1]].tolist() and len(ds.subset([])) == 0
    with pytest.raises(TypeError, match="must be integers or a boolean mask, got dtype float64"):
        ds.subset([1.7, 2.0])  # was truncated to 1
    with pytest.raises(ValueError, match=r"one entry per sample \(20\), got shape \(3,\)"):
        ds.subset(np.array([True, False, True]))  # was read as indices 1, 0, 1
    with pytest.raises(IndexError, match="subset index 20 is out of range for 20 samples"):
        ds.subset([0, 20])


@pytest.mark.parametrize("where", ["values", "targets", "offsets"])
def test_timedelta_arrays_are_refused(tmp_path, where):
    """numpy counts timedelta64 as an integer: NaT read as -9.2e18 and the unit was lost."""
    a = good_arrays()
    a[where] = a[where].astype(np.int64).astype("m8[ms]")
    path = write_npz(tmp_path / "td.npz", **a)
    with pytest.raises(DataError) as err:
        data.load_ragged(path)
    assert f"'{where}' must be" in str(err.value) and "timedelta64[ms]" in str(err.value), err.value


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_integers_beyond_2_24_warn_when_cast_to_float32(tmp_path, task):
    """float32 holds integers up to 2**24 exactly: beyond, the cast rounds them; a warning names it."""
    values = np.array([[1], [16777217], [3], [2 ** 53 + 1], [2 ** 63 - 1], [5]], np.int64)  # 2**63 - 1: rounds up
    targets = np.array([16777217, 1, 0]) if task == "regression" else np.array([2, 1, 0])
    path = write_npz(tmp_path / "big.npz", values=values, offsets=np.array([0, 2, 4, 6]), targets=targets)
    with pytest.warns(UserWarning) as rec:
        ds = data.load_ragged(path, task=task)
    msgs = [str(w.message) for w in rec]
    assert (f"{path}: 'values': 3 integer values change when cast to float32 (the training dtype; largest change 1 "
            "at sample 0); scale or offset them first") in msgs, msgs
    if task == "regression":
        assert any("'targets': 1 integer value changes" in m and "at sample 0" in m for m in msgs), msgs
    else:
        assert ds.targets.tolist() == [2, 1, 0] and len(msgs) == 1  # class indices stay int64
    assert all("\n" not in m for m in msgs)
    ok = write_npz(tmp_path / "ok.npz", values=np.array([[16777216], [-16777216]]), offsets=np.array([0, 1, 2]),
                   targets=np.array([0.5, 1.5]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data.load_ragged(ok)


def test_save_ragged_refuses_what_the_loader_refuses(tmp_path):
    with pytest.raises(DataError, match="sample 1: 'values' must be numeric, got dtype complex128"):
        data.save_ragged(tmp_path / "c.npz", [np.ones((2, 1)), np.array([[1 + 5j], [2 + 6j]])], [0.5, 1.5])
    big = np.ones((3, 2))
    big[2, 1] = -1e39  # finite in float64; was written as -inf
    with pytest.raises(DataError) as err:
        data.save_ragged(tmp_path / "o.npz", [np.ones((2, 2)), big], [0.5, 1.5])
    assert "sample 1 has the value -1e+39 at step 2, which overflows float32" in str(err.value), err.value
    with pytest.raises(DataError, match="'targets' must be numeric, got dtype complex128"):
        data.save_ragged(tmp_path / "t.npz", [np.ones((2, 1))], np.array([1j]))
    assert not list(tmp_path.iterdir())  # nothing written
    with pytest.warns(UserWarning, match="'values': 1 integer value changes when cast to float32"):
        data.save_ragged(tmp_path / "i.npz", [np.array([[1], [2]]), np.array([[2 ** 25 + 1]])], [0.5, 1.5])


def _zip_member_flags(path, local_offset, central_offset, value, mask=0xFFFF):
    """Patches a 2-byte field of the first member's local and central zip headers."""
    d = bytearray(path.read_bytes())
    for start, off in ((0, local_offset), (d.find(b"PK\x01\x02"), central_offset)):
        old = int.from_bytes(d[start + off:start + off + 2], "little")
        d[start + off:start + off + 2] = ((old & ~mask) | value).to_bytes(2, "little")
    path.write_bytes(bytes(d))


@pytest.mark.parametrize("kind, expect", [
    ("deflate", "corrupt or truncated"), ("encrypted", "is encrypted"), ("method", "compression method"),
    ("no_npy", "member 'values' is not a .npy array"), ("huge_header", "Unable to allocate")])
def test_damaged_npz_archives_give_one_line(tmp_path, kind, expect):
    import io
    import zipfile
    path = tmp_path / "d.npz"
    if kind == "deflate":  # a damaged deflate stream: zlib.error
        np.savez_compressed(path, **good_arrays())
        d = bytearray(path.read_bytes())
        name_len, extra_len = int.from_bytes(d[26:28], "little"), int.from_bytes(d[28:30], "little")
        d[30 + name_len + extra_len] = 0xFF
        path.write_bytes(bytes(d))
    elif kind == "encrypted":  # the flag of a password-protected member: RuntimeError
        write_npz(path, **good_arrays())
        _zip_member_flags(path, 6, 8, 1, mask=1)
    elif kind == "method":  # deflate64, which zipfile cannot read: NotImplementedError
        write_npz(path, **good_arrays())
        _zip_member_flags(path, 8, 10, 9)
    elif kind == "no_npy":  # np.load returns such a member as bytes
        with zipfile.ZipFile(path, "w") as z:
            for k in ("values", "offsets", "targets"):
                z.writestr(k, b"1,2,3")
    else:  # a header claiming 8 PB: MemoryError (numpy allocates before it reads)
        with zipfile.ZipFile(path, "w") as z:
            for k, v in good_arrays().items():
                b = io.BytesIO()
                if k == "values":
                    np.lib.format.write_array_header_1_0(b, {"descr": "<f8", "fortran_order": False,
                                                             "shape": (10 ** 15,)})
                else:
                    np.save(b, v)
                z.writestr(f"{k}.npy", b.getvalue())
    with pytest.raises(DataError) as err:
        data.load_ragged(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and expect in msg and "\n" not in msg, msg


@pytest.mark.parametrize("where", ["values", "targets"])
def test_float16_loads_without_numpy_warnings(tmp_path, where):
    a = good_arrays()
    a[where] = a[where].astype(np.float16)
    path = write_npz(tmp_path / "h.npz", **a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # was: RuntimeWarning: overflow encountered in cast
        ds = data.load_ragged(path)
    assert ds.values.dtype == torch.float32 and len(ds) == 5
