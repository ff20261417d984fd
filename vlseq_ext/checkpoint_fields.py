"""The fields of a vlseq-train checkpoint, checked one by one against what a run builds from them:
types, ranges, shapes, known keys. Every check raises FieldError naming the field; nothing here
allocates more than the checkpoint already holds, and sizes are computed in Python integers, so a
configuration of any size is refused rather than overflowing an allocation.

`check_model_fields` (configuration and data description: what builds the model) serves every
reader (read_checkpoint: vlseq-predict, load_model, --resume); `check_training_fields` the parts
only a resume restores (optimizer, trainer, sampler, loop, RNGs)."""
from __future__ import annotations

import math
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["FieldError", "MAX_PARAMETERS", "rnn_parameters", "check_model_fields", "check_training_fields",
           "check_int", "check_number", "check_dict"]

# The model may not have more parameters than this (8 GiB of float32 weights, and as much again for
# the gradients and twice for Adam's state, per device).
MAX_PARAMETERS = 2 ** 31
INT64_MAX = 2 ** 63 - 1
TASKS = ("regression", "classification")


class FieldError(ValueError):
    """A checkpoint field that a vlseq-train run cannot be built from; the message names it."""


def rnn_parameters(rnn: str, input_dim: int, hidden: int, layers: int, output_dim: int) -> int:
    """Parameters of SeqModel (unidirectional): gates x H x (in + H + 2) per layer, plus the head.
    Closed form in Python integers: any size is counted at once and exactly."""
    gates = 4 if rnn == "lstm" else 3
    first = gates * hidden * (input_dim + hidden + 2)
    return first + (layers - 1) * gates * hidden * (2 * hidden + 2) + hidden * output_dim + output_dim


# ------------------------------------------------------------------------------------------------
# one field


def check_int(v: Any, where: str, lo: int = 0, hi: int = INT64_MAX) -> int:
    if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point() and v.dtype != torch.bool:
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise FieldError(f"{where} is {_kind(v)}, not an integer")
    if not lo <= v <= hi:
        raise FieldError(f"{where} is {v}, outside [{lo}, {hi}]")
    return v


def check_number(v: Any, where: str, lo: float = -math.inf, hi: float = math.inf, optional: bool = False) -> None:
    if optional and v is None:
        return
    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype != torch.bool:
        v = v.item()
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise FieldError(f"{where} is {_kind(v)}, not a number")
    if not (math.isfinite(v) and lo <= v <= hi):
        raise FieldError(f"{where} is {v}, outside [{lo}, {hi}]")


def check_dict(v: Any, where: str, known: Optional[Collection[str]] = None, required: Sequence[str] = ()) -> Dict:
    if not isinstance(v, dict):
        raise FieldError(f"{where} is {_kind(v)}, not a dict")
    missing = [k for k in required if k not in v]
    if missing:
        raise FieldError(f"{where} has no {missing[0]!r}")
    if known is not None:
        unknown = sorted(str(k) for k in v if k not in known)
        if unknown:
            raise FieldError(f"{where} has the unknown key {unknown[0]!r}")
    return v


def _tensor(v: Any, where: str, shape: Optional[Tuple[int, ...]] = None, dtypes: Collection[torch.dtype] = (),
            lo: Optional[float] = None, hi: Optional[float] = None) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise FieldError(f"{where} is {_kind(v)}, not a tensor")
    if shape is not None and tuple(v.shape) != shape:
        raise FieldError(f"{where} has the shape {tuple(v.shape)}, the run's is {shape}")
    if dtypes and v.dtype not in dtypes:
        raise FieldError(f"{where} is {v.dtype}, not {' or '.join(map(str, dtypes))}")
    if v.is_floating_point() and not bool(torch.isfinite(v).all()):
        raise FieldError(f"{where} holds NaN or inf")
    if v.numel() and ((lo is not None and bool((v < lo).any())) or (hi is not None and bool((v > hi).any()))):
        raise FieldError(f"{where} holds values outside [{lo}, {hi}]")
    return v


def _kind(v: Any) -> str:
    return "None" if v is None else f"a {type(v).__name__}"


# ------------------------------------------------------------------------------------------------
# the model's fields


