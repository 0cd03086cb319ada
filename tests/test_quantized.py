"""A GGUF's quantized weights kept quantized on CPU (kernels/quantized.py):
the file's blocks read exactly, the kernels' products against the
dequantized weights, the loader's choice and its refusals."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from pdserve.config import ConfigError, ServeConfig
from pdserve.kernels.gguf import unpermute_rotary
from pdserve.kernels.model_config import ModelError
from pdserve.kernels.quantized import (
    QuantizedLinear, QuantizedTensor, choose_quantization, from_blocks, fuse, linear)


def blocks(kind: T, rows: int = 48, cols: int = 96, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(w, kind)
    return raw, from_blocks(raw, kind.name, rows, cols)


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_blocks_read_as_the_file_holds_them(kind):
    raw, qt = blocks(kind)
    assert torch.equal(qt.dequantize(), torch.from_numpy(dequantize(raw, kind)))
    assert qt.bits == (8 if kind == T.Q8_0 else 4)
    if qt.bits == 4:
        assert int(qt.q.min()) >= 0 and int(qt.q.max()) <= 15


@pytest.mark.parametrize("kind,tol", [(T.Q4_0, 0.01), (T.Q4_1, 0.01), (T.Q8_0, 0.03)])
def test_the_kernels_multiply_what_the_file_holds(kind, tol):
    """The product against the dequantized weights: 4 bits differ only by
    the group scales' bfloat16 rounding (and the input's); 8 bits are
    requantized per row, a coarser grid."""
    raw, qt = blocks(kind)
    x = torch.randn(5, 96).bfloat16()
    ref = x.float() @ qt.dequantize().t()
    y = linear(x, QuantizedLinear(qt, torch.bfloat16, max_rows=8)).float()
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    assert err < tol
    # the plain bfloat16 path is no closer than 4 bits by more than the rounding
    dense_err = ((x @ qt.dequantize().bfloat16().t()).float() - ref).abs().max() / \
        ref.abs().max()
    assert err < max(4 * dense_err.item(), tol)


def test_a_batch_past_max_rows_multiplies_the_bfloat16_copy():
    """The kernels' cost grows with the rows faster than a bfloat16
    matmul's: more than max_rows rows (a prefill chunk) take the copy."""
    _, qt = blocks(T.Q4_1)
    lin = QuantizedLinear(qt, torch.bfloat16, max_rows=4)
    dense = qt.dequantize().bfloat16()
    assert torch.equal(lin.dense, dense)
    many, few = torch.randn(5, 96).bfloat16(), torch.randn(4, 96).bfloat16()
    assert torch.equal(lin(many), torch.nn.functional.linear(many, dense))
    kernel = torch._weight_int4pack_mm_for_cpu(few, lin.packed, 32, lin.scales)
    assert torch.equal(lin(few), kernel)


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


def test_the_choice_and_its_refusals():
    keep, why = choose_quantization("gguf", "Q4_1, Q8_0", "cpu", torch.bfloat16)
    assert keep and "Q4_1, Q8_0" in why
    # auto dequantizes: kept weights would make a request's tokens depend on its batch
    assert choose_quantization("auto", "Q4_1, Q8_0", "cpu", torch.bfloat16) == \
        (False, "auto: dequantized (model.quantization: gguf multiplies the Q4_1, Q8_0 "
                "tensors as stored)")
    assert choose_quantization("none", "Q4_1", "cpu", torch.bfloat16) == \
        (False, "model.quantization is none")
    with pytest.raises(ValueError, match="dtype is float32"):
        choose_quantization("gguf", "Q4_1", "cpu", torch.float32)
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
    from pdserve.kernels.loader import load_model

    with pytest.raises(ModelError, match="no Q4_0, Q4_1 or Q8_0 tensors"):
        load_model(None, "tiny", quantization="gguf")
