"""vlseq-train's training: the run's TrainingLoop (vlseq_ext.loop) with the CLI's callbacks (progress,
metrics, validation at epoch ends, checkpoints), signals, and the final plot and summary.

A checkpoint captures exactly where the loop is: model, optimizer, trainer counters, the loop's and
sampler's (step, epoch, position), every RNG state and the run's configuration. With
--deterministic, a resumed run repeats the per-step losses of a run that was never interrupted."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch import Tensor

from .. import env
from ..distributed import ProcessGroup
from ..training.loop import Callback, TrainingLoop
from .config import PROG
from .checks import CLIError
from .reporting import Reporter, format_summary, matplotlib_available, num, open_metrics_file, plural, \
    summary_rows, write_plot, MetricsFile, describe_model
from .run import Run


@contextlib.contextmanager
def deterministic_mode(enabled: bool) -> Iterator[None]:
    """torch.use_deterministic_algorithms + cuDNN determinism for the duration (restored after)."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    if enabled:
        env.require_deterministic_cublas()
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]


@contextlib.contextmanager
def cpu_threads() -> Iterator[None]:
    """One intra-op CPU thread unless OMP_NUM_THREADS says otherwise, as torchrun does: the
    small per-sample kernels gain nothing from more, and on a busy machine spinning OpenMP
    threads slow training down many times over. Restored afterwards."""
    saved = torch.get_num_threads()
    if not env.omp_threads_given():
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


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


class CLICallbacks(Callback):
    """The CLI's part of the loop: step records and progress, validation and the epoch record at
    every epoch end, and checkpoints at epoch ends, every --checkpoint-every steps and at the stop."""

    def __init__(self, run: Run, rep: Reporter) -> None:
        self.run, self.rep = run, rep
        self.every = int(run.cfg["checkpoint_every"])
        self.t_mark = time.perf_counter()

    def on_step(self, loop: TrainingLoop, batch: Sequence[Any], loss: Tensor) -> None:
        run, tr = self.run, self.run.trainer
        run.state.step = loop.step
        run.samples_done += len(batch)
        self.rep.add(loop.step, loop.epoch + 1, loss / len(batch) if tr.reduction == "sum" else loss,
                     tr.last_grad_norm, len(batch), run.optimizer.param_groups[0]["lr"])

    def _pause(self) -> None:
        """Everything trained so far is recorded; the time until the next step is not training time."""
        self.rep.flush()
        self.run.state.epoch["train_time"] += time.perf_counter() - self.t_mark

    def on_epoch_end(self, loop: TrainingLoop) -> None:
        """Validation, the epoch record and log line (the loop moves to the next epoch after this)."""
        run, st, epoch = self.run, self.run.state, loop.epoch + 1
        self._pause()
        run.run_validation()
        rec = {"type": "epoch", "epoch": epoch, "step": loop.step, **st.end_epoch(), **run.last_val,
               "skipped_steps": run.trainer.skipped_steps, "time": round(st.elapsed(), 3)}
        st.history["epoch_loss"].append(rec["train_loss"])
        self.rep.write_records([rec])
        self.rep.write(f"epoch {epoch}{f'/{loop.epochs}' if loop.epochs else ''} (step {loop.step}): "
                       f"train loss {num(rec['train_loss'])}{val_text(run.last_val)}, "
                       f"{rec['samples_per_s']:,.0f} samples/s"
                       + (f", {run.trainer.skipped_steps} non-finite steps skipped"
                          if run.trainer.skipped_steps else ""))

    def on_step_end(self, loop: TrainingLoop, epoch_end: bool, stopping: bool) -> None:
        if not (epoch_end or stopping or (self.every > 0 and loop.step % self.every == 0)):
            return
        run = self.run
        if not epoch_end:
            self._pause()
            if stopping and loop.stop_reason in ("max_steps", "epochs") and run.run_validation():
                # a run ending mid-epoch gets a last validation
                self.rep.write_records([{"type": "val", "step": loop.step, "epoch": loop.epoch + 1,
                                         **run.last_val}])
                self.rep.write(f"validation at step {loop.step}:{val_text(run.last_val)[1:]}")
        run.save()  # after the move to the next epoch: a checkpoint never sits at the end of an epoch
        self.t_mark = self.rep.last_flush = time.perf_counter()  # validating and saving are not training time


def val_text(v: Dict[str, float]) -> str:
    return ((f", val loss {v['val_loss']:.4g}" if v else "")
            + (f", val accuracy {100 * v['val_accuracy']:.1f}%" if "val_accuracy" in v else ""))


def _stop_signal(reason: Any) -> Optional[int]:
    """The signal that stopped the run: this process's, or SIGTERM when another rank's (torchrun
    passes SIGTERM on to every worker)."""
    if isinstance(reason, int):
        return reason
    return int(signal.SIGTERM) if reason == "peer" else None


