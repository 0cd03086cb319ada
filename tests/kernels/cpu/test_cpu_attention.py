"""pdserve's CPU decode attention (kernels/cpu/attention.c and .py) against
torch's path in TorchAttention: the same outputs for every kind of decode
row (grouped query heads, sliding windows, a window's first page, softcaps,
bfloat16 pages, a layer's strided view of the cache), and each row's bits
independent of its batch (of the threads: test_cpu_pool.py)."""

import random

import pytest
import torch

from pdserve.kernels.attention import BatchMeta, SeqMeta, TorchAttention
from pdserve.kernels.cpu.native import native_kernels

pytestmark = pytest.mark.skipif(native_kernels().lib is None,
                                reason=f"no native kernels: {native_kernels().why}")
PS, KVH, D = 16, 2, 64


def decode_round(ctxs, window=None, starts=None, seed=0):
    """A decode round over `ctxs` tokens of history each, the pages of
    every sequence shuffled through a cache of 3 layers; (meta, q, k, v,
    k_pages, v_pages) for layer 1, a strided view as KVCache.layer gives."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    per = [-(-c // PS) for c in ctxs]
    pages = list(range(sum(per) + 3))
    rng.shuffle(pages)
    data = torch.randn(len(pages), 3, 2, PS, KVH, D)
    seqs, slots, at = [], [], 0
    for i, (c, n) in enumerate(zip(ctxs, per)):
        table = pages[at:at + n]
        at += n
        start = starts[i] if starts else 0
        # a sliding group's table holds HOLEs (-1 here: never read) below kv_start's page
        table = [-1] * (start // PS) + table[start // PS:]
        seqs.append(SeqMeta(i, 1, c, table, kv_start=start))
        slots.append(table[(c - 1) // PS] * PS + (c - 1) % PS)
    meta = BatchMeta(seqs, torch.tensor(slots), torch.tensor([c - 1 for c in ctxs]),
                     num_decodes=len(ctxs), window=window)
    B = len(ctxs)
    q = torch.randn(B, 6, D)
    k, v = torch.randn(B, KVH, D), torch.randn(B, KVH, D)
    return meta, q, k, v, data[:, 1, 0], data[:, 1, 1]


def both(meta_args, dtype=torch.float32, softcap=None, **kw):
    """(native, torch) outputs of one round."""
    outs = []
    for native in (True, False):
        meta, q, k, v, kp, vp = decode_round(**meta_args)
        attn = TorchAttention(6, KVH, D, sliding_window=meta.window, softcap=softcap)
        if not native:
            attn._native = None
        outs.append(attn.forward(q.to(dtype), k.to(dtype), v.to(dtype), kp.to(dtype),
                                 vp.to(dtype), meta))
    return outs


@pytest.mark.parametrize("ctxs", [[1], [37], [16, 300, 5, 64]])
def test_the_same_outputs_as_torchs_path(ctxs):
    native, ref = both({"ctxs": ctxs})
    assert torch.allclose(native, ref, atol=2e-6, rtol=1e-5)
    if max(ctxs) > 16:
        assert not torch.equal(native, ref)          # two paths: other roundings


def test_a_sliding_window_and_its_first_page():
    ctxs = [100, 40, 200]
    native, ref = both({"ctxs": ctxs, "window": 32, "starts": [64, 0, 160]})
    assert torch.allclose(native, ref, atol=2e-6, rtol=1e-5)


def test_softcap_and_bfloat16_pages():
    native, ref = both({"ctxs": [50, 129]}, softcap=5.0)
    assert torch.allclose(native, ref, atol=2e-6, rtol=1e-5)
    native, ref = both({"ctxs": [50, 129]}, dtype=torch.bfloat16)
    assert native.dtype == torch.bfloat16
    # both compute in float32 and round to bfloat16: at most one step apart
    assert ((native.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-6).all()


@pytest.mark.invariance
def test_a_rows_bits_do_not_depend_on_its_batch():
    ctxs = [33, 250, 7, 128, 64]
    meta, q, k, v, kp, vp = decode_round(ctxs)
    attn = TorchAttention(6, KVH, D)
    full = attn.forward(q, k, v, kp, vp, meta)
    for i, c in enumerate(ctxs):
        m1, _, _, _, kp1, vp1 = decode_round([c], seed=0)
        # the same row alone: its own pages, the same query, key and values
        kp1[:], vp1[:] = 0, 0
        s = meta.seqs[i]
        for j, page in enumerate(s.block_table):
            kp1[m1.seqs[0].block_table[j]] = kp[page]
            vp1[m1.seqs[0].block_table[j]] = vp[page]
        alone = TorchAttention(6, KVH, D).forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], kp1, vp1,
                                                  m1)
        assert torch.equal(alone[0], full[i]), i
