"""What vlseq-train shows and writes: the progress bar or log lines (the metrics file: metrics.py), the
run's counters and history (saved in every checkpoint), the loss plot, and the final summary."""
from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from ..checkpoint_fields import FieldError, check_dict, check_int, check_number
from ..files import write_atomically
from .checks import one_line
from .metrics import MetricsFile


@contextlib.contextmanager
def one_line_warnings(prog: str) -> Iterator[None]:
    """Warnings (data that rounds, a slow plan) as one line each, "<prog>: warning: ...", instead of
    Python's file:line form with a source line under it."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001
        print(f"{prog}: warning: {one_line(message)}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


class RunState:
    """Counters and history of a run, saved in every checkpoint (plain lists and numbers)."""

    EPOCH_ZERO = {"samples": 0, "loss_sum": 0.0, "loss_samples": 0, "grad_norm_sum": 0.0, "grad_norm_steps": 0,
                  "grad_norm_max": 0.0, "train_time": 0.0}
    SERIES = {"step": ("loss",), "val_step": ("val_loss", "val_accuracy"), "epoch_loss": ()}  # a series: its partners

    @classmethod
    def check_saved(cls, saved: Any) -> None:
        """A checkpoint's "run" entry, field by field (FieldError): what __init__ reads from it."""
        check_dict(saved, "run", ("step", "epoch", "elapsed", "history"), ("step",))
        for k, v in check_dict(saved.get("epoch", {}), "run epoch", cls.EPOCH_ZERO).items():
            check_number(v, f"run epoch {k}")
        check_number(saved.get("elapsed", 0.0), "run elapsed", 0)
        history = check_dict(saved.get("history", {}), "run history", [k for kv in cls.SERIES.items() for k in
                                                                         (kv[0], *kv[1])])
        for key, partners in cls.SERIES.items():
            lengths = set()
            for k in (key, *partners):
                v = history.get(k, [])
                if isinstance(v, Tensor) and v.dim() == 1:
                    v = v.tolist()
                if not isinstance(v, list):
                    raise FieldError(f"run history {k} is not a list")
                for x in v:
                    if k in ("step", "val_step"):
                        check_int(x, f"run history {k}")
                    elif x is not None and (not isinstance(x, (int, float)) or isinstance(x, bool)):
                        raise FieldError(f"run history {k} holds a {type(x).__name__}, not a number")
                lengths.add(len(v))
            if len(lengths) > 1:
                raise FieldError(f"run history {', '.join((key, *partners))} differ in length")

    def __init__(self, saved: Optional[Dict[str, Any]] = None) -> None:
        s = saved or {}
        self.step = int(s.get("step", 0))
        # Running totals of the current epoch; steps with a non-finite loss or gradient norm (skipped
        # by the trainer) count towards throughput only.
        self.epoch: Dict[str, float] = {**self.EPOCH_ZERO, **s.get("epoch", {})}
        self.prior_time = float(s.get("elapsed", 0.0))
        self.history: Dict[str, List[Any]] = {"step": [], "loss": [], "val_step": [], "val_loss": [],
                                               "val_accuracy": [], "epoch_loss": []}
        for k, v in s.get("history", {}).items():
            self.history[k] = v.tolist() if isinstance(v, Tensor) else list(v)
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return self.prior_time + time.perf_counter() - self.start

    def record_step(self, r: Dict[str, Any]) -> None:
        self.history["step"].append(r["step"])
        self.history["loss"].append(r["loss"])
        e = self.epoch
        e["samples"] += r["samples"]
        if math.isfinite(r["loss"]):
            e["loss_sum"] += r["loss"] * r["samples"]
            e["loss_samples"] += r["samples"]
        if r["grad_norm"] is not None and math.isfinite(r["grad_norm"]):
            e["grad_norm_sum"] += r["grad_norm"]
            e["grad_norm_steps"] += 1
            e["grad_norm_max"] = max(e["grad_norm_max"], r["grad_norm"])

    def end_epoch(self) -> Dict[str, Any]:
        """The finished epoch's train loss, gradient norms and throughput; resets the totals."""
        e, self.epoch = self.epoch, dict(self.EPOCH_ZERO)
        return {"train_loss": e["loss_sum"] / e["loss_samples"] if e["loss_samples"] else None,
                "grad_norm": e["grad_norm_sum"] / e["grad_norm_steps"] if e["grad_norm_steps"] else None,
                "grad_norm_max": e["grad_norm_max"] if e["grad_norm_steps"] else None,
                "samples_per_s": round(e["samples"] / max(e["train_time"], 1e-9), 2)}

    def state_dict(self) -> Dict[str, Any]:
        h = dict(self.history)  # the per-step series as tensors: compact and fast to save
        h["step"], h["loss"] = torch.tensor(h["step"], dtype=torch.int64), torch.tensor(h["loss"], dtype=torch.float64)
        return {"step": self.step, "epoch": dict(self.epoch), "elapsed": self.elapsed(), "history": h}


