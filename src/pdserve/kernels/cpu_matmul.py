"""pdserve's own CPU matmuls for a GGUF's Q4_0, Q4_1 and Q8_0 blocks
(cpu_matmul.c), built with the machine's C compiler on first use and loaded
with ctypes.

torch's weight-only kernels (`_weight_int4pack_mm_for_cpu`) dequantize the
weights to floats as they go: on a 2-core AVX2 host they read SmolLM2's
4-bit layers at about 2 GB/s. These kernels do what llama.cpp does instead:
each activation row is quantized to blocks of 32 bytes with one scale, and
a block's product is an integer dot product of bytes (AVX2's vpmaddubsw),
scaled once. The weights keep the file's blocks exactly (a Q8_0 LM head
too, which torch's int8 kernel needs requantized per row).

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

import torch

from pdserve.kernels.cpu_features import cpu_flags

KERNELS_ENV = "PDSERVE_QUANTIZED_KERNELS"   # auto | native | torch: which kernels serve
SOURCE = Path(__file__).with_name("cpu_matmul.c")
GROUP = 32            # the C file's block size
COLS = 8              # the C file's weight group: output rows are padded to a multiple
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")


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


def build(source: Path, out_dir: Path) -> Path:
    """The shared library for `source`, compiled unless a build of this
    exact text is already there. Raises RuntimeError with the compiler's
    message when it fails."""
    text = source.read_bytes()
    digest = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = out_dir / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, str(source), "-o", tmp],
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
        path = build(SOURCE, cache_dir())
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return NativeKernels(None, f"the kernels did not build: {e}")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pd_linear.argtypes = [ctypes.c_int, p, i64, i64, p, p, p, i64, p, ctypes.c_int]
    lib.pd_linear.restype = ctypes.c_int
    return NativeKernels(lib, f"built in {path.parent}")


def chosen_kernels() -> NativeKernels:
    """The kernels a QuantizedLinear built now uses: the native ones
    wherever they run, unless PDSERVE_QUANTIZED_KERNELS says `torch` (to
    compare them, as `pdserve bench quantized` does) or `native` (an error
    where they cannot run)."""
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


def _grouped(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[n, blocks, ...] padded to `rows` and laid out [rows / COLS, blocks, COLS, ...]."""
    n = t.shape[0]
    if rows > n:
        t = torch.cat([t, t.new_zeros(rows - n, *t.shape[1:])])
    return t.view(rows // COLS, COLS, *t.shape[1:]).transpose(1, 2).contiguous()


class NativeMatmul:
    """A QuantizedTensor's blocks laid out for pd_linear. `__call__(x)`:
    float32 [m, k] -> float32 [m, n]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                 lib: ctypes.CDLL):
        n, k = q.shape
        if k % GROUP:
            raise ValueError(f"{k} columns are not whole blocks of {GROUP}")
        self.lib, self.bits, self.n, self.k = lib, bits, n, k
        self.rows = -(-n // COLS) * COLS
        blocks = q.view(n, k // GROUP, GROUP)
        if bits == 4:
            packed = (blocks[..., :16] | (blocks[..., 16:] << 4)).to(torch.uint8)
        else:
            packed = blocks.to(torch.int8)
        self.weights = _grouped(packed, self.rows)
        self.scale = _grouped(scale.float(), self.rows)
        self.zero = _grouped(zero.float(), self.rows)

    def __call__(self, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
        x = x.contiguous()
        if x.dtype != torch.float32:
            raise TypeError(f"the native kernels take float32 rows, not {x.dtype}")
        m = x.shape[0]
        y = torch.empty(m, self.rows)
        if m and self.lib.pd_linear(self.bits, x.data_ptr(), m, self.k, self.weights.data_ptr(),
                                    self.scale.data_ptr(), self.zero.data_ptr(), self.rows,
                                    y.data_ptr(), threads):
            raise MemoryError(f"pd_linear could not allocate {m} rows' scratch")
        return y if self.rows == self.n else y[:, :self.n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weights, self.scale, self.zero))