def check_model_fields(cfg: Any, data: Any) -> None:
    """The configuration and data description that build the model: the model kind, sizes (the
    parameter count below MAX_PARAMETERS), task and class names."""
    check_dict(cfg, "config", required=("model", "hidden", "layers"))
    check_dict(data, "data", required=("num_features", "output_dim", "task"))
    if not isinstance(cfg["model"], str) or cfg["model"] not in ("lstm", "gru"):
        raise FieldError(f"config model is {cfg['model']!r}, not 'lstm' or 'gru'")
    hidden, layers = check_int(cfg["hidden"], "config hidden", 1), check_int(cfg["layers"], "config layers", 1)
    features = check_int(data["num_features"], "data num_features", 1)
    outputs = check_int(data["output_dim"], "data output_dim", 1)
    n = rnn_parameters(cfg["model"], features, hidden, layers, outputs)
    if n > MAX_PARAMETERS:
        raise FieldError(f"config describes a model of {n:,} parameters ({cfg['model']}, hidden {hidden}, layers "
                         f"{layers}, {features} features, {outputs} outputs); vlseq-train builds at most "
                         f"{MAX_PARAMETERS:,}")
    if not isinstance(data["task"], str) or data["task"] not in TASKS:
        raise FieldError(f"data task is {data['task']!r}, not one of {', '.join(TASKS)}")
    names = data.get("class_names")
    if names is not None and (not isinstance(names, (list, tuple)) or not all(isinstance(c, str) for c in names)
                              or (data["task"] == "classification" and len(names) != outputs)):
        raise FieldError(f"data class_names is not a list of {outputs} class names")
    if "num_train" in data and data["num_train"] is not None:
        check_int(data["num_train"], "data num_train", 1)
    fingerprint = data.get("fingerprint")
    if fingerprint is not None and not (isinstance(fingerprint, str) and len(fingerprint) >= 15
                                        and all(c in "0123456789abcdef" for c in fingerprint)):
        raise FieldError("data fingerprint is not a hexadecimal digest")


# ------------------------------------------------------------------------------------------------
# what a resume restores

ADAM_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
TRAINER_KEYS = ("global_step", "skipped_steps", "micro_step", "window_samples", "window_grads")
SAMPLER_KEYS = ("epoch", "position", "batch_size", "num_samples", "seed", "resized")


def check_training_fields(ckpt: Dict[str, Any], param_shapes: List[Tuple[int, ...]]) -> None:
    """optimizer (Adam over the model's parameters, in order), trainer (vlseq-train's steps every
    call: no open accumulation window), sampler and loop (the run's training samples), rng."""
    _check_adam(ckpt["optimizer"], param_shapes)
    trainer = check_dict(ckpt["trainer"], "trainer", TRAINER_KEYS)
    steps = check_int(trainer.get("global_step", 0), "trainer global_step")
    check_int(trainer.get("skipped_steps", 0), "trainer skipped_steps", 0, steps)
    check_int(trainer.get("micro_step", 0), "trainer micro_step", 0, 0)  # vlseq-train steps every call
    check_int(trainer.get("window_samples", 0), "trainer window_samples", 0, 0)
    if trainer.get("window_grads") is not None:
        raise FieldError("trainer window_grads is set, but vlseq-train never saves inside an accumulation window")
    num_train = ckpt["data"].get("num_train")
    sampler = _check_sampler(ckpt["sampler"], num_train if isinstance(num_train, int) else None)
    loop = ckpt.get("loop")
    if loop is not None:
        check_dict(loop, "loop", ("step", "epoch", "position", "sampler"), ("step",))
        check_int(loop["step"], "loop step")
        for k in ("epoch", "position"):
            if k in loop and check_int(loop[k], f"loop {k}") != sampler[k]:
                raise FieldError(f"loop {k} is {loop[k]}, the sampler's is {sampler[k]}")
    run = check_dict(ckpt["run"], "run", required=("step",))
    step = check_int(run["step"], "run step")
    if loop is not None and loop["step"] != step:
        raise FieldError(f"loop step is {loop['step']}, the run's is {step}")
    _check_rng(ckpt["rng"])


