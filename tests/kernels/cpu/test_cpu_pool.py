"""The threads pdserve's CPU kernels share work among (kernels/cpu/pool.c):
helpers that take part give the same bits as the caller alone, two
callers at once each get their own answer, and a forked child computes
alone."""

import multiprocessing
import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from pdserve.kernels.attention import BatchMeta, SeqMeta, decode_spans
from pdserve.kernels.cpu.attention import decode_attention
from pdserve.kernels.cpu.matmul import NativeMatmul
from pdserve.kernels.cpu.native import native_kernels, share_cores
from pdserve.kernels.cpu.quantized import from_blocks

LIB = native_kernels().lib
pytestmark = pytest.mark.skipif(LIB is None, reason=f"no native kernels: {native_kernels().why}")
TRIES = 200     # calls a helper gets to take part in: each is milliseconds of work


@pytest.fixture(scope="module")
def matmul():
    share_cores(2)
    w = np.random.default_rng(0).standard_normal((4096, 576)).astype(np.float32)
    qt = from_blocks(quantize(w, T.Q4_1), "Q4_1", 4096, 576)
    return NativeMatmul(qt.q, qt.scale, qt.zero, qt.bits, LIB)


def until_helped(call):
    """call() until a helper has computed part of one; every result."""
    before, out = LIB.pd_pool_helped(), []
    for _ in range(TRIES):
        out.append(call())
        if LIB.pd_pool_helped() > before:
            return out
    raise AssertionError(f"no helper took part in {TRIES} calls")


def test_shared_work_has_the_callers_bits(matmul):
    assert LIB.pd_pool_workers() >= 2
    x = torch.randn(9, 576)
    alone = matmul(x, threads=1)
    for y in until_helped(lambda: matmul(x)):
        assert torch.equal(y, alone)


def test_shared_attention_has_the_callers_bits():
    share_cores(2)
    torch.manual_seed(0)
    ps, kvh, d, B = 16, 2, 64, 12
    pages = torch.randn(B * 8, ps, kvh, d), torch.randn(B * 8, ps, kvh, d)
    seqs = [SeqMeta(b, 1, 60 + 6 * b, list(range(b * 8, b * 8 + 8))) for b in range(B)]
    meta = BatchMeta(seqs, torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long),
                     num_decodes=B)
    tables, base, begin, end = decode_spans(meta.seqs, ps, None)
    q = torch.randn(B, 6, d)

    def run(threads=0):
        return decode_attention(LIB, q, *pages, tables, base, begin, end, 0.125, None, threads)
    alone = run(1)
    for y in until_helped(run):
        assert torch.equal(y, alone)


def test_two_callers_at_once_each_get_their_own_answer(matmul):
    xs = [torch.randn(5, 576) for _ in range(2)]
    want = [matmul(x, threads=1) for x in xs]
    got: list[list] = [[], []]

    def call(i):
        for _ in range(30):
            got[i].append(matmul(xs[i]))
    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert len(got[i]) == 30 and all(torch.equal(y, want[i]) for y in got[i])


def _in_child(matmul, x, q):
    q.put(matmul(x).numpy())


def test_a_forked_child_computes_without_the_parents_helpers(matmul):
    x = torch.randn(7, 576)
    until_helped(lambda: matmul(x))                 # the helpers run in this process
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_in_child, args=(matmul, x, q))
    p.start()
    y = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert np.array_equal(y, matmul(x, threads=1).numpy())
