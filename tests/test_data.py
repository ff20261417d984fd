"""vlseq_ext.data: ragged .npz round trip and validation (after the cast to float32, class labels,
prediction-only files), synthetic data, .ts loading through aeon, and the resumable length-bucketed
samplers."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from vlseq_ext import data
from vlseq_ext.data import DataError
from vlseq_ext import samplers
from vlseq_ext.samplers import LengthBucketSampler

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
    ("nan", "sample 3 has a non-finite value (NaN or inf) at step 0; pass --drop-nonfinite"),
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
    assert str(path) in msg and at in msg and "overflows float32" in msg and "--drop-nonfinite" in msg, msg
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