def _plot(run: Run) -> str:
    """Writes the plot; returns the summary's note. Never raises (but for KeyboardInterrupt)."""
    cfg = run.cfg
    if not matplotlib_available():
        return "skipped: matplotlib is not installed (pip install 'vlseq_ext[plot]')"
    try:
        return write_plot(Path(cfg["plot"]), run.state.history, f"{PROG}: {run.data.name}")
    except Exception as exc:  # noqa: BLE001 - the summary must survive any plotting failure
        text = str(exc).strip().splitlines()
        return f"not written: {type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def train(cfg: Dict[str, Any], ckpt: Optional[Dict[str, Any]], group: ProcessGroup) -> int:
    """Run (or continue) one training run; returns the exit code."""
    run = Run(cfg, ckpt, group)
    if cfg.get("replaces_old_run") and run.main:
        # --overwrite: the data, devices and model checked out, the new run starts now. A crash before its
        # first checkpoint must not leave the old run's checkpoint beside the new run's metrics.
        try:
            run.ckpt_path.unlink(missing_ok=True)
        except OSError as exc:
            raise CLIError(f"--overwrite: cannot remove the old checkpoint {run.ckpt_path}: {exc.strerror or exc}") from None
    try:
        return _train(run, cfg, ckpt)
    except KeyboardInterrupt:  # a second Ctrl-C, or one after training: say what is on disk
        if run.main:
            where = (f"the checkpoint of step {run.saved_step} is in {run.ckpt_path}" if run.saved_step is not None
                     else "no checkpoint was saved")
            print(f"{PROG}: interrupted: exiting at once; {where}", file=sys.stderr)
        return 130


def _train(run: Run, cfg: Dict[str, Any], ckpt: Optional[Dict[str, Any]]) -> int:
    loop, data = run.loop, run.data
    say = print if run.main else (lambda *a, **k: None)  # [distributed] rank 0 speaks for all
    say(f"{PROG}: {data.name}: {len(data)} train / {len(run.val) if run.val else 0} validation samples, "
        f"{data.num_features} features, lengths {int(data.lengths.min())}-{int(data.lengths.max())}, {data.task}"
        + (f" ({data.output_dim} classes)" if data.task == "classification" else "")
        + (f", from {data.source}" if data.source else ""), file=sys.stderr)
    say(f"{PROG}: {describe_model(run.model)} on {run.devices_desc}, "
        f"{plural(run.samples_per_step, 'sample')} per step; checkpoints in {cfg['checkpoint_dir']}"
        + (f"; resuming at step {loop.step} (epoch {loop.epoch + 1}, batch {loop.position})" if ckpt else ""),
        file=sys.stderr)
    if run.resized_from is not None:
        say(f"{PROG}: the checkpoint was written with {run.resized_from} samples per step, this run has "
            f"{run.samples_per_step}: the rest of epoch {loop.epoch + 1} ({plural(len(run.sampler), 'step')}) "
            "uses the samples not yet seen, in the same order", file=sys.stderr)
    if loop.done():
        say(f"{PROG}: nothing to do: the run is at step {loop.step} after {plural(loop.epoch, 'epoch')} "
            f"(--epochs {loop.epochs}, --max-steps {loop.max_steps}); raise --epochs or --max-steps to continue",
            file=sys.stderr)
        return 0

    metrics = (open_metrics_file(Path(cfg["metrics"]), loop.step if ckpt else None) if run.main
               else MetricsFile(None, open(os.devnull, "w")))
    rep = Reporter(cfg, loop.total_steps(), run.state, run.trainer, metrics, main=run.main)
    loop.callbacks.append(CLICallbacks(run, rep))
    t0 = time.perf_counter()
    try:
        with stop_on_signals(loop), warnings.catch_warnings():
            # The trainer warns on every skipped non-finite step; the bar, logs and metrics count them instead.
            warnings.filterwarnings("ignore", message=r"vlseq_ext: .*non-finite gradient")
            reason = loop.run()
    finally:
        rep.close()
        metrics.close()
    wall = time.perf_counter() - t0

    plot_note = _plot(run) if run.main else ""
    sig = _stop_signal(reason)
    if sig is not None:
        say(f"{PROG}: stopped by {signal.Signals(sig).name} after step {loop.step}; checkpoint saved to "
            f"{run.ckpt_path}. Continue with: {PROG} --resume {cfg['checkpoint_dir']}", file=sys.stderr)
        code = 128 + sig
    else:
        say(format_summary(PROG, summary_rows(run, wall, plot_note)))
        code = 0
    run.trainer.group.barrier()  # [distributed] no rank leaves before rank 0 has saved
    return code
