"""After the sweep has run: the best one-GPU loop, the ratios and target marks per point
(`finalize`), the W3 target entry, the markdown tables (summary.md) and the heat map of vlseq /
max(DDP, best one-GPU loop). Reads the results of vlseq_ext.bench.sweep; measures nothing."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .results import Results
from .sweep_points import TARGETS, ModelSpec

PLOT_FILE = "sweep_vs_best.png"
# The plain one-GPU loops one_gpu_best takes the fastest of: the list model packed on our kernels and on
# torch's cuDNN RNN, and the one-sample model's per-sample passes (vlseq_ext.bench.sweep).
PLAIN_LOOPS = ("one_gpu_packed", "one_gpu_cudnn", "one_gpu")


def finalize(res: Results) -> None:
    info = res.get("train.sweep_info") or {}
    ddp = info.get("ddp_method", "ddp_nccl")
    for p in (res.get("train.sweep") or {}).values():
        sps = p.get("samples_per_s")
        if not isinstance(sps, dict):
            continue
        loops = {m: sps[m] for m in PLAIN_LOOPS if sps.get(m)}
        if loops:
            best = max(loops, key=loops.get)
            sps["one_gpu_best"] = sps[best]
            p["samples_per_s_spread"]["one_gpu_best"] = dict(p["samples_per_s_spread"][best])
            if best in p.get("setup_s", {}):
                p["setup_s"]["one_gpu_best"] = p["setup_s"][best]
            p["num_devices"]["one_gpu_best"] = 1
            p["notes"]["one_gpu_best"] = f"= {best}, the fastest of {', '.join(PLAIN_LOOPS)}"
            p["one_gpu_best_method"] = best
        v = sps.get("vlseq")
        ratio: Dict[str, float] = {}
        if v:
            for key, base in (("vs_ddp", ddp), ("vs_1gpu", "vlseq_1gpu"), ("vs_one_gpu_best", "one_gpu_best"),
                              ("vs_mp", "vlseq_mp")):
                if sps.get(base):
                    ratio[key] = v / sps[base]
            if sps.get(ddp) and sps.get("one_gpu_best"):
                ratio["vs_best"] = v / max(sps[ddp], sps["one_gpu_best"])
            if sps.get("one_gpu_cudnn"):
                ratio["vs_cudnn_loop"] = v / sps["one_gpu_cudnn"]
        one = sps.get("vlseq_1gpu")  # our trainer on one device against the one-device loops
        for key, base in (("1gpu_vs_one_gpu_best", "one_gpu_best"), ("1gpu_vs_cudnn_loop", "one_gpu_cudnn")):
            if one and sps.get(base):
                ratio[key] = one / sps[base]
        p["ratio"] = ratio
        checks = {key: {"value": ratio.get(key), "op": ">=", "threshold": thr,
                        "ok": ratio[key] >= thr if key in ratio else None} for key, thr in TARGETS.items()}
        status = "incomplete" if any(c["ok"] is None for c in checks.values()) else \
            "met" if all(c["ok"] for c in checks.values()) else "missed"
        p["target"] = {"status": status, "checks": checks}


def target_summary(data: Dict[str, Any]) -> Dict[str, Any]:
    """The W3 entry of `targets`: met when every point met its three ratios."""
    meta = data.get("meta", {})
    entry: Dict[str, Any] = {"workload": "sweep: LSTM h64/256/1024 x 1/2 layers, biGRU 256; k 1/8/32; list and "
                                         "one-sample models",
                             "target": "every point: vlseq >= 1.3x DDP, >= 1.8x vlseq_1gpu, >= 1.0x best one-GPU loop",
                             "status": "not run", "ratio": None}
    points = {k: p for k, p in (data.get("train", {}).get("sweep") or {}).items() if isinstance(p, dict) and
              "target" in p}
    if meta.get("device_type") != "cuda" or meta.get("num_devices", 0) < 2:
        entry["detail"] = (f"needs >= 2 CUDA GPUs (this run: {meta.get('num_devices')} x {meta.get('device_type')})"
                           + (f"; {sum(p['target']['status'] == 'met' for p in points.values())} of {len(points)} "
                              "points met on these devices" if points else ""))
        return entry
    if not points:
        entry["detail"] = "no sweep results (see errors/skipped)"
        return entry
    by = {s: [k for k, p in points.items() if p["target"]["status"] == s] for s in ("met", "missed", "incomplete")}
    worst = min(((p["ratio"]["vs_best"], k) for k, p in points.items() if "vs_best" in p.get("ratio", {})),
                default=None)
    entry["status"] = "missed" if by["missed"] else "incomplete" if by["incomplete"] else "met"
    entry["ratio"] = worst[0] if worst else None
    detail = f"{len(by['met'])} of {len(points)} points met"
    if by["incomplete"]:
        detail += f", {len(by['incomplete'])} incomplete"
    if worst:
        detail += f"; lowest vlseq / max(DDP, best 1-GPU) {worst[0]:.2f} ({worst[1]})"
    if by["missed"]:
        detail += "; missed: " + ", ".join(by["missed"][:6]) + (" ..." if len(by["missed"]) > 6 else "")
    entry["detail"] = detail
    entry["points"] = {s: len(v) for s, v in by.items()}
    return entry


def _grid(data: Dict[str, Any]) -> Tuple[List[Tuple[str, str]], List[int], Dict[Tuple[str, str, int], dict]]:
    """Rows (model name, form) and columns (k) of the measured points, in plan order."""
    rows: List[Tuple[str, str]] = []
    ks: List[int] = []
    cells: Dict[Tuple[str, str, int], dict] = {}
    for p in (data.get("train", {}).get("sweep") or {}).values():
        if not isinstance(p, dict) or "form" not in p:
            continue
        spec = ModelSpec(p["rnn"], p["hidden"], p["layers"])
        row = (spec.label, p["form"])
        if row not in rows:
            rows.append(row)
        if p["k"] not in ks:
            ks.append(p["k"])
        cells[(row[0], row[1], p["k"])] = p
    return rows, sorted(ks), cells


def _f(v: Optional[float], digits: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.{digits}f}"


MARK = {"met": "met", "missed": "**missed**", "incomplete": "incomplete"}


def _optimizers(by_method: Dict[str, str]) -> str:
    """{method: optimizer} -> "Adam(lr=1e-3, fused=True) for vlseq, ...; Adam(lr=1e-3) for one_gpu, ..."."""
    groups: Dict[str, List[str]] = {}
    for m, o in by_method.items():
        groups.setdefault(o, []).append(m)
    return "; ".join(f"{o} for {', '.join(ms)}" for o, ms in groups.items()) or "?"


def markdown_lines(data: Dict[str, Any]) -> List[str]:
    rows, ks, cells = _grid(data)
    if not any(c.get("samples_per_s") for c in cells.values()):
        return []
    info = data["train"].get("sweep_info", {})
    ddp = info.get("ddp_method", "ddp_nccl")
    L = ["", f"## Training sweep (target W3; {len(info.get('devices', []))} x {data['meta'].get('device_type')})", "",
         f"vlseq / max({ddp}, one_gpu_best) per model and form (rows) and samples per device k (columns); "
         f"each point's mark is against vlseq >= 1.3x {ddp}, >= 1.8x vlseq_1gpu and >= 1.0x one_gpu_best. "
         f"Optimizers: {_optimizers(info.get('optimizer', {}))}. Pool of {info.get('pool_samples')} samples, "
         f"lengths {info.get('lengths')}.", ""]

    def cell(row: Tuple[str, str], k: int) -> str:
        p = cells.get((row[0], row[1], k))
        if not p:
            return "-"
        r = p.get("ratio", {}).get("vs_best")
        return f"{_f(r)} {MARK.get(p.get('target', {}).get('status'), '')}".strip() if r is not None else \
            MARK.get(p.get("target", {}).get("status"), "-")

    L += ["| model | form | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|---|" + "---|" * len(ks)]
    L += [f"| {r[0]} | {r[1]} | " + " | ".join(cell(r, k) for k in ks) + " |" for r in rows]
    L += ["", "Per point, samples/s (median of the repeats); setup = build + warm-up and graph captures before "
              "timing.", ""]
    L += ["| point | vlseq | vlseq_1gpu | vlseq_mp | " + ddp + " | one_gpu_best | one_gpu_cudnn | × " + ddp +
          " | × 1gpu | × best 1-GPU | × max | × cuDNN loop | 1gpu × best 1-GPU | 1gpu × cuDNN loop | target | "
          "vlseq setup s |", "|" + "---|" * 16]
    for name, p in (data["train"].get("sweep") or {}).items():
        if not isinstance(p, dict) or not p.get("samples_per_s"):
            continue
        sps, r = p["samples_per_s"], p.get("ratio", {})
        best = sps.get("one_gpu_best")
        which = {"one_gpu_packed": "packed", "one_gpu_cudnn": "packed, cuDNN",
                 "one_gpu": "per-sample"}.get(p.get("one_gpu_best_method", ""), "?")
        best_s = f"{_f(best)} ({which})" if best else "-"
        L.append(f"| {name} | {_f(sps.get('vlseq'))} | {_f(sps.get('vlseq_1gpu'))} | {_f(sps.get('vlseq_mp'))} | "
                 f"{_f(sps.get(ddp))} | {best_s} | {_f(sps.get('one_gpu_cudnn'))} | {_f(r.get('vs_ddp'))} | "
                 f"{_f(r.get('vs_1gpu'))} | {_f(r.get('vs_one_gpu_best'))} | {_f(r.get('vs_best'))} | "
                 f"{_f(r.get('vs_cudnn_loop'))} | {_f(r.get('1gpu_vs_one_gpu_best'))} | "
                 f"{_f(r.get('1gpu_vs_cudnn_loop'))} | "
                 f"{MARK.get(p.get('target', {}).get('status'), '-')} | {_f(p.get('setup_s', {}).get('vlseq'))} |")
    return L


def plot_heatmap(data: Dict[str, Any], out_dir: str) -> Optional[str]:
    """PLOT_FILE: rows model + form, columns k, colour and number vlseq / max(DDP, best one-GPU
    loop) (green above 1), each cell marked met / missed. None when no point has the ratio. Needs
    matplotlib (ImportError otherwise)."""
    import os

    rows, ks, cells = _grid(data)
    vals = {key: p["ratio"]["vs_best"] for key, p in cells.items() if "vs_best" in p.get("ratio", {})}
    if not vals:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    grid = np.full((len(rows), len(ks)), np.nan)
    for i, r in enumerate(rows):
        for j, k in enumerate(ks):
            grid[i, j] = vals.get((r[0], r[1], k), np.nan)
    lo, hi = float(np.nanmin(grid)), float(np.nanmax(grid))
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.9), vmax=max(hi, 1.1))
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="lightgrey")
    fig, ax = plt.subplots(figsize=(2.0 + 1.3 * len(ks), 1.2 + 0.45 * len(rows)))
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
    for i, r in enumerate(rows):
        for j, k in enumerate(ks):
            p = cells.get((r[0], r[1], k), {})
            status = p.get("target", {}).get("status", "")
            text = "n/a" if np.isnan(grid[i, j]) else f"{grid[i, j]:.2f}"
            ax.text(j, i, f"{text}\n{status}", ha="center", va="center", fontsize=7,
                    fontweight="bold" if status == "missed" else "normal")
    ax.set_xticks(range(len(ks)))
    ax.set_xticklabels([f"k={k}" for k in ks])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r[0]} ({r[1]})" for r in rows], fontsize=8)
    info = data["train"].get("sweep_info", {})
    ax.set_title(f"vlseq / max({info.get('ddp_method', 'DDP')}, best 1-device loop)\n"
                 f"{len(info.get('devices', []))} x {data['meta'].get('device_type')}", fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, PLOT_FILE), dpi=110)
    plt.close(fig)
    return PLOT_FILE
