"""pdserve's own CPU matmuls (kernels/cpu/matmul.c and .py): the product
of the file's exact blocks and 8-bit activation blocks, each row's bits
independent of its batch and of the thread count."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from pdserve.kernels.cpu.matmul import GROUP, NativeMatmul
from pdserve.kernels.cpu.native import native_kernels
from pdserve.kernels.cpu.quantized import from_blocks

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
    # times the scale's reciprocal in float32, as the kernel (x / d can
    # round the other way at a half)
    q = torch.where(d > 0, torch.round(xb * (1 / torch.where(d > 0, d, 1))), 0)
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


@pytest.mark.invariance
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


@needs_lib
@pytest.mark.parametrize("kind", [T.Q4_1, T.Q8_0])
def test_a_nan_in_a_row_makes_that_rows_products_nan(kind):
    """The block's largest magnitude would skip a NaN: the kernel gives the
    row NaN products, as a float matmul does, and leaves other rows alone."""
    qt = qtensor(kind, 16, 128)
    mm = NativeMatmul(qt.q, qt.scale, qt.zero, qt.bits, LIB)
    x = torch.randn(3, 128)
    clean = mm(x)
    for at in (0, 37, 127):
        x2 = x.clone()
        x2[1, at] = float("nan")
        y = mm(x2)
        assert y[1].isnan().all(), at
        assert torch.equal(y[0], clean[0]) and torch.equal(y[2], clean[2])


_PRODUCT = """
import sys, torch
from test_cpu_matmul import LIB, NativeMatmul, T, qtensor
out = []
for kind in (T.Q8_0, T.Q4_1, T.Q4_0):
    qt = qtensor(kind, 64, 576, seed=3)
    torch.manual_seed(0)
    out.append(NativeMatmul(qt.q, qt.scale, qt.zero, qt.bits, LIB)(torch.randn(11, 576) * 3, 1))
torch.save(out, sys.argv[1])
"""


@needs_lib
def test_vnni_and_avx2_give_the_same_bits(tmp_path):
    """Both dot products sum the same integers (VNNI's 8-bit weights biased
    by 128 and the bias taken back out of the sum, AVX2's signs moved onto
    the activations), then take the same float steps: PDSERVE_NO_VNNI
    changes the speed, never the bits (on a CPU without VNNI both runs
    take AVX2's path)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    outs = []
    for no_vnni in (False, True):
        env = {k: v for k, v in os.environ.items() if k != "PDSERVE_NO_VNNI"}
        if no_vnni:
            env["PDSERVE_NO_VNNI"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(Path(__file__).parent)])
        path = tmp_path / f"{no_vnni}.pt"
        subprocess.run([sys.executable, "-c", _PRODUCT, str(path)], env=env, check=True,
                       cwd=root, timeout=300)
        outs.append(torch.load(path))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
