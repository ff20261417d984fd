"""Build vlseq_ext._C: op schemas, CPU kernels and (when a CUDA toolkit is found) CUDA kernels.

Install with `pip install --no-build-isolation .` so the extension is compiled against the
torch that is already installed. Knobs: VLSEQ_FORCE_CPU=1, TORCH_CUDA_ARCH_LIST, MAX_JOBS,
CUDA_HOME.
"""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

try:
    import torch
except ImportError:
    # An isolated build environment has no torch; building against a freshly downloaded one
    # would produce an extension for the wrong torch. Say what to do, in one line.
    sys.stderr.write(
        "vlseq_ext: torch is not importable in this build environment; "
        "install with `pip install --no-build-isolation .` (builds against your installed torch)\n"
    )
    sys.exit(1)

ROOT = os.path.dirname(os.path.abspath(__file__))


def _log(msg: str) -> None:
    sys.stderr.write(f"vlseq_ext: {msg}\n")


def _resolve_cuda_home() -> None:
    """torch guesses CUDA_HOME from `which nvcc`; a wrapper script there (e.g. /usr/local/bin/nvcc)
    makes it guess /usr/local, which has no libcudart. Pick a directory that really holds the
    toolkit before torch.utils.cpp_extension reads the variable."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        candidates.append(os.path.dirname(os.path.dirname(nvcc)))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for c in candidates:
        if os.path.exists(os.path.join(c, "include", "cuda_runtime.h")) and os.path.exists(
            os.path.join(c, "bin", "nvcc")
        ):
            os.environ["CUDA_HOME"] = c
            return


_resolve_cuda_home()
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _nvcc_version(cuda_home: str):
    out = subprocess.run(
        [os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True
    ).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _want_cuda() -> bool:
    if os.environ.get("VLSEQ_FORCE_CPU", "0") == "1":
        _log("VLSEQ_FORCE_CPU=1: building CPU kernels only")
        return False
    if not torch.version.cuda:
        _log(f"torch {torch.__version__} has no CUDA support: building CPU kernels only")
        return False
    if CUDA_HOME is None:
        _log("no CUDA toolkit found (nvcc / CUDA_HOME): building CPU kernels only")
        return False
    nv = _nvcc_version(CUDA_HOME)
    torch_major = int(torch.version.cuda.split(".")[0])
    if nv is None:
        _log(f"could not read the nvcc version under CUDA_HOME={CUDA_HOME}: building CPU kernels only")
        return False
    if nv[0] != torch_major:
        sys.stderr.write(
            f"vlseq_ext: nvcc under CUDA_HOME={CUDA_HOME} is CUDA {nv[0]}.{nv[1]} but torch "
            f"{torch.__version__} was built with CUDA {torch.version.cuda}; install a CUDA "
            f"{torch_major}.x toolkit (or point CUDA_HOME at one), or set VLSEQ_FORCE_CPU=1\n"
        )
        sys.exit(1)
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # torch would compile for every architecture it knows (slow on small machines); with no GPU
        # here the kernels are only compiled, not run, so one target keeps the build short.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        _log("no GPU visible: compiling the CUDA kernels for sm_90 only (set TORCH_CUDA_ARCH_LIST for other GPUs)")
    _log(f"building CUDA kernels with CUDA_HOME={CUDA_HOME} (nvcc {nv[0]}.{nv[1]}, torch CUDA {torch.version.cuda})")
    return True


def _cublaslt():
    """Compile and link flags for cuBLASLt (csrc/cuda/mm_tf32.cpp): its header from the toolkit or,
    where the toolkit has none, from the NVIDIA wheel torch runs with (searched after every other
    include directory, so no other header of that wheel shadows the toolkit's); the library torch
    loads itself where its wheel has it, else the toolkit's."""
    import importlib.util
    major = torch.version.cuda.split(".")[0]
    spec = importlib.util.find_spec("nvidia")
    locations = list(spec.submodule_search_locations or []) if spec else []
    roots = [os.path.join(loc, sub) for loc in locations for sub in (f"cu{major}", "cublas")]
    cxx = []
    if not os.path.exists(os.path.join(CUDA_HOME, "include", "cublasLt.h")):
        inc = next((os.path.join(r, "include") for r in roots if os.path.exists(os.path.join(r, "include", "cublasLt.h"))),
                   None)
        if inc is None:
            sys.stderr.write(f"vlseq_ext: no cublasLt.h under CUDA_HOME={CUDA_HOME} nor in torch's NVIDIA wheels; "
                             "install the toolkit's cuBLAS headers, or set VLSEQ_FORCE_CPU=1\n")
            sys.exit(1)
        cxx = ["-idirafter", inc]
    for r in roots:
        lib = os.path.join(r, "lib", f"libcublasLt.so.{major}")
        if os.path.exists(lib):
            return cxx, [f"-L{os.path.dirname(lib)}", f"-l:libcublasLt.so.{major}"]
    return cxx, ["-lcublasLt"]


def _extension():
    use_cuda = _want_cuda()
    rel = lambda pattern: sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    sources = rel("csrc/*.cpp") + rel("csrc/cpu/*.cpp")
    # torch picks the C++ standard it needs (C++20 from torch 2.13). -g0 overrides the -g of Python's
    # own CFLAGS: debug information for torch's headers doubled each C++ file's compile time (15 s ->
    # 8 s per file on a 2-core CI machine).
    cxx = ["-O3", "-g0"]
    include_dirs = [os.path.join(ROOT, "csrc", "include")]
    # Export PyInit__C only (csrc/exports.map says why): a GPU-machine build that exported a
    # copy of libstdc++ (linked in statically by the GPU image's CXX=/opt/gcc/bin/g++) crashed when
    # formatting numbers (csrc/arg_checks.cpp).
    link = [f"-Wl,--version-script={os.path.join(ROOT, 'csrc', 'exports.map')}"]
    if not use_cuda:
        return CppExtension("vlseq_ext._C", sources, include_dirs=include_dirs,
                            extra_compile_args={"cxx": cxx}, extra_link_args=link, py_limited_api=True)
    sources += rel("csrc/cuda/*.cu") + rel("csrc/cuda/*.cpp")
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
    blas_cxx, blas_link = _cublaslt()
    return CUDAExtension(
        "vlseq_ext._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx + blas_cxx, "nvcc": nvcc},
        extra_link_args=link + blas_link,
        py_limited_api=True,
    )


setup(
    packages=find_packages(include=["vlseq_ext", "vlseq_ext.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