class Reporter:
    """Progress bar (a TTY and not --quiet) or periodic log lines, plus the JSON Lines metrics file.
    Step losses stay on the device until a flush, so the hot loop has no host sync of its own."""

    def __init__(self, total: Optional[int], state: RunState, trainer: Any, metrics: MetricsFile, main: bool,
                 quiet: bool, log_interval: float) -> None:
        self.state, self.trainer, self.metrics = state, trainer, metrics
        self.main = main  # [distributed] only rank 0 shows progress and writes log lines
        self.log_interval = log_interval
        self.total = total
        self.bar = None
        if main and not quiet and sys.stderr.isatty():
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=state.step, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.pending: List[Tuple[int, int, Tensor, Optional[Tensor], int, float]] = []
        self.last_flush = self.last_log = time.perf_counter()
        self.window_samples = 0
        self.recent: List[float] = []
        self.samples_per_s = 0.0
        self.grad_norm: Optional[float] = None

    def write(self, line: str) -> None:
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def add(self, step: int, epoch: int, loss: Tensor, grad_norm: Optional[Tensor], n: int, lr: float) -> None:
        """Queue one step's record; its tensors are read at the next flush."""
        gn = None if grad_norm is None else grad_norm.detach().clone()
        self.pending.append((step, epoch, loss.detach().clone(), gn, n, lr))
        self.window_samples += n
        if time.perf_counter() - self.last_flush >= 0.5 or len(self.pending) >= 256:
            self.flush()

    def flush(self) -> None:
        """Read the pending losses (one sync), record them in the run's history and the metrics
        file, and update the bar or write a log line."""
        if not self.pending:
            return
        losses = torch.stack([p[2].float() for p in self.pending]).tolist()
        norms = [p[3] for p in self.pending]
        if all(g is not None for g in norms):
            norms = torch.stack([g.float() for g in norms]).tolist()
        else:
            norms = [None if g is None else float(g) for g in norms]
        now = time.perf_counter()
        self.samples_per_s = self.window_samples / max(now - self.last_flush, 1e-9)
        skipped_total, elapsed = self.trainer.skipped_steps, round(self.state.elapsed(), 3)
        recs = []
        for (step, epoch, _, _, n, lr), loss, gn in zip(self.pending, losses, norms):
            # The trainer (nonfinite="skip") skips exactly the steps whose gradient norm is not finite.
            recs.append({"type": "step", "step": step, "epoch": epoch, "loss": loss, "grad_norm": gn, "samples": n,
                         "skipped": gn is not None and not math.isfinite(gn), "skipped_steps": skipped_total, "lr": lr,
                         "samples_per_s": round(self.samples_per_s, 2), "time": elapsed})
            self.state.record_step(recs[-1])
        self.pending, self.window_samples, self.last_flush = [], 0, now
        self.metrics.write(recs)
        self.recent = (self.recent + [r["loss"] for r in recs if math.isfinite(r["loss"])])[-50:]
        self.grad_norm = norms[-1]
        last = recs[-1]
        loss_s = f"{np.mean(self.recent):.4g}" if self.recent else "nan"
        if self.bar is not None:
            self.bar.set_postfix_str(f"epoch {last['epoch']} loss {loss_s} {self.samples_per_s:,.0f} samples/s"
                                     + (f" skipped {skipped_total}" if skipped_total else ""), refresh=False)
            self.bar.update(last["step"] - self.bar.n)
        elif now - self.last_log >= self.log_interval:
            self.last_log = now
            of = f"/{self.total}" if self.total else ""
            gn = "n/a" if self.grad_norm is None else f"{self.grad_norm:.3g}"
            self.write(f"step {last['step']}{of} (epoch {last['epoch']}) loss {loss_s} | "
                       f"{self.samples_per_s:,.0f} samples/s | grad-norm {gn}"
                       + (f" | skipped {skipped_total}" if skipped_total else ""))

    def write_records(self, recs: Sequence[Dict[str, Any]]) -> None:
        self.metrics.write(recs)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------------------------
