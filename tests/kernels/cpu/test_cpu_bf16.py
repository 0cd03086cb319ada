"""A prompt's rows multiplied in bfloat16 (kernels/cpu/bf16.c): the
products of the rounded operands, a row's bits whatever its batch or the
workers sharing it, and a clear refusal where the CPU lacks AVX512-BF16."""

import os
import subprocess
import sys

import pytest
import torch

from pdserve.kernels.cpu.matmul import COLS, pack_bf16
from pdserve.kernels.cpu.native import native_kernels

LIB = native_kernels().lib
needs_bf16 = pytest.mark.skipif(LIB is None or not LIB.pd_has_bf16(),
                                reason="this CPU has no AVX512-BF16 (or no native kernels)")


def product(x: torch.Tensor, packed: torch.Tensor, rows: int, threads: int = 0) -> torch.Tensor:
    y = torch.full((x.shape[0], rows), float("nan"))
    assert LIB.pd_linear_bf16(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), rows,
                              y.data_ptr(), threads) == 0
    return y


@needs_bf16
@pytest.mark.parametrize("n,k", [(960, 576), (100, 64), (8, 1536)])
def test_the_product_is_the_rounded_operands_product(n, k):
    """bf16(x) . w^T in float32 sums: within float32's rounding of a
    float64 sum of the same bfloat16 operands, every padded column too."""
    rows = -(-n // COLS) * COLS
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(k)) * 3
    got = product(x, pack_bf16(w, rows), rows)
    want = x.bfloat16().double() @ w.double().T
    assert (got[:, :n].double() - want).abs().max() < 1e-5 * want.abs().max()
    assert torch.equal(got[:, n:], torch.zeros(13, rows - n))


@pytest.mark.invariance
@needs_bf16
def test_a_row_has_the_same_bits_alone_batched_and_on_two_workers():
    n, k = 264, 576
    w = pack_bf16(torch.randn(n, k, generator=torch.Generator().manual_seed(1)).bfloat16(), n)
    x = torch.randn(23, k, generator=torch.Generator().manual_seed(2))
    batched = product(x, w, n)
    one = product(x[7:8].clone(), w, n, threads=1)
    assert torch.equal(one[0], batched[7])
    assert torch.equal(product(x, w, n, threads=1), batched)
    assert torch.equal(product(x[:6].clone(), w, n), batched[:6])      # one whole tile


@pytest.mark.skipif(LIB is None, reason="no native kernels")
def test_without_bf16_the_kernel_refuses_and_says_so():
    """PDSERVE_NO_BF16 stands in for a CPU without the instructions: the
    kernel reports it and returns -1 rather than computing anything."""
    code = ("import torch\nfrom pdserve.kernels.cpu.native import native_kernels\n"
            "lib = native_kernels().lib\nx, y = torch.ones(1, 64), torch.zeros(1, 8)\n"
            "w = torch.ones(8 * 64, dtype=torch.bfloat16)\n"
            "print(lib.pd_has_bf16(), lib.pd_linear_bf16(x.data_ptr(), 1, 64, w.data_ptr(), 8, "
            "y.data_ptr(), 0), float(y.sum()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PDSERVE_NO_BF16": "1"}, timeout=120)
    assert out.stdout.split() == ["0", "-1", "0.0"], out.stderr


@needs_bf16
def test_a_linear_trades_its_dense_copy_for_the_packed_one():
    """use_bf16 keeps one bfloat16 copy of a weight: the rows that took the
    dense copy (prefill rows outside the C layers) multiply the packed one,
    giving what torch's bfloat16 product gives, to bfloat16's rounding."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    from pdserve.kernels.cpu.quantized import QuantizedLinear, from_blocks

    n, k = 200, 256
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    lin = QuantizedLinear(from_blocks(quantize(w, T.Q4_1), "Q4_1", n, k), torch.bfloat16)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    before = lin.dense_product(x)
    packed = lin.use_bf16(LIB)
    assert lin.dense is None and lin.bf16 is packed
    after = lin.dense_product(x)
    assert after.dtype == torch.bfloat16 and after.shape == (5, n)
    assert (after.float() - before.float()).abs().max() < 0.01 * before.float().abs().max()