def _check_adam(opt: Any, shapes: List[Tuple[int, ...]]) -> None:
    check_dict(opt, "optimizer", ("state", "param_groups"), ("state", "param_groups"))
    groups = opt["param_groups"]
    if not isinstance(groups, list) or len(groups) != 1:
        raise FieldError("optimizer param_groups is not the one group of Adam over the model's parameters")
    group = check_dict(groups[0], "optimizer param_groups[0]", required=("params", "lr"))
    params = group["params"]
    if not isinstance(params, (list, tuple)) or [type(i) for i in params] != [int] * len(shapes) or \
            list(params) != list(range(len(shapes))):
        raise FieldError(f"optimizer param_groups[0] params is not the model's {len(shapes)} parameters")
    check_number(group["lr"], "optimizer lr", 0, 2 ** 53)  # (the run's --lr replaces it)
    built = torch.optim.Adam([torch.zeros(1)]).defaults  # what vlseq-train builds: Adam(lr=..., fused=on a GPU)
    for k, v in group.items():
        if k in ("params", "lr"):
            continue
        if k in ("foreach", "fused"):
            ok = v is None or isinstance(v, bool)
        elif k in built:
            want = built[k]
            ok = type(v) in (type(want), list if isinstance(want, tuple) else type(want)) and \
                (tuple(v) if isinstance(want, tuple) else v) == want
        else:  # an option of another torch version's Adam
            ok = v is None or isinstance(v, (bool, int, float, str))
        if not ok:
            raise FieldError(f"optimizer {k} is {v!r}, but vlseq-train's Adam has {built.get(k)!r}")
    amsgrad = built.get("amsgrad", False)
    state = check_dict(opt["state"], "optimizer state")
    if state and len(state) != len(shapes):  # (every parameter gets a gradient, so a state, at the first step)
        raise FieldError(f"optimizer state covers {len(state)} of the model's {len(shapes)} parameters")
    for i, entry in state.items():
        where = f"optimizer state {i!r}"
        if not isinstance(i, int) or not 0 <= i < len(shapes):
            raise FieldError(f"{where} names no parameter of the model (0..{len(shapes) - 1})")
        check_dict(entry, where, ADAM_STATE_KEYS, ("step", "exp_avg", "exp_avg_sq")
                   + (("max_exp_avg_sq",) if amsgrad else ()))
        check_number(entry["step"], f"{where} step", 0, 2 ** 53)
        floats = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
        _tensor(entry["exp_avg"], f"{where} exp_avg", shapes[i], floats)
        for k in ("exp_avg_sq", "max_exp_avg_sq"):
            if k in entry:
                _tensor(entry[k], f"{where} {k}", shapes[i], floats, lo=0)


def _check_sampler(sampler: Any, num_train: Optional[int]) -> Dict[str, Any]:
    check_dict(sampler, "sampler", SAMPLER_KEYS, ("epoch", "position"))
    n = check_int(sampler.get("num_samples", num_train or 1), "sampler num_samples", 1)
    if num_train is not None and n != num_train:
        raise FieldError(f"sampler num_samples is {n}, the run's data has {num_train} training samples")
    bs = check_int(sampler.get("batch_size", 1), "sampler batch_size", 1)  # (a step may exceed the data)
    check_int(sampler["epoch"], "sampler epoch", 0, 2 ** 31)
    check_int(sampler["position"], "sampler position", 0, -(-n // bs))
    check_int(sampler.get("seed", 0), "sampler seed")
    resized = sampler.get("resized", [])
    if not isinstance(resized, list):
        raise FieldError("sampler resized is not a list")
    for r in resized:
        if not isinstance(r, (list, tuple)) or len(r) != 2:
            raise FieldError("sampler resized holds something other than (step size, steps) pairs")
        check_int(r[0], "sampler resized step size", 1)
        check_int(r[1], "sampler resized steps", 0, n)
    return sampler


def _check_rng(rng: Any) -> None:
    check_dict(rng, "rng", ("python", "numpy", "torch", "cuda"), ("python", "numpy", "torch"))
    py = check_dict(rng["python"], "rng python", ("version", "state", "gauss"), ("version", "state", "gauss"))
    check_int(py["version"], "rng python version", 3, 3)
    _tensor(py["state"], "rng python state", (625,), (torch.int64,), lo=0, hi=2 ** 32 - 1)
    check_int(int(py["state"][-1]), "rng python state position", 0, 624)
    check_number(py["gauss"], "rng python gauss", optional=True)
    nps = check_dict(rng["numpy"], "rng numpy", ("kind", "keys", "pos", "has_gauss", "cached_gaussian"),
                     ("kind", "keys", "pos", "has_gauss", "cached_gaussian"))
    if nps["kind"] != "MT19937":
        raise FieldError(f"rng numpy kind is {nps['kind']!r}, not 'MT19937'")
    _tensor(nps["keys"], "rng numpy keys", (624,), (torch.int64,), lo=0, hi=2 ** 32 - 1)
    check_int(nps["pos"], "rng numpy pos", 0, 624)
    check_int(nps["has_gauss"], "rng numpy has_gauss", 0, 1)
    check_number(nps["cached_gaussian"], "rng numpy cached_gaussian")
    _tensor(rng["torch"], "rng torch", tuple(torch.get_rng_state().shape), (torch.uint8,))
    cuda = rng.get("cuda", [])
    if not isinstance(cuda, list):
        raise FieldError("rng cuda is not a list")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i, state in enumerate(cuda):
        shape = tuple(torch.cuda.get_rng_state(i).shape) if i < have else None
        _tensor(state, f"rng cuda {i}", shape, (torch.uint8,))
        if state.dim() != 1:
            raise FieldError(f"rng cuda {i} is not a byte vector")
