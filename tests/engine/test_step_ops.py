"""The decode step's small operations (issue 40): fewer torch calls, the
same numbers. The fused norm and the rolled rotary give the old formulas'
bits in float32 and bfloat16 alike; the CPU decode attention's float32
matmuls give a row the same output alone or in any batch."""

import pytest
import torch

from pdserve.kernels.attention import BatchMeta, SeqMeta, TorchAttention
from pdserve.kernels.models.model import rms_norm
from pdserve.kernels.models.model_config import tiny_config
from pdserve.kernels.models.rope import Rotary

DTYPES = [torch.float32, torch.bfloat16]


def six_op_rms_norm(x, weight, eps):
    """The norm as it was written before torch's fused kernel took it."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 576), (5, 3, 64)])
def test_the_fused_norm_gives_the_formula_bit_for_bit(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    for _ in range(4):
        x = (torch.randn(shape, generator=g) * 3).to(dtype)
        w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
        assert torch.equal(rms_norm(x, w, 1e-5), six_op_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rolled_rotary_gives_rotate_half_bit_for_bit(dtype):
    cfg = tiny_config()
    rot = Rotary(cfg, dtype, "cpu")
    positions = torch.tensor([0, 1, 7, 63, 200])
    cos, sin = rot.at(positions)
    x = torch.randn(len(positions), 6, cfg.head_dim, generator=torch.Generator().manual_seed(1)) \
        .to(dtype)
    half = cfg.head_dim // 2
    plain_sin = torch.cat((-sin[..., :half], sin[..., half:]), -1)     # the table unsigned
    want = x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * plain_sin
    assert torch.equal(rot.apply(x, cos, sin), want)


def decode_rows(attn, lengths, q, k, v, pages, ps=16):
    """One decode round over `lengths` of history, each row's pages its own;
    returns the attention output [rows, heads, d]."""
    k_pages, v_pages = pages
    seqs, slots, start = [], [], 0
    for i, n in enumerate(lengths):
        table = list(range(start, start + -(-n // ps)))
        start += len(table)
        seqs.append(SeqMeta(i, 1, n, table))
        slots.append(table[(n - 1) // ps] * ps + (n - 1) % ps)
    meta = BatchMeta(seqs, torch.tensor(slots), torch.tensor([n - 1 for n in lengths]),
                     num_decodes=len(lengths))
    return attn.forward(q, k, v, k_pages, v_pages, meta)


def test_bfloat16_decode_attention_gives_a_row_the_same_output_alone_or_in_a_batch():
    """The float32 matmuls are the CPU's choice, not the batch's: the first
    row's output is the same bits beside four others of other lengths."""
    h, kvh, d, ps = 9, 3, 64, 16
    attn = TorchAttention(h, kvh, d)
    g = torch.Generator().manual_seed(2)
    lengths = [37, 130, 5, 64, 201]
    pages = sum(-(-n // ps) for n in lengths)
    kv = [(torch.randn(pages, ps, kvh, d, generator=g)).to(torch.bfloat16) for _ in range(2)]
    q = torch.randn(len(lengths), h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(len(lengths), kvh, d, generator=g).to(torch.bfloat16)
    v = torch.randn(len(lengths), kvh, d, generator=g).to(torch.bfloat16)
    batch = decode_rows(attn, lengths, q, k, v, [t.clone() for t in kv])
    alone = decode_rows(attn, lengths[:1], q[:1], k[:1], v[:1], [t.clone() for t in kv])
    assert torch.equal(batch[:1], alone)
    # and it is the float32 reference's answer, rounded once to bfloat16
    ref = decode_rows(TorchAttention(h, kvh, d), lengths, q.float(), k.float(), v.float(),
                      [t.float() for t in kv])
    assert (batch.float() - ref).abs().max().item() < 2e-2
