"""The top layer of vlseq_ext.bench: the machine description and the outputs (bench-results.json
with the target checks of targets.py, summary.md, PNG plots), drawing on the suites' own summaries
(diag, sweep). The recorder itself (Results) is in results.py. The JSON schema is in the package
docstring."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .. import env
from . import diag, rnn, sweep_report, tsc
from .results import SCHEMA_VERSION, SIZES, Results, fmt, lookup
from .targets import evaluate_targets


# ------------------------------------------------------------------------------------------------
# machine description
def _try(fn: Callable[[], Any], default: Any = None) -> Any:
    """A machine fact, or `default` when asking fails: describing the machine never stops a run."""
    try:
        return fn()
    except Exception:
        return default


def _driver_version() -> Optional[str]:
    out = _try(lambda: subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                      capture_output=True, text=True, timeout=20))
    if out is not None and out.returncode == 0 and out.stdout.strip():
        return out.stdout.strip().splitlines()[0]
    v = _try(lambda: torch._C._cuda_getDriverVersion())  # CUDA driver API version, e.g. 13000
    return f"CUDA driver API {v // 1000}.{v % 1000 // 10}" if v else None


def collect_meta(devices: Sequence[torch.device], argv: List[str], quick: bool, suite: str) -> Dict[str, Any]:
    from .. import ops
    n = _try(lambda: torch.cuda.device_count() if torch.cuda.is_available() else 0, 0)
    nccl = _try(torch.cuda.nccl.version) if n else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(getattr(sys, "orig_argv", [sys.executable] + argv)),
        "argv": argv, "quick": quick, "suite": suite,
        "devices": [str(d) for d in devices], "device_type": devices[0].type, "num_devices": len(devices),
        "gpu_count": n, "gpu_names": [_try(lambda i=i: torch.cuda.get_device_name(i), "?") for i in range(n)],
        "peer_access": [[i == j or _try(lambda i=i, j=j: torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
                        for i in range(n)],
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": _try(torch.backends.cudnn.version),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "driver": _driver_version() if n else None,
        "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "extension_loaded": ops.has_extension(), "extension_cuda_kernels": ops.has_cuda_kernels(),
        "env": env.bench_snapshot(),
    }


# ------------------------------------------------------------------------------------------------
# outputs
def _spread(sp: Optional[dict]) -> str:
    return f"{fmt(sp['min'])}–{fmt(sp['max'])}" if sp else "-"


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"] + \
           ["| " + " | ".join(r) + " |" for r in rows]


def markdown(res: Results, plots: Sequence[str] = ()) -> str:
    d, meta = res.data, res.data["meta"]
    gpus = f" ({', '.join(sorted(set(meta['gpu_names'])))})" if meta["gpu_names"] else ""
    L = ["# vlseq_ext benchmark", "",
         f"- date: {meta['date']}; command: `{meta['command']}`{' (quick)' if meta['quick'] else ''}",
         f"- devices: {', '.join(meta['devices'])}{gpus}",
         f"- torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, NCCL {meta['nccl']}, "
         f"driver {meta['driver']}",
         "- times: median of the repeats, min–max beside it; synchronized loops, warm-up first", ""]
    L += ["## Targets (see docs/design.md)", ""]
    L += _table(["id", "workload", "target", "status", "measured"],
                [[tid, t["workload"], t["target"], f"**{t['status']}**", t.get("detail", "")]
                 for tid, t in d["targets"].items()])
    L += _merge_md(d["merge"]) + _flatten_md(d["flatten"]) + diag.markdown_lines(d) + _train_md(d["train"]) + \
        sweep_report.markdown_lines(d) + rnn.markdown_lines(d) + tsc.markdown_lines(d)
    if d["skipped"]:
        by_reason: Dict[str, List[str]] = {}
        for k, why in d["skipped"].items():
            by_reason.setdefault(why, []).append(f"`{k}`")
        L += ["", "## Skipped", ""] + [f"- {why}: {', '.join(keys)}" for why, keys in by_reason.items()]
    if d["errors"]:
        L += ["", "## Errors", ""] + [f"- `{k}`: {v}" for k, v in d["errors"].items()]
    if d["timings_s"]:
        L += ["", "Section times: " + ", ".join(f"{k} {v:.1f} s" for k, v in d["timings_s"].items())]
    if plots:
        L += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(L) + "\n"


def _merge_md(m: Dict[str, Any]) -> List[str]:
    L: List[str] = []
    seed = m.get("seed_model", {})
    if seed.get("us_per_merge"):
        us, sp = seed["us_per_merge"], seed["us_per_merge_spread"]
        L += ["", f"## Merge: seed-model gradients ({seed['numel']:,} fp32 in {seed['tensors']} tensors per device, "
                  f"{len(m.get('devices', []))} devices)", "",
              "Loops of >= 500 merges, no sync inside; every method leaves the sum in every device's grads.", ""]
        base = {b: us.get(b) for b in ("seed_style", "cat_nccl")}
        L += _table(["method", "µs/merge", "min–max", "× seed_style", "× cat_nccl"],
                    [[k, fmt(v), _spread(sp.get(k))] + [fmt(base[b] / v) if base[b] and v else "-" for b in base]
                     for k, v in sorted(us.items(), key=lambda kv: kv[1])])
    for dt in ("fp32", "bf16"):
        flat = m.get(f"flat_{dt}", {})
        sizes = [s for s in SIZES if s in flat]
        methods = sorted({k for s in sizes for k in flat[s].get("algbw_gbps", {})})
        if not methods:
            continue
        L += ["", f"## Merge: flat {dt} buffers, algorithm bandwidth GB/s (bytes / time; median [min–max])", ""]
        def cell(s: str, k: str) -> str:
            bw = flat[s].get("algbw_gbps", {})
            return f"{fmt(bw[k])} [{_spread(flat[s]['algbw_gbps_spread'][k])}]" if k in bw else "-"
        L += _table(["method"] + sizes, [[k] + [cell(s, k) for s in sizes] for k in methods])
    if m.get("p2p_copy_gbps") is not None:
        L += ["", f"Copy-engine P2P copy {m.get('p2p_copy_direction', '')}, 256 MB: "
                  f"**{fmt(m['p2p_copy_gbps'])} GB/s** [{_spread(m.get('p2p_copy_gbps_spread'))}] "
                  "(the ceiling for M2)."]
    if m.get("p2p_copy_bidir_gbps") is not None:
        L += ["", f"Both directions at once (256 MB each way, one stream pair per direction): "
                  f"**{fmt(m['p2p_copy_bidir_gbps'])} GB/s per direction** "
                  f"[{_spread(m.get('p2p_copy_bidir_gbps_spread'))}]: the practical ceiling of a 2-GPU "
                  "all-reduce, which moves the buffer both ways at once."]
    return L


def _flatten_md(f: Dict[str, Any]) -> List[str]:
    L: List[str] = []
    seed, many = f.get("seed_model", {}), f.get("many_tensors", {})
    if not (seed.get("us_per_call") or many.get("gbps_rw")):
        return L
    L += ["", f"## Fused flatten ({f.get('device', '')}; issue 2, target F1)"]
    if seed.get("us_per_call"):
        us, sp, v = seed["us_per_call"], seed["us_per_call_spread"], seed["us_per_call"].get("vlseq")
        L += ["", f"Seed-model gradients ({seed['numel']:,} fp32 in {seed['tensors']} tensors), µs per call in loops "
                  f"of >= {seed['min_calls_per_repeat']} calls; time / vlseq: each method's time over `ops.flatten`'s.",
              ""]
        L += _table(["method", "µs/call", "min–max", "time / vlseq"],
                    [[k, fmt(t), _spread(sp.get(k)), fmt(t / v) if v else "-"]
                     for k, t in sorted(us.items(), key=lambda kv: kv[1])])
    if many.get("gbps_rw"):
        bw, sp, frac = many["gbps_rw"], many["gbps_rw_spread"], many.get("fraction_of_copy", {})
        L += ["", f"{many['size']} over {many['tensors']} fp32 tensors, GB/s counted as bytes read + written "
                  f"(2 × {many['bytes']:,} bytes per call); % of copy: median over the plain copy's median.", ""]
        L += _table(["method", "GB/s", "min–max", "% of copy"],
                    [[k, fmt(b), _spread(sp.get(k)), f"{fmt(100 * frac[k])}%" if k in frac else "-"]
                     for k, b in sorted(bw.items(), key=lambda kv: -kv[1])])
    return L


def _train_md(train: Dict[str, Any]) -> List[str]:
    L: List[str] = []
    for wl, w in train.items():
        if not w.get("samples_per_s"):
            continue
        sps, sp = w["samples_per_s"], w["samples_per_s_spread"]
        ratios = w.get("ratios", {})
        model = ", ".join(f"{k} {v}" for k, v in w["model"].items() if k != "name")
        L += ["", f"## Training: {wl} ({w['model']['name']} model{' (' + model + ')' if model else ''}, "
                  f"{w['params']:,} parameters; {w['k']} sample(s) per device per step; samples/s)", ""]
        header = ["method", "devices", "samples/s", "min–max"] + [f"× {b[3:]}" for b in ratios] + ["setup s", "note"]
        L += _table(header, [[k, str(w["num_devices"].get(k, "")), fmt(v), _spread(sp.get(k))]
                             + [fmt(r.get(k)) for r in ratios.values()]
                             + [fmt(w.get("setup_s", {}).get(k)), w.get("notes", {}).get(k, "")]
                             for k, v in sorted(sps.items(), key=lambda kv: kv[1])])
    return L


def plot(res: Results, out_dir: str) -> List[str]:
    """merge_time.png (log-log time vs size per method), train_samples_per_s.png (bars with
    min–max error bars) and the sweep's heat map (sweep_vs_best.png). Returns the file names
    written; raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    m = res.data["merge"]
    panels = [dt for dt in ("fp32", "bf16") if any(m.get(f"flat_{dt}", {}).get(s, {}).get("us") for s in SIZES)]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
        for ax, dt in zip(axes[0], panels):
            flat = m[f"flat_{dt}"]
            methods = sorted({k for s in flat.values() for k in s.get("us", {})})
            for k in methods:
                pts = [(flat[s]["bytes"], flat[s]["us"][k]) for s in SIZES if k in flat.get(s, {}).get("us", {})]
                ax.plot(*zip(*pts), marker="o", label=k, linestyle="-" if k.startswith("vlseq") else "--")
            ax.set(xscale="log", yscale="log", xlabel="buffer size (bytes)", ylabel="time per all-reduce (µs)",
                   title=f"merge of flat {dt} buffers, {len(m.get('devices', []))} devices")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "merge_time.png"), dpi=110)
        plt.close(fig)
        written.append("merge_time.png")
    wls = [(wl, w) for wl, w in res.data["train"].items() if w.get("samples_per_s")]
    if wls:
        fig, axes = plt.subplots(1, len(wls), figsize=(4.5 * len(wls), 4.5), squeeze=False)
        for ax, (wl, w) in zip(axes[0], wls):
            items = sorted(w["samples_per_s"].items(), key=lambda kv: kv[1])
            sp = w["samples_per_s_spread"]
            names = [k for k, _ in items]
            vals = [v for _, v in items]
            err = [[v - sp[k]["min"] for k, v in items], [sp[k]["max"] - v for k, v in items]]
            ax.bar(range(len(vals)), vals, yerr=err, capsize=3,
                   color=["tab:orange" if k.startswith("vlseq") else "tab:blue" for k in names])
            ax.set_xticks(range(len(vals)))
            ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
            ax.set(ylabel="samples/s", title=wl)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "train_samples_per_s.png"), dpi=110)
        plt.close(fig)
        written.append("train_samples_per_s.png")
    heat = sweep_report.plot_heatmap(res.data, out_dir)
    if heat:
        written.append(heat)
    return written


