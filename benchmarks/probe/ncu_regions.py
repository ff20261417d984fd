"""Where a kernel's warps stall, by step phase: reads Nsight Compute's per-instruction source page and
sums the stall samples between the probe's phase marks (the `CS2R ... SR_CLOCKLO` reads that
VLSEQ_RNN_TIMING puts at each phase boundary; region 0 runs up to the first mark).

Only the instructions of the step loop count: those executed at least a third as often as the most
executed one. A step is the count most of them share (once per warp and step; a branch's join can
run twice). Per region: its instructions, how many run per warp and step, its share of the kernel's
stall samples and the top stall reasons.

Usage (step_timing built by benchmarks/run_on_gpu.sh probe, or by hand):
  ncu --clock-control none -k regex:fused --launch-count 2 --section SourceCounters \\
      --section WarpStateStats -o rep ./step_timing 64 1 1 lstm fp32 32
  ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
  python3 benchmarks/probe/ncu_regions.py rep.csv [--instructions]
"""
from __future__ import annotations

import argparse
import collections
import csv
from typing import Dict, List


def read(path: str) -> Dict[str, List[Dict[str, str]]]:
    """The source page's rows, by kernel name."""
    kernels: Dict[str, List[Dict[str, str]]] = {}
    name, header = None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                name = row[1]
                kernels[name] = []
            elif row[0] == "Address":
                header = row
            elif name is not None and header is not None:
                kernels[name].append(dict(zip(header, row)))
    if not kernels:
        raise SystemExit(f"{path}: no 'Kernel Name' rows (was it written with --page source --csv?)")
    return kernels


def report(name: str, rows: List[Dict[str, str]], instructions: bool) -> None:
    stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    executed = [int(r["Instructions Executed"] or 0) for r in rows]
    most = max(executed)
    step = collections.Counter(e for e in executed if e >= most / 3).most_common(1)[0][0]
    per_step = collections.Counter()
    count = collections.Counter()
    reasons: Dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    region = 0
    for r, e in zip(rows, executed):
        if e < most / 3:
            continue
        if "SR_CLOCKLO" in r["Source"]:
            region += 1
        count[region] += 1
        per_step[region] += e
        for k in stalls:
            reasons[region][k[len("stall_"):]] += int(r[k] or 0)
        if instructions:
            s = int(r["Warp Stall Sampling (All Samples)"] or 0)
            top = sorted(((int(r[k] or 0), k[len("stall_"):]) for k in stalls), reverse=True)[:2]
            print(f"  {region} {r['Address'][-5:]} {e:9d} {s:6d} {r['Source'].strip()[:60]:60s} {top}")
    total = sum(sum(c.values()) for c in reasons.values()) or 1
    print(f"## {name}: {sum(per_step.values()) / step:.0f} instructions per warp and step")
    for g in sorted(count):
        share = 100.0 * sum(reasons[g].values()) / total
        print(f"  region {g}: {count[g]} instructions, {per_step[g] / step:.0f} executed per warp and step, "
              f"{share:.1f}% of the samples, {reasons[g].most_common(4)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass > CSV")
    ap.add_argument("--instructions", action="store_true", help="also list the step loop's instructions")
    args = ap.parse_args()
    for name, rows in read(args.csv).items():
        report(name, rows, args.instructions)


if __name__ == "__main__":
    main()
