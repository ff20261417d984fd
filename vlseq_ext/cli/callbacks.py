"""vlseq-train's part of the training loop (vlseq_ext.training.loop): step records and progress,
validation at epoch ends, checkpoints, and the signals that stop a run after its step."""
from __future__ import annotations

import contextlib
import signal
import time
from typing import Any, Dict, Iterator, List, Sequence

from torch import Tensor

from ..training.loop import Callback, TrainingLoop
from .reporting import Reporter, num
from .run import Run, evaluate_split, save_run

__all__ = ["CLICallbacks", "stop_on_signals", "val_text"]


class CLICallbacks(Callback):
    """Step records and progress, validation and the epoch record at every epoch end, and checkpoints
    at epoch ends, every --checkpoint-every steps and at the stop. `samples_done`: samples trained this
    session; `last_val`: the latest validation result."""

    def __init__(self, run: Run, rep: Reporter) -> None:
        self.run, self.rep = run, rep
        self.every = run.config.checkpoint_every
        self.t_mark = time.perf_counter()
        self.samples_done = 0
        self.last_val: Dict[str, float] = {}

    def on_step(self, loop: TrainingLoop, batch: Sequence[Any], loss: Tensor) -> None:
        run, tr = self.run, self.run.trainer
        run.state.step = loop.step
        self.samples_done += len(batch)
        self.rep.add(loop.step, loop.epoch + 1, loss / len(batch) if tr.reduction == "sum" else loss,
                     tr.last_grad_norm, len(batch), run.optimizer.param_groups[0]["lr"])

    def _pause(self) -> None:
        """Everything trained so far is recorded; the time until the next step is not training time."""
        self.rep.flush()
        self.run.state.epoch["train_time"] += time.perf_counter() - self.t_mark

    def validate(self) -> Dict[str, float]:
        """The validation set's loss (and accuracy) now, recorded in the run's history; {} without one."""
        run = self.run
        if run.val is None:
            return {}
        self.last_val = evaluate_split(run.trainer, run.val)
        h = run.state.history
        h["val_step"].append(run.loop.step)
        h["val_loss"].append(self.last_val["val_loss"])
        h["val_accuracy"].append(self.last_val.get("val_accuracy"))
        return self.last_val

    def on_epoch_end(self, loop: TrainingLoop) -> None:
        """Validation, the epoch record and log line (the loop moves to the next epoch after this)."""
        run, st, epoch = self.run, self.run.state, loop.epoch + 1
        self._pause()
        self.validate()
        skipped = run.trainer.skipped_steps
        rec = {"type": "epoch", "epoch": epoch, "step": loop.step, **st.end_epoch(), **self.last_val,
               "skipped_steps": skipped, "time": round(st.elapsed(), 3)}
        st.history["epoch_loss"].append(rec["train_loss"])
        self.rep.write_records([rec])
        self.rep.write(f"epoch {epoch}{f'/{loop.epochs}' if loop.epochs else ''} (step {loop.step}): "
                       f"train loss {num(rec['train_loss'])}{val_text(self.last_val)}, "
                       f"{rec['samples_per_s']:,.0f} samples/s"
                       + (f", {skipped} non-finite steps skipped" if skipped else ""))

    def on_step_end(self, loop: TrainingLoop, epoch_end: bool, stopping: bool) -> None:
        if not (epoch_end or stopping or (self.every > 0 and loop.step % self.every == 0)):
            return
        if not epoch_end:
            self._pause()
            if stopping and loop.stop_reason in ("max_steps", "epochs") and self.validate():
                # a run ending mid-epoch gets a last validation
                self.rep.write_records([{"type": "val", "step": loop.step, "epoch": loop.epoch + 1, **self.last_val}])
                self.rep.write(f"validation at step {loop.step}:{val_text(self.last_val)[1:]}")
        save_run(self.run)  # after the move to the next epoch: a checkpoint never sits at the end of an epoch
        self.t_mark = self.rep.last_flush = time.perf_counter()  # validating and saving are not training time


def val_text(v: Dict[str, float]) -> str:
    return ((f", val loss {v['val_loss']:.4g}" if v else "")
            + (f", val accuracy {100 * v['val_accuracy']:.1f}%" if "val_accuracy" in v else ""))


@contextlib.contextmanager
def stop_on_signals(loop: TrainingLoop) -> Iterator[List[int]]:
    """SIGINT/SIGTERM ask the loop to stop after its step (the yielded list gets the signal number) so
    the run can finish its step and checkpoint; a second SIGINT raises KeyboardInterrupt at once."""
    received: List[int] = []

    def handler(signum: int, frame: Any) -> None:
        if received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        received.append(signum)
        loop.request_stop(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in old.items():
            signal.signal(s, h)