def write_outputs(res: Results, out_dir: str, log: Callable[[str], None] = print) -> str:
    """Writes bench-results.json, the plots and summary.md into out_dir; returns the markdown. A
    failure in the targets, plots or summary is recorded under errors and never costs the JSON."""
    os.makedirs(out_dir, exist_ok=True)
    try:
        res.data["targets"] = evaluate_targets(res)
    except Exception as exc:
        res.error("targets", exc)
    plots: List[str] = []
    try:
        plots = plot(res, out_dir)
    except ImportError:
        log("matplotlib is not installed: skipping the plots (pip install matplotlib, or vlseq_ext[plot])")
        res.skip("plots", "matplotlib is not installed")
    except Exception as exc:
        res.error("plots", exc)
    try:
        md = markdown(res, plots)
    except Exception as exc:
        res.error("summary", exc)
        md = f"# vlseq_ext benchmark\n\nThe summary failed ({type(exc).__name__}: {exc}); see bench-results.json.\n"
    res.dump(out_dir)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(md)
    return md


# ------------------------------------------------------------------------------------------------
# schema check: usable on any bench-results.json (tests, CI, the GPU run)
META_KEYS = ("date", "command", "argv", "quick", "suite", "devices", "device_type", "num_devices", "gpu_count",
             "gpu_names", "peer_access", "torch", "cuda", "driver")


