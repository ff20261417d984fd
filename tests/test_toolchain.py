"""How the extension is linked (csrc/exports.map, csrc/arg_checks.cpp): it exports its entry point only,
and a private libstdc++ inside it stays private (docs/design.md says why)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("compiled_ops")


def _symbols(*nm_args):
    import shutil
    import subprocess

    from vlseq_ext import _C

    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    proc = subprocess.run(["nm", *nm_args, _C.__file__], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return _C.__file__, proc.stdout


def test_toolchain_extension_exports_only_its_entry_point():
    """setup.py links with csrc/exports.map: the extension exports PyInit__C and nothing else, so no
    C++ runtime code inside it can be bound to (or interpose) the process's libstdc++.so.6. A build
    that exported such code formatted numbers with the wrong locale facet and crashed
    (benchmarks/results/cuda-gdb-bad-input-crash.txt)."""
    path, out = _symbols("-D", "--defined-only")
    names = sorted({line.split()[-1] for line in out.splitlines() if line.strip()})
    assert names == ["PyInit__C"], f"{path} exports {len(names)} symbols, e.g. {names[:10]}: was it linked " \
                                   "without -Wl,--version-script=csrc/exports.map?"


def test_toolchain_private_libstdcxx_stays_private():
    """Where the compiler links libstdc++ into the extension (the GPU image's CXX=/opt/gcc/bin/g++ does:
    _ZNSt6locale7classicEv defined in _C, seen on 2026-12-01), that copy must stay local to it. A
    global copy is what the dynamic linker bound to the process's libstdc++.so.6, and formatting a
    number then crashed."""
    path, out = _symbols("--defined-only")
    if not out.strip():
        pytest.skip(f"{path} has no symbol table (stripped)")
    copied = [line.split() for line in out.splitlines() if line.endswith(" _ZNSt6locale7classicEv")]
    for _, kind, name in copied:
        assert kind.islower(), f"{path} holds a global copy of libstdc++ ({kind} {name}); check the link flags"


