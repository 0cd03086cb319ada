"""pdserve's CPU kernels (the C files beside this one, declared in
pdserve_cpu.h): built with the machine's C compiler on first use and loaded
with ctypes.

The library is compiled once per source text into a cache directory
(`PDSERVE_KERNEL_CACHE`, default `$XDG_CACHE_HOME/pdserve` or
`~/.cache/pdserve`), each process building to a name of its own and
renaming it into place, so engines starting together on one host do not
trip on each other. `native_kernels()` says whether they can run here and
why not: no AVX2 and FMA, or no C compiler (`CC`, else `cc`), or a failed
build (its compiler output in the reason).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdserve.kernels.cpu.features import cpu_flags

KERNELS_ENV = "PDSERVE_CPU_KERNELS"   # auto | native | torch: whose CPU kernels serve
HERE = Path(__file__).parent
SOURCES = tuple(HERE / f for f in ("pool.c", "matmul.c", "bf16.c", "dense.c", "attention.c",
                                   "layer.c"))
HEADER = HERE / "pdserve_cpu.h"       # every export declared once; part of a build's digest
FLAGS = ("-O3", "-mavx2", "-mfma", "-pthread", "-shared", "-fPIC")


@dataclass(frozen=True)
class NativeKernels:
    """Whether the native kernels run here; `lib` when they do."""
    lib: ctypes.CDLL | None
    why: str


def cache_dir() -> Path:
    env = os.environ.get("PDSERVE_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve"


def build(sources: tuple[Path, ...], out_dir: Path, name: str = "pdserve-cpu") -> Path:
    """One shared library of `sources`, compiled unless a build of these
    exact texts is already there. Raises RuntimeError with the compiler's
    message when it fails."""
    text = b"".join(s.read_bytes() for s in (*sources, HEADER))
    digest = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = out_dir / f"{name}-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, f"-I{HEADER.parent}", *map(str, sources),
                               "-o", tmp],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=1)
def native_kernels() -> NativeKernels:
    """This process's library, built on first call (None, and why, where
    it cannot run)."""
    missing = [f for f in ("avx2", "fma") if f not in cpu_flags()]
    if missing:
        return NativeKernels(None, f"this CPU lacks {' and '.join(missing)}")
    try:
        path = build(SOURCES, cache_dir())
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return NativeKernels(None, f"the kernels did not build: {e}")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pd_linear.argtypes = [ctypes.c_int, p, i64, i64, p, p, p, i64, p, ctypes.c_int]
    lib.pd_linear.restype = ctypes.c_int
    lib.pd_decode_attention.argtypes = [p, p, p, ctypes.c_int, i64, i64, i64, i64, i64, p, i64,
                                        p, p, p, i64, ctypes.c_float, ctypes.c_float, p,
                                        ctypes.c_int]
    lib.pd_decode_attention.restype = ctypes.c_int
    lib.pd_linear_bf16.argtypes = [p, i64, i64, p, i64, p, ctypes.c_int]
    lib.pd_linear_bf16.restype = ctypes.c_int
    lib.pd_linear_dense.argtypes = [p, i64, i64, p, ctypes.c_int, i64, p, ctypes.c_int]
    lib.pd_linear_dense.restype = ctypes.c_int
    lib.pd_has_bf16.argtypes = []
    lib.pd_has_bf16.restype = ctypes.c_int
    lib.pd_layer.argtypes = [p, p, p, p, p, p, ctypes.c_int]
    lib.pd_layer.restype = ctypes.c_int
    lib.pd_pool_share.argtypes = [ctypes.c_int]
    lib.pd_pool_share.restype = ctypes.c_int
    lib.pd_pool_workers.argtypes = []
    lib.pd_pool_workers.restype = ctypes.c_int
    lib.pd_pool_helped.argtypes = []
    lib.pd_pool_helped.restype = ctypes.c_longlong
    return NativeKernels(lib, f"built in {path.parent}")


def chosen_kernels() -> NativeKernels:
    """The kernels a QuantizedLinear or CPU attention built now uses: the
    native ones wherever they run, unless PDSERVE_CPU_KERNELS says `torch`
    (to compare them, as `pdserve bench quantized` does) or `native` (an
    error where they cannot run)."""
    want = os.environ.get(KERNELS_ENV, "auto")
    if want == "torch":
        return NativeKernels(None, f"{KERNELS_ENV} is torch")
    if want not in ("auto", "native"):
        raise ValueError(f"{KERNELS_ENV}={want!r}: use auto, native or torch")
    found = native_kernels()
    if want == "native" and found.lib is None:
        raise ValueError(f"{KERNELS_ENV} is native, but {found.why}; unset it to use "
                         "torch's kernels")
    return found


def share_cores(workers: int) -> int:
    """From now on pdserve's kernels share each job among `workers`
    threads: the calling one and workers - 1 helpers (cpu/pool.c), started
    as needed and kept for the process. Returns how many share (1 where
    the kernels do not run here)."""
    lib = chosen_kernels().lib
    if lib is None:
        return 1
    return lib.pd_pool_share(workers)