def schema_problems(d: Dict[str, Any]) -> List[str]:
    """Problems with a bench-results.json dict against the schema in the package docstring
    (empty list: valid). Checks structure and that every measurement is a positive number with a
    consistent {median, min, max, n} spread beside it."""
    bad: List[str] = []

    def metric(path: str, node: Any) -> None:
        """node: {method: number}; with node_spread beside it."""
        if not isinstance(node, dict):
            bad.append(f"{path}: expected a dict of method -> number")
            return
        head, _, last = path.rpartition(".")
        spread = lookup(d, head + "." + last + "_spread") or {}
        for m, v in node.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                bad.append(f"{path}.{m}: expected a positive number, got {v!r}")
            sp = spread.get(m)
            if not isinstance(sp, dict) or set(sp) != {"median", "min", "max", "n"}:
                bad.append(f"{path}_spread.{m}: expected {{median, min, max, n}}, got {sp!r}")
            elif not (sp["min"] <= sp["median"] <= sp["max"] and sp["n"] >= 1 and sp["median"] == v):
                bad.append(f"{path}_spread.{m}: inconsistent {sp} for median {v}")

    for key in ("schema_version", "meta", "merge", "train", "targets", "skipped", "errors", "timings_s"):
        if key not in d:
            bad.append(f"missing top-level key {key!r}")
    if bad:
        return bad
    if d["schema_version"] != SCHEMA_VERSION:
        bad.append(f"schema_version is {d['schema_version']!r}, expected {SCHEMA_VERSION}")
    bad += [f"meta.{k} missing" for k in META_KEYS if k not in d["meta"]]
    m = d["merge"]
    if "seed_model" in m and "us_per_merge" in m["seed_model"]:
        metric("merge.seed_model.us_per_merge", m["seed_model"]["us_per_merge"])
    for dt in ("flat_fp32", "flat_bf16"):
        for size, node in m.get(dt, {}).items():
            if size not in SIZES:
                bad.append(f"merge.{dt}.{size}: unknown size (expected one of {list(SIZES)})")
                continue
            for k in ("algbw_gbps", "us"):
                if k in node:
                    metric(f"merge.{dt}.{size}.{k}", node[k])
    for key in ("p2p_copy_gbps", "p2p_copy_bidir_gbps"):
        if key in m and not (isinstance(m[key], (int, float)) and m[key] > 0):
            bad.append(f"merge.{key}: expected a positive number, got {m[key]!r}")
    f = d.get("flatten", {})  # (absent from results written before the flatten suite)
    if "us_per_call" in f.get("seed_model", {}):
        metric("flatten.seed_model.us_per_call", f["seed_model"]["us_per_call"])
    many = f.get("many_tensors", {})
    if many and many.get("size") not in SIZES:
        bad.append(f"flatten.many_tensors.size: {many.get('size')!r} (expected one of {list(SIZES)})")
    for k in ("gbps_rw", "us"):
        if k in many:
            metric(f"flatten.many_tensors.{k}", many[k])
    fractions = many.get("fraction_of_copy", {})
    if set(fractions) - set(many.get("gbps_rw", {})) or \
            not all(isinstance(v, (int, float)) and v > 0 for v in fractions.values()):
        bad.append("flatten.many_tensors.fraction_of_copy: expected {method: positive number} for measured methods")
    for pt, p in (d["train"].get("sweep") or {}).items():
        if not isinstance(p, dict):
            bad.append(f"train.sweep.{pt}: expected a dict")
            continue
        if "samples_per_s" in p:
            metric(f"train.sweep.{pt}.samples_per_s", p["samples_per_s"])
        if not all(isinstance(v, (int, float)) and v > 0 for v in p.get("ratio", {}).values()):
            bad.append(f"train.sweep.{pt}.ratio: expected {{vs_<baseline>: positive number}}")
        if "target" in p and p["target"].get("status") not in ("met", "missed", "incomplete"):
            bad.append(f"train.sweep.{pt}.target.status: {p['target'].get('status')!r}")
    for wl, w in d["train"].items():
        if "samples_per_s" in w:
            metric(f"train.{wl}.samples_per_s", w["samples_per_s"])
        for base, ratios in w.get("ratios", {}).items():
            if not base.startswith("vs_") or not all(isinstance(v, (int, float)) for v in ratios.values()):
                bad.append(f"train.{wl}.ratios.{base}: expected vs_<baseline>: {{method: number}}")
    for tid, t in d["targets"].items():
        if t.get("status") not in ("met", "missed", "not run", "incomplete"):
            bad.append(f"targets.{tid}.status: {t.get('status')!r}")
    for k in ("skipped", "errors"):
        if not all(isinstance(v, str) for v in d[k].values()):
            bad.append(f"{k}: values must be strings")
    return bad
