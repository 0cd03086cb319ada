"""A dense weight's product in pdserve's order (kernels/cpu/dense.c): the
float64 product within float32's rounding, a bfloat16 weight exactly its
float32 widening, a row's bits whatever its batch, tile or the workers
sharing it, and a clear refusal of what it does not take."""

import pytest
import torch

from pdserve.kernels.cpu.matmul import dense_product, fits_dense
from pdserve.kernels.cpu.native import native_kernels, share_cores

LIB = native_kernels().lib
pytestmark = pytest.mark.skipif(LIB is None, reason=f"no native kernels: {native_kernels().why}")


def seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m,n,k", [(1, 49, 576), (5, 97, 64), (13, 960, 576), (40, 7, 1536)])
def test_the_product_is_the_float64_product_within_float32s_rounding(m, n, k):
    """Every tile shape (1 to 4 rows by 1 to 8 outputs, the ends of a work
    item) lands within a float32 sum's rounding of the exact product."""
    x, w = seeded(m, k, seed=m) * 3, seeded(n, k, seed=n)
    got = dense_product(x, w, LIB)
    want = x.double() @ w.double().T
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-6 * k ** 0.5 * want.abs().max()


def test_a_bfloat16_weight_is_its_float32_widening_exactly():
    """A bfloat16 weight is read as the float32 values it holds: the same
    bits as the product with the widened copy, not a bfloat16 product."""
    x, w = seeded(9, 192, seed=1), seeded(50, 192, seed=2).bfloat16()
    assert torch.equal(dense_product(x, w, LIB), dense_product(x, w.float(), LIB))
    assert torch.equal(dense_product(x.bfloat16(), w, LIB),
                       dense_product(x.bfloat16().float(), w, LIB))


@pytest.mark.invariance
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_are_its_own_whatever_its_batch_tile_or_workers(dtype):
    """A row has the same bits alone (a one-row tile of 8 outputs), in any
    slice of a batch (its place in a 4-row tile moves), and computed by
    one worker or two."""
    x, w = seeded(23, 576, seed=3), seeded(264, 576, seed=4).to(dtype)
    batched = dense_product(x, w, LIB, threads=1)
    for i in range(23):
        assert torch.equal(dense_product(x[i:i + 1], w, LIB)[0], batched[i]), i
    for start in range(1, 6):
        assert torch.equal(dense_product(x[start:], w, LIB), batched[start:]), start
    share_cores(2)                    # a helper to share the outputs with
    assert torch.equal(dense_product(x, w, LIB, threads=2), batched)


def test_what_it_does_not_take_is_refused_by_name():
    """k not a multiple of 8, a float16 weight, a 1-D one: a ValueError
    that names the weight; QuantizedLinear takes torch's path for them."""
    x = torch.ones(2, 12)
    for w in (torch.ones(4, 12), torch.ones(4, 16, dtype=torch.float16), torch.ones(16)):
        assert not fits_dense(w)
        with pytest.raises(ValueError, match="pd_linear_dense takes a float32 or bfloat16"):
            dense_product(x, w, LIB)
    assert fits_dense(torch.ones(4, 16)) and fits_dense(torch.ones(4, 16, dtype=torch.bfloat16))
