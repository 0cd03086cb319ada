"""A GGUF's quantized weights kept quantized on CPU (kernels/cpu/quantized.py):
the file's blocks read exactly, the kernels' products against the
dequantized weights, the loader's choice and its refusals."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from pdserve.config import ConfigError, ServeConfig
from pdserve.kernels.cpu.native import KERNELS_ENV, native_kernels
from pdserve.kernels.models.gguf import unpermute_rotary
from pdserve.kernels.models.model_config import ModelError
from pdserve.kernels.cpu.quantized import (
    QuantizedLinear, QuantizedTensor, choose_quantization, from_blocks, fuse,
    linear)


needs_lib = pytest.mark.skipif(native_kernels().lib is None,
                               reason=f"pdserve's kernels do not run here: {native_kernels().why}")


def blocks(kind: T, rows: int = 48, cols: int = 96, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(w, kind)
    return raw, from_blocks(raw, kind.name, rows, cols)


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    """Each kernel test twice: pdserve's own kernels (kernels/cpu/matmul.py)
    and torch's weight-only ones (where the native ones cannot run)."""
    if request.param == "native" and native_kernels().lib is None:
        pytest.skip(f"pdserve's kernels do not run here: {native_kernels().why}")
    monkeypatch.setenv(KERNELS_ENV, request.param)
    return request.param


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_blocks_read_as_the_file_holds_them(kind):
    raw, qt = blocks(kind)
    assert torch.equal(qt.dequantize(), torch.from_numpy(dequantize(raw, kind)))
    assert qt.bits == (8 if kind == T.Q8_0 else 4)
    if qt.bits == 4:
        assert int(qt.q.min()) >= 0 and int(qt.q.max()) <= 15


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind,tol", [(T.Q4_0, 0.01), (T.Q4_1, 0.01), (T.Q8_0, 0.03)])
def test_the_kernels_multiply_what_the_file_holds(kind, tol, dtype, kernels):
    """The product against the dequantized weights: 4 bits differ only by
    the rounding of the group scales and of the inputs (to bfloat16 for
    torch's kernels, to 8-bit blocks for pdserve's); torch's 8 bits are
    requantized per row, a coarser grid. Inputs of either dtype."""
    raw, qt = blocks(kind)
    # seeded: 8-bit activation blocks put about 1 input in 700 past 1% (a flaky test)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)).to(dtype)
    ref = x.float() @ qt.dequantize().t()
    y = linear(x, QuantizedLinear(qt, dtype))
    assert y.dtype == dtype
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol
    # the plain bfloat16 path is no closer than 4 bits by more than the rounding
    dense_err = ((x.bfloat16() @ qt.dequantize().bfloat16().t()).float() - ref).abs().max() / \
        ref.abs().max()
    assert err < max(4 * dense_err.item(), tol)


@pytest.mark.invariance
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", [T.Q4_1, T.Q8_0])
def test_prefill_rows_take_the_dense_copy_and_a_decode_row_is_the_same_in_any_batch(kind, dtype,
                                                                                    kernels):
    """The split is by kind of row, never by the round's size: the first
    dense_rows rows (prefill chunks) multiply the dense copy, the rest the
    kernel, and a row's kernel product has the same bits alone, among 64
    rows, or after a prefill chunk."""
    _, qt = blocks(kind)
    lin = QuantizedLinear(qt, dtype)
    assert (lin.native is not None) == (kernels == "native")
    dense = qt.dequantize().to(dtype)
    assert torch.equal(lin.dense, dense)
    x = torch.randn(64, 96).to(dtype)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(64)])
    assert torch.equal(lin(x), alone)
    prefill = lin(x, dense_rows=64)
    ref = x.double() @ dense.double().t()
    assert ((prefill.double() - ref).abs().max() / ref.abs().max()).item() < \
        (1e-6 if dtype == torch.float32 else 1e-2)
    mixed = lin(x, dense_rows=40)
    assert torch.equal(mixed[40:], alone[40:])
    if kernels == "native":     # pdserve's order: a prefill row's bits are its own
        assert torch.equal(mixed[:40], prefill[:40])


@needs_lib
@pytest.mark.parametrize("dtype,packed", [(torch.float32, False), (torch.bfloat16, False),
                                          (torch.bfloat16, True)])
@pytest.mark.invariance
@pytest.mark.parametrize("rows,cols", [(960, 576), (576, 1536), (40, 64)])
def test_a_prefill_rows_bits_do_not_depend_on_the_rows_beside_it(rows, cols, dtype, packed):
    """A prefill row's dense product is computed on its own, in an order
    pdserve's kernels fix (cpu/dense.c; cpu/bf16.c when packed): the same
    bits among 1 to 40 rows, at any offset, at SmolLM2's shapes and a
    small one, whatever BLAS and instruction set the CPU has."""
    lib = native_kernels().lib
    if packed and not lib.pd_has_bf16():
        pytest.skip("this CPU lacks AVX512-BF16 (or PDSERVE_NO_BF16 is set): nothing to pack")
    _, qt = blocks(T.Q4_1, rows=rows, cols=cols)
    lin = QuantizedLinear(qt, dtype)
    if packed:
        lin.use_bf16(lib)
    assert "pdserve's order" in lin.prompt_path()
    x = torch.randn(40, cols).to(dtype)
    full = lin(x, dense_rows=40)
    for k in range(1, 40):
        assert torch.equal(lin(x[:k], dense_rows=k), full[:k]), k
        assert torch.equal(lin(x[k:], dense_rows=40 - k), full[k:]), k


