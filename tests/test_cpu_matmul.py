"""pdserve's own CPU matmuls (kernels/cpu_matmul.c and .py): the product
of the file's exact blocks and 8-bit activation blocks, each row's bits
independent of its batch and of the thread count, the build's cache and
its errors, and the choice between them and torch's kernels."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from pdserve.kernels import native
from pdserve.kernels.cpu_matmul import GROUP, NativeMatmul
from pdserve.kernels.native import KERNELS_ENV, build, chosen_kernels, native_kernels
from pdserve.kernels.quantized import from_blocks

LIB = native_kernels().lib
needs_lib = pytest.mark.skipif(LIB is None, reason=f"no native kernels: {native_kernels().why}")


def qtensor(kind: T, rows: int, cols: int, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return from_blocks(quantize(w, kind), kind.name, rows, cols)


def reference(x: torch.Tensor, qt) -> torch.Tensor:
    """The kernel's arithmetic in float64: each row quantized to blocks of
    32 (scale max|x| / 127, rounded to nearest even), times the file's
    weights as stored."""
    m, k = x.shape
    xb = x.view(m, k // GROUP, GROUP)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1)), 0)
    xq = (q * d).view(m, k).double()
    return xq @ qt.dequantize().double().t()


@needs_lib
@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1, T.Q8_0])
@pytest.mark.parametrize("rows", [64, 45])          # 45: padded to 48 inside
def test_the_product_is_the_blocks_times_8_bit_rows(kind, rows):
    qt = qtensor(kind, rows, 128)
    mm = NativeMatmul(qt.q, qt.scale, qt.zero, qt.bits, LIB)
    x = torch.randn(7, 128)
    y = mm(x)
    assert y.shape == (7, rows) and y.dtype == torch.float32
    ref = reference(x, qt)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # and close to the float product: 8-bit blocks of the rows
    exact = x.double() @ qt.dequantize().double().t()
    assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < 0.02


@needs_lib
@pytest.mark.parametrize("kind", [T.Q4_1, T.Q8_0])
def test_a_rows_bits_depend_neither_on_its_batch_nor_on_the_threads(kind):
    qt = qtensor(kind, 96, 576)
    mm = NativeMatmul(qt.q, qt.scale, qt.zero, qt.bits, LIB)
    x = torch.randn(13, 576)
    full = mm(x)
    for i in range(13):
        assert torch.equal(mm(x[i:i + 1]), full[i:i + 1]), i
    for k in (2, 3, 5, 9):
        assert torch.equal(mm(x[:k]), full[:k]), k
    assert torch.equal(mm(x, threads=2), full)
    assert torch.equal(mm(x[:0]), full[:0])


@needs_lib
def test_rows_of_zeros_and_wrong_inputs():
    qt = qtensor(T.Q4_0, 16, 64)
    mm = NativeMatmul(qt.q, qt.scale, qt.zero, qt.bits, LIB)
    x = torch.zeros(2, 64)
    x[1, 32:] = 1.0                                       # one block all zeros, one not
    ref = x.double() @ qt.dequantize().double().t()
    assert torch.allclose(mm(x).double(), ref, atol=1e-5)
    with pytest.raises(TypeError, match="float32"):
        mm(x.bfloat16())
    with pytest.raises(ValueError, match="blocks of 32"):
        NativeMatmul(torch.zeros(8, 40, dtype=torch.int16), torch.zeros(8, 1),
                     torch.zeros(8, 1), 4, LIB)


def test_a_build_is_reused_and_a_failed_one_says_why(tmp_path, monkeypatch):
    src = tmp_path / "k.c"
    src.write_text("int pd_one(void) { return 1; }\n")
    out = tmp_path / "cache"
    first = build((src,), out)
    stamp = first.stat().st_mtime_ns
    assert build((src,), out) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in out.iterdir()] == [first.name]   # no temporary left behind
    src.write_text("int pd_one(void) { return 2; }\n")
    assert build((src,), out) != first                           # new text, new library
    src.write_text("this is not C\n")
    with pytest.raises(RuntimeError, match="failed"):
        build((src,), out)
    assert len(list(out.iterdir())) == 2
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    src.write_text("int pd_two(void) { return 2; }\n")
    with pytest.raises((RuntimeError, OSError)):
        build((src,), out)


def test_the_choice_of_kernels(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "torch")
    assert chosen_kernels().lib is None and "torch" in chosen_kernels().why
    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="auto, native or torch"):
        chosen_kernels()
    monkeypatch.setenv(KERNELS_ENV, "native")
    if LIB is None:
        with pytest.raises(ValueError, match="unset it"):
            chosen_kernels()
    else:
        assert chosen_kernels().lib is not None
    monkeypatch.delenv(KERNELS_ENV)
    assert chosen_kernels() is native_kernels()


def test_a_cpu_without_avx2_gets_torchs_kernels(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: {"sse2"})
    native_kernels.cache_clear()
    try:
        found = native_kernels()
        assert found.lib is None and "avx2 and fma" in found.why
    finally:
        native_kernels.cache_clear()


def test_engines_starting_together_build_one_library(tmp_path):
    """Processes building at once (engines on one host) all end with the
    same working library."""
    code = ("import sys; from pathlib import Path; from pdserve.kernels.native import "
            "build, SOURCES; print(build(SOURCES, Path(sys.argv[1])))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outs) == 1 and [p.name for p in tmp_path.iterdir()] == [os.path.basename(outs.pop())]