# the plot


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write_plot(path: Path, history: Dict[str, List[Any]], title: str) -> str:
    """The per-step training loss (raw and smoothed) and the validation loss (and accuracy), in the
    format of path's extension. Non-finite losses (a diverging run) are left out, and the figure
    says how many. Returns the summary's note: the path, and how many values were left out."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    title = title.encode("utf-8", "replace").decode("utf-8")  # a non-UTF-8 file name: matplotlib refuses surrogates

    steps, loss = np.array(history["step"]), np.array(history["loss"], dtype=np.float64)
    vs, vl = np.array(history["val_step"]), np.array(history["val_loss"], dtype=np.float64)
    ok, vok = np.isfinite(loss), np.isfinite(vl)
    left_out = int((~ok).sum() + (~vok).sum())
    acc = [(s, a) for s, a in zip(history["val_step"], history["val_accuracy"]) if a is not None and math.isfinite(a)]
    fig = Figure(figsize=(9, 4.8), layout="constrained")
    axes = fig.subplots(1, 2 if acc else 1, squeeze=False)[0]
    ax = axes[0]
    finite = loss[ok]
    if len(finite):
        ax.plot(steps[ok], finite, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (per step)")
        w = max(1, len(finite) // 40)
        c = np.cumsum(np.concatenate([[0.0], finite]))
        i = np.arange(1, len(finite) + 1)
        smooth = (c[i] - c[np.maximum(i - w, 0)]) / np.minimum(i, w)  # trailing mean of up to w finite steps
        if w > 1:
            ax.plot(steps[ok], smooth, color="tab:blue", label=f"train (mean of {w} steps)")
        # Per-step losses of a few samples are spiky: scale the axis to the smoothed curve.
        top = float(np.max([np.percentile(finite, 98), *vl[vok]]))
        low = float(smooth.min())
        if math.isfinite(top) and top > 0 and math.isfinite(low):
            if low > 0 and smooth.max() / low > 30:
                ax.set_yscale("log")
                ax.set_ylim(0.5 * low, 1.5 * top)
            elif low >= 0:
                ax.set_ylim(0, 1.05 * top)
    if vok.any():
        ax.plot(vs[vok], vl[vok], "o-", color="tab:orange", label="validation")
    if not len(finite) and not vok.any():
        ax.text(0.5, 0.5, "no finite loss to plot", transform=ax.transAxes, ha="center", va="center")
    if left_out:
        ax.text(0.99, 0.01, f"{left_out} non-finite loss value{'s' if left_out > 1 else ''} not shown",
                transform=ax.transAxes, ha="right", va="bottom", color="tab:red", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    if acc:
        axes[1].plot([s for s, _ in acc], [a * 100 for _, a in acc], "o-", color="tab:green")
        axes[1].set_xlabel("step")
        axes[1].set_ylabel("validation accuracy (%)")
        axes[1].grid(alpha=0.3)
    fmt = path.suffix.lower().lstrip(".") or "png"  # checks.plot_formats() admitted it (a stream may have none)
    write_atomically(path, lambda fh: fig.savefig(fh, dpi=110, format=fmt))  # an old plot stays whole on a full disk
    return str(path) + (f" ({left_out} non-finite loss value{'s' if left_out > 1 else ''} not shown)"
                        if left_out else "")


# ------------------------------------------------------------------------------------------------
# text


def describe_model(model: Any) -> str:
    """E.g. "LSTM(36 -> 64) + Linear(64 -> 1), 26,177 parameters"."""
    rnn = model.recurrent
    layers = f" x{rnn.num_layers}" if rnn.num_layers > 1 else ""
    n = sum(p.numel() for p in model.parameters())
    return (f"{model.rnn_type.upper()}({model.input_dim} -> {rnn.hidden_size}{layers}) + "
            f"Linear({model.fc.in_features} -> {model.output_dim}), {n:,} parameters")


def num(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def finite_mean(values: Sequence[Optional[float]]) -> Optional[float]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def summary_rows(run: Any, samples_done: int, wall: float, plot_note: str) -> List[Tuple[str, str]]:
    """The rows of the final summary of a Run (cli.run.Run) that trained `samples_done` samples in `wall`
    seconds this session."""
    h, data, loop = run.state.history, run.data, run.loop
    rows = [("data", f"{data.name}: {len(data)} train / {len(run.val) if run.val else 0} validation samples"),
            ("model", describe_model(run.model)),
            ("devices", f"{run.devices_text()}, {plural(run.samples_per_step, 'sample')} per step"),
            ("steps", f"{loop.step} ({plural(loop.epoch, 'epoch')}"
                      f"{f' + {loop.position} batches' if loop.position else ''}), "
                      f"{run.trainer.skipped_steps} skipped as non-finite")]
    if h["epoch_loss"]:
        rows.append(("train loss by epoch", " -> ".join(num(v) for v in h["epoch_loss"][-6:])))
    if h["loss"]:
        k = max(1, min(50, len(h["loss"]) // 5))
        rows.append((f"train loss, first/last {k} steps",
                     f"{num(finite_mean(h['loss'][:k]))} -> {num(finite_mean(h['loss'][-k:]))}"))
    vals = np.array(h["val_loss"], dtype=np.float64)
    if len(vals):
        if np.isfinite(vals).any():
            best = int(np.nanargmin(np.where(np.isfinite(vals), vals, np.nan)))
            rows.append(("val loss", f"{vals[-1]:.4g} (best {vals[best]:.4g} at step {h['val_step'][best]})"))
        else:
            rows.append(("val loss", f"{vals[-1]:.4g} (never finite)"))
    if h["val_accuracy"] and h["val_accuracy"][-1] is not None:
        rows.append(("val accuracy", f"{100 * h['val_accuracy'][-1]:.1f}% (chance {100 / data.output_dim:.1f}%)"))
    rows += [("throughput", f"{samples_done / max(wall, 1e-9):,.0f} samples/s ({wall:.1f} s this session)"),
             ("warm-up", warm_up_text(run.trainer)),
             ("checkpoint", str(run.checkpoint_path)), ("metrics", run.config.metrics), ("plot", plot_note)]
    return rows


def warm_up_text(trainer: Any) -> str:
    """Time spent on first runs and CUDA-graph captures (included in the throughput above)."""
    if not trainer.cuda_graphs:
        return "none (no CUDA graphs on this device)"
    graphs = sum(s["graphs"] for s in trainer.graph_stats())
    return (f"{trainer.capture_seconds:.1f} s of first runs and captures on the slowest device, "
            f"{plural(graphs, 'CUDA graph')} in all")


def format_summary(prog: str, rows: List[Tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return f"\n{prog} summary\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
