"""ParallelTrainer's options: one frozen record, each field with its default and its check.

Adding an option is one line in TrainerOptions (name, type, default, what it accepts); the trainer
then reads it as `self.options.<name>`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional, Tuple, Union

__all__ = ["TrainerOptions"]

Check = Tuple[Callable[[Any], bool], str]  # (accepts the value, what it accepts: for the message)


def _one_of(*choices: Any) -> Check:
    """Exactly these values: True is not 1, and a tensor is not 'auto'."""
    def ok(v: Any) -> bool:
        return any(isinstance(v, str) and v == c if isinstance(c, str) else v is c for c in choices)
    shown = [repr(c) for c in choices]
    return ok, (f"{', '.join(shown[:-1])} or {shown[-1]}" if len(shown) > 1 else shown[0])


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _positive_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


POSITIVE_INT: Check = (_positive_int, "a positive int")
OPTIONAL_POSITIVE_INT: Check = (lambda v: v is None or _positive_int(v), "None or a positive int")
OPTIONAL_POSITIVE: Check = (lambda v: v is None or _positive_number(v), "None or a positive number")
BOOL: Check = _one_of(True, False)
ANY: Check = (lambda v: True, "anything")


def option(default: Any, check: Check) -> Any:
    return field(default=default, metadata={"check": check})


@dataclass(frozen=True)
class TrainerOptions:
    """The keyword options of ParallelTrainer(model, optimizer, loss_fn, devices, **options).

    The step:
        samples_per_device: k samples per device per step.
        reduction: the step's loss is the sum over samples ("sum", the seed's semantics) or the mean
            over the step's true sample count ("mean"), so a short tail step gives exactly the
            gradient one device would compute on the same samples.
        accumulation_steps: the optimizer steps every this many calls of step().
    How a device runs its samples:
        cuda_graphs: replay CUDA graphs of forward + backward (exactly the eager gradient).
        pack: "auto" (padded graphs when the model has forward_padded; otherwise per-sample graphs
            for narrow RNNs and one packed batch for wide ones; a one-sample model's passes with
            their recurrent calls gathered into one batch where one sample fills the GPU or graphs are
            off, per-sample graphs where one sample runs in a cluster), True (one batch: padded
            graphs, a packed list when the model has no forward_padded or graphs are off, or the
            gathered passes of a one-sample model), or False (k per-sample passes). The same gradient
            every way.
        lanes: concurrent per-sample passes per device (one CUDA stream and gradient set each);
            None: min(k, 16) on the per-sample graph path, else 1.
        amp: None or "bf16" (autocast forward; fp32 master weights, gradients and reduction).
        rnn_kernels: how the model's nn.LSTM / nn.GRU modules run: "auto" (the persistent kernels
            of vlseq_ext.nn where they measured faster than cuDNN), "vlseq" (the kernels wherever
            they can run) or "cudnn" (torch's own). The modules are swapped in place and keep their
            Parameter objects (vlseq_ext.nn.use_kernels).
        graph_cache_size, graph_memory_bytes: bounds on each graph cache; past them, eager
            (graph_memory_bytes None: a tenth of the device's memory, and the per-sample lanes of a
            device together at most four tenths).
    Between the merge and the optimizer step (vlseq_ext.training.guard.StepGuard):
        clip_grad_norm: clip the global gradient L2 norm to this.
        track_grad_norm: compute the norm every step (last_grad_norm) without clipping.
        nonfinite: a NaN/inf gradient "skip"s the step (counted, warned), "raise"s
            FloatingPointError, or is "ignore"d.
    The processes:
        process_group: "auto" (the initialised default group, or one from torchrun's environment,
            when there are several processes), None (this process only), a torch.distributed
            ProcessGroup or a vlseq_ext.distributed.ProcessGroup.
    """

    samples_per_device: int = option(1, POSITIVE_INT)
    reduction: str = option("sum", _one_of("sum", "mean"))
    accumulation_steps: int = option(1, POSITIVE_INT)
    cuda_graphs: bool = option(True, BOOL)
    pack: Union[str, bool] = option("auto", _one_of("auto", True, False))
    lanes: Optional[int] = option(None, OPTIONAL_POSITIVE_INT)
    amp: Optional[str] = option(None, _one_of(None, "bf16"))
    rnn_kernels: str = option("auto", _one_of("auto", "vlseq", "cudnn"))
    graph_cache_size: int = option(1024, POSITIVE_INT)
    graph_memory_bytes: Optional[int] = option(None, OPTIONAL_POSITIVE_INT)
    clip_grad_norm: Optional[float] = option(None, OPTIONAL_POSITIVE)
    track_grad_norm: bool = option(False, BOOL)
    nonfinite: str = option("skip", _one_of("skip", "raise", "ignore"))
    process_group: Any = option("auto", ANY)

    def __post_init__(self) -> None:
        for f in fields(self):
            accepts, expected = f.metadata["check"]
            value = getattr(self, f.name)
            if not accepts(value):
                raise ValueError(f"{f.name} must be {expected}, got {value!r}")

    @classmethod
    def from_keywords(cls, given: Mapping[str, Any]) -> "TrainerOptions":
        """The options given by keyword; an unknown name is refused with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise TypeError(f"ParallelTrainer has no option {', '.join(map(repr, unknown))}; its options are "
                            f"{', '.join(sorted(known))}")
        return cls(**given)
