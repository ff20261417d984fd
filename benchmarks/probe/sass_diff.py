"""Whether a change moved the kernels' machine code: compiles CUDA translation units at a git revision and
in the working tree (sm_90a, -O3, the extension's include paths) and compares their SASS function by
function, addresses and encodings left out. It shows that a change leaves the kernels it does not mean to
change as they were (e.g. the cluster kernels when only the single-block form changes), or that a
comment-only change compiles to the same code, without a GPU.

Usage (no GPU needed; nvcc, and cuobjdump from CUDA or from the triton wheel that torch installs):
  python3 benchmarks/probe/sass_diff.py --base HEAD~1 csrc/cuda/rnn_forward.cu csrc/cuda/rnn_backward.cu \\
      [--match fused] [--show NAME_REGEX]
Prints, per function whose mangled name matches --match: same / DIFF, the instruction counts at the base
and now, and how many lines a diff of the two adds or removes; --show prints that diff for the matching
functions.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidates = [found] if found else []
    candidates.append(os.path.join(cuda_home, "bin", "cuobjdump"))
    try:
        import triton  # the bundled binary: torch's CUDA wheels install triton
        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    sys.exit("sass_diff: no cuobjdump (PATH, $CUDA_HOME/bin or the triton wheel)")


def include_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths
    return [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]


def compile_cubin(tree: str, tu: str, out: str) -> None:
    cmd = ["nvcc", "-std=c++20", "-arch=sm_90a", "-cubin", "-O3", "--expt-relaxed-constexpr",
           f"-I{tree}/csrc/include", f"-I{tree}/csrc/cuda", *include_flags(), os.path.join(tree, tu), "-o", out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"sass_diff: nvcc failed on {tu} in {tree}:\n{r.stderr[-4000:]}")


def functions(cubin: str, tool: str) -> dict[str, list[str]]:
    """Mangled name -> its instructions, with addresses, encodings and immediate constants' hex left out."""
    text = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    out = {}
    for part in re.split(r"\n\s*Function : ", text)[1:]:
        name = part.split("\n", 1)[0].strip()
        out[name] = [re.sub(r"0x[0-9a-f]+", "X", m.group(1)).strip()
                     for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", part)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tus", nargs="+", help="translation units, relative to the repository root")
    ap.add_argument("--base", required=True, help="the git revision to compare with")
    ap.add_argument("--match", default="", help="only functions whose mangled name matches this regex")
    ap.add_argument("--show", default=None, help="print the differing instructions of functions matching this")
    args = ap.parse_args()
    tool = cuobjdump()
    with tempfile.TemporaryDirectory(prefix="sass_diff_") as tmp:
        base_tree = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", base_tree, args.base], check=True)
        try:
            differ = 0
            for tu in args.tus:
                old, new = os.path.join(tmp, "old.cubin"), os.path.join(tmp, "new.cubin")
                compile_cubin(base_tree, tu, old)
                compile_cubin(ROOT, tu, new)
                a, b = functions(old, tool), functions(new, tool)
                print(f"## {tu} ({args.base} -> working tree)")
                for name in sorted(set(a) | set(b)):
                    if not re.search(args.match, name):
                        continue
                    fa, fb = a.get(name, []), b.get(name, [])
                    changed = sum(1 for d in difflib.ndiff(fa, fb) if d[:1] in "+-")
                    state = "same" if fa == fb else "DIFF"
                    differ += fa != fb
                    print(f"  {state}  {len(fa):6d} -> {len(fb):6d} instructions, {changed:5d} lines +/-  {name}")
                    if fa != fb and args.show is not None and re.search(args.show, name):
                        for d in difflib.unified_diff(fa, fb, lineterm="", n=1):
                            print("      " + d)
            print(f"{differ} function(s) differ")
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base_tree], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