def test_where_pdserves_kernels_do_not_run_torch_multiplies_prompt_rows_and_says_so(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "torch")
    _, qt = blocks(T.Q4_1)
    lin = QuantizedLinear(qt, torch.float32)
    assert lin.prompt_path() == "torch's BLAS (a row's bits may depend on its round)"
    x = torch.randn(8, 96)
    assert torch.allclose(lin(x, dense_rows=8), x @ qt.dequantize().t(), atol=1e-5)


def test_rows_permute_and_fuse_as_tensors_do():
    _, a = blocks(T.Q4_1, rows=32, seed=1)
    _, b = blocks(T.Q4_1, rows=16, seed=2)
    perm = unpermute_rotary(torch.arange(32), 4)
    assert torch.equal(a.rows(perm).dequantize(), unpermute_rotary(a.dequantize(), 4))
    fused = fuse([a, b], torch.bfloat16, "cpu")
    assert isinstance(fused, QuantizedLinear) and fused.out_features == 48
    x = torch.randn(3, 96).bfloat16()
    both = torch.cat([QuantizedLinear(a, torch.bfloat16)(x),
                      QuantizedLinear(b, torch.bfloat16)(x)], 1)
    assert torch.allclose(fused(x).float(), both.float(), atol=1e-2)
    # widths that differ fall back to one dense matmul
    _, c = blocks(T.Q8_0, rows=16, seed=3)
    mixed = fuse([a, c], torch.bfloat16, "cpu")
    assert isinstance(mixed, torch.Tensor)
    assert torch.equal(mixed, torch.cat([a.dequantize(), c.dequantize()]).bfloat16())
    with pytest.raises(ValueError, match="different widths"):
        QuantizedTensor.cat([a, c])


def test_the_choice_and_its_refusals(monkeypatch):
    keep, why = choose_quantization("gguf", "Q4_1, Q8_0", "cpu", torch.bfloat16)
    assert keep and "Q4_1, Q8_0" in why
    # auto keeps them wherever the kernels run, in either dtype, and says so
    # with whose kernels
    monkeypatch.setenv(KERNELS_ENV, "torch")
    for dtype in (torch.bfloat16, torch.float32):
        assert choose_quantization("auto", "Q4_1, Q8_0", "cpu", dtype) == \
            (True, "auto: Q4_1, Q8_0 tensors multiplied quantized (torch's int4/int8 kernels; "
                   "pdserve's do not run here: PDSERVE_CPU_KERNELS is torch) for decode rows, "
                   "a dense copy for prefill rows outside pdserve's C layers")
    monkeypatch.delenv(KERNELS_ENV)
    if native_kernels().lib is not None:
        assert choose_quantization("auto", "Q4_1, Q8_0", "cpu", torch.float32) == \
            (True, "auto: Q4_1, Q8_0 tensors multiplied quantized (pdserve's AVX2 kernels) for "
                   "decode rows, a dense copy for prefill rows outside pdserve's C layers")
    # ... and dequantizes, saying why, where they cannot
    keep, why = choose_quantization("auto", "Q4_1", "cuda", torch.bfloat16)
    assert not keep and why.startswith("auto: dequantized, since the model runs on cuda")
    assert choose_quantization("auto", "Q4_1", "cpu", torch.bfloat16, tp_size=2)[0] is False
    assert choose_quantization("auto", None, "cpu", torch.float32) == \
        (False, "auto: no tensors to keep quantized")
    assert choose_quantization("none", "Q4_1", "cpu", torch.bfloat16) == \
        (False, "model.quantization is none")
    with pytest.raises(ValueError, match="dtype is float16.*bfloat16 or float32"):
        choose_quantization("gguf", "Q4_1", "cpu", torch.float16)
    with pytest.raises(ValueError, match=r"no Q4_0, Q4_1 or Q8_0 tensors \(it has Q5_K\)"):
        choose_quantization("gguf", "Q5_K", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match=r"runs on cuda.*tensor_parallel_size is 2.*use "
                                         r"model.quantization: none or auto"):
        choose_quantization("gguf", "Q4_1", "cuda", torch.bfloat16, tp_size=2)
    with pytest.raises(ValueError, match="no Q4_0, Q4_1 or Q8_0 tensors"):
        choose_quantization("gguf", None, "cpu", torch.bfloat16)


def test_config_names_the_key():
    assert ServeConfig.from_dict({"model": {"quantization": "gguf"}}).model.quantization == \
        "gguf"
    with pytest.raises(ConfigError, match="model.quantization is 'int3'; use one of auto, "
                                          "none, gguf"):
        ServeConfig.from_dict({"model": {"quantization": "int3"}})


def test_a_float_checkpoint_refuses_gguf_at_load():
    from pdserve.kernels.models.loader import load_model

    with pytest.raises(ModelError, match="no Q4_0, Q4_1 or Q8_0 tensors"):
        load_model(None, "tiny", quantization="gguf")
