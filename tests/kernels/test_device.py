"""The CUDA path: flashinfer's attention against the torch reference, row
by row; kernels compiled at load; the page-locked host cache; sampling
with no per-row sync; KV pools in GPU memory over NIXL.

Tests marked `device` need a CUDA GPU: `pytest -m device tests/kernels/test_device.py`
(tools/gpu/run_device_checks.sh runs them on a bare GPU host). This module
imports neither ray nor transformers, so it collects wherever torch is. The
unmarked tests run the same checks on CPU against the flashinfer stand-in
(tests/support/flashinfer_fake.py), so CI exercises them too.
"""

import logging
import sys
import warnings

import pytest
import torch

from pdserve.kernels.flashinfer_attention import FlashInferAttention
from pdserve.kernels.models.model_config import ModelError
from support import flashinfer_fake
from support import teacher_forced as tf

cuda = pytest.mark.device


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """The stand-in as `flashinfer`, told to allow float32 (exact
    comparisons on CPU; the real library has no float32 kernels)."""
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_fake)
    monkeypatch.setattr(flashinfer_fake, "DTYPES",
                        [torch.float32, torch.float16, torch.bfloat16])
    return flashinfer_fake


SHAPE = dict(num_heads=8, num_kv_heads=2, head_dim=128, sliding_window=None)


# ---- on CPU, against the stand-in ----------------------------------------------

@pytest.mark.parametrize("case", [tf.Case(torch.float32, 1), tf.Case(torch.float32, 8, 24),
                                  tf.Case(torch.bfloat16, 3, 24)], ids=lambda c: c.name)
def test_each_row_s_logits_match_the_reference_through_the_stand_in(fake_flashinfer, case):
    report = tf.check(case, "cpu", FlashInferAttention)
    assert report.ok, report.summary()


def test_the_row_check_catches_a_window_one_key_too_wide(fake_flashinfer):
    report = tf.check(tf.Case(torch.float32, 2, 24), "cpu", tf.WindowOffByOne)
    assert not report.ok and report.test_max > 100 * report.tol, report.summary()


def test_the_row_check_s_schedule_reaches_every_path_the_engine_takes():
    """1-row and >64-row first chunks, >64-row chunks over cached pages,
    mixed rounds with a prefill of each kind, decode-only rounds, decodes
    crossing a page boundary and contexts past the window."""
    done = dict.fromkeys(tf.PROMPTS, 0)
    first, cached, mixed_first, mixed_cached, decode_only, crossings = set(), set(), 0, 0, 0, 0
    for _, prefills, decodes in tf.SCHEDULE:
        for name, n in prefills:
            (first if done[name] == 0 else cached).add(n)
            if decodes:
                mixed_first += done[name] == 0
                mixed_cached += done[name] > 0
            done[name] += n
        for name in decodes:
            crossings += done[name] % tf.PAGE == 0
            done[name] += 1
        decode_only += not prefills and bool(decodes)
    assert done == {k: n + sum(k in d for _, _, d in tf.SCHEDULE) for k, n in tf.PROMPTS.items()}
    assert 1 in first and max(first) > 64 and max(cached) > 64 and min(cached) < 64
    assert mixed_first and mixed_cached and decode_only >= 3 and crossings >= 2
    assert max(done.values()) > 4 * 24                       # well past the window


def test_warm_up_plans_a_1_row_and_a_long_prefill_and_a_decode_on_fa2(fake_flashinfer):
    att = FlashInferAttention(**SHAPE)
    ran = att.warm_up(torch.bfloat16, "cpu")
    assert att._prefill_w.backend == "fa2"
    assert 1 in att._prefill_w.planned_rows and max(att._prefill_w.planned_rows) > 64
    assert att._decode_w.plans >= 2 and len(ran) == 4
    assert att._planned is None                # the next round plans afresh


def test_a_flashinfer_model_s_decode_step_is_captured_on_cuda_only(fake_flashinfer,
                                                                    monkeypatch):
    """flashinfer's decode is captured as CUDA graphs (its wrappers in
    graph mode, planned before each replay); elsewhere it runs eagerly,
    never compiled."""
    from pdserve.kernels.capture import CaptureMode, choose_capture
    from pdserve.kernels.models.loader import load_model

    model, _ = load_model(None, "tiny", dtype="float32", attention="torch")
    assert choose_capture("on", model)[0] is CaptureMode.COMPILE
    model.attention = FlashInferAttention(num_heads=4, num_kv_heads=2, head_dim=16)
    assert choose_capture("on", model) == (CaptureMode.OFF,
                                           "flashinfer's decode is captured on CUDA only")
    monkeypatch.setattr(model, "device", torch.device("cuda"))
    assert choose_capture("auto", model)[0] is CaptureMode.CUDA_GRAPH


def test_the_loader_compiles_at_load_and_auto_falls_back_if_the_build_fails(
        fake_flashinfer, monkeypatch, caplog):
    from pdserve.kernels.models import loader

    monkeypatch.setattr(loader, "choose_backend", lambda name, device, dtype, **kw: (
        FlashInferAttention(**kw), "the stand-in"))
    with caplog.at_level(logging.INFO, logger="pdserve.kernels"):
        assert loader.load_backend("auto", "cpu", torch.bfloat16, SHAPE).name == "flashinfer"
    assert "attention flashinfer (the stand-in; kernels compiled or loaded from cache at " \
           "load (prefill 1 row, prefill 65 rows, decode, prefill + decode))" in caplog.text

    def broken(self, dtype, device, page_size=16):
        raise RuntimeError("ninja: build stopped: subcommand failed")

    monkeypatch.setattr(FlashInferAttention, "warm_up", broken)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pdserve.kernels"):
        assert loader.load_backend("auto", "cuda", torch.bfloat16, SHAPE).name == "torch"
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "auto fell back to torch: RuntimeError while compiling flashinfer: ninja" \
        in caplog.text
    with pytest.raises(ModelError, match="flashinfer kernels failed to build or run at load"):
        loader.load_backend("flashinfer", "cuda", torch.bfloat16, SHAPE)


def test_a_model_logs_the_attention_and_dtype_it_chose_and_why(caplog):
    from pdserve import LLM

    with caplog.at_level(logging.INFO, logger="pdserve.kernels"):
        LLM()
    assert "model on cpu: dtype float32 (auto: float32, the checkpoint names no dtype); " \
           "attention torch (auto on cpu: flashinfer runs on CUDA only)" in caplog.text


def test_auto_on_cuda_says_why_it_fell_back(fake_flashinfer):
    from pdserve.kernels.backends import choose_backend

    backend, why = choose_backend("auto", "cuda", torch.float32, **SHAPE)
    assert backend.name == "torch"
    assert why == "auto fell back to torch: flashinfer has no float32 kernels; " \
                  "set model.dtype to bfloat16 or float16"


# ---- on CUDA --------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("case", tf.DEVICE_CASES, ids=lambda c: c.name)
def test_flashinfer_logits_match_the_reference_row_by_row_with_no_sync_per_layer(case):
    report = tf.check(case, "cuda", FlashInferAttention, no_sync=True)
    assert report.ok, report.summary()


@cuda
def test_the_row_check_catches_a_window_one_key_too_wide_on_cuda():
    report = tf.check(tf.Case(torch.bfloat16, 2, 24), "cuda", tf.WindowOffByOne)
    assert not report.ok, report.summary()


@cuda
def test_flashinfer_compiles_at_load_on_cuda(caplog):
    from pdserve.kernels.models.loader import load_backend

    with caplog.at_level(logging.INFO, logger="pdserve.kernels"):
        backend = load_backend("auto", "cuda", torch.bfloat16, SHAPE)
    assert backend.name == "flashinfer", caplog.text
    assert "kernels compiled or loaded from cache at load" in caplog.text


@cuda
def test_an_engine_serves_through_flashinfer_on_cuda_with_retraction_and_a_host_cache(tmp_path):
    from pdserve import LLM, SamplingParams

    case = tf.Case(torch.bfloat16, 4)
    tf.write_checkpoint(case, tmp_path)
    llm = LLM({"model": {"path": str(tmp_path), "device": "cuda"},
               "engine": {"page_size": 16, "total_pages": 48, "safe_steps": 4,
                          "host_pages": 256, "max_scheduled_tokens": 128}})
    assert llm.model.attention.name == "flashinfer" and llm.model.dtype == torch.bfloat16
    assert llm.executor.host.data.is_pinned()
    retracts = 0
    step = llm.engine.step

    def counting():
        nonlocal retracts
        out = step()
        retracts += len(out.plan.retracts) if out else 0
        return out

    llm.engine.step = counting
    prompts = [[(7 * i + j) % 250 + 1 for j in range(70 + 37 * i)] for i in range(6)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                  SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9,
                                                 top_k=40, seed=3, ignore_eos=True)] * 3,
                        use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [24] * 6
    assert retracts > 0
    llm.engine.planner.assert_idle()


@cuda
def test_a_sliding_window_model_serves_through_flashinfer_with_its_own_cache_group(tmp_path):
    """Mistral-style, every layer windowed (24): one sliding cache group,
    flashinfer's window_left over the window's pages only, chunked prefill,
    prefix hits and retraction; the group never holds more than its window,
    a chunk and the decode slot."""
    from pdserve import LLM, SamplingParams
    from pdserve.scheduler.cache.groups import HOLE
    from pdserve.scheduler.capacity import sliding_request_pages

    case = tf.Case(torch.bfloat16, 4, 24)
    tf.write_checkpoint(case, tmp_path)
    engine = {"page_size": 16, "total_pages": 64, "sliding_pages": 24, "safe_steps": 4,
              "host_pages": 128, "max_scheduled_tokens": 128}
    llm = LLM({"model": {"path": str(tmp_path), "device": "cuda"}, "engine": engine})
    (group,) = llm.engine.planner.groups
    assert group.sliding and group.window == 24 and llm.model.attention.name == "flashinfer"
    peak, step = 0, llm.engine.step

    def watching():
        nonlocal peak
        out = step()
        if out:
            for req in [op.req for op in out.plan.prefills] + list(out.plan.decodes):
                if req.state.holds_pages:
                    peak = max(peak, sum(p != HOLE for p in req.state.res.tables[0]))
        return out

    llm.engine.step = watching
    prompts = [[(5 * i + j) % 250 + 1 for j in range(300 + 41 * i)] for i in range(4)]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    again = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]   # prefix hits
    # bfloat16 over other batch shapes may round a greedy choice apart: lengths only
    assert [len(t) for t in first] == [len(t) for t in again] == [40] * 4
    assert 0 < peak <= sliding_request_pages(llm.engine_config, 24, 128)
    llm.engine.planner.assert_idle()


@cuda
def test_retraction_through_a_page_locked_host_cache_on_cuda():
    from pdserve import LLM, SamplingParams

    prompts = [[5, 17, 42, 9, 3, 77, 12, 8, 30, 2, 61, 40, 7], list(range(1, 40)), [94, 3]]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(device="cuda").generate(prompts, sp, use_tqdm=False)]
    llm = LLM(device="cuda", page_size=4, total_pages=24, safe_steps=4, host_pages=64)
    assert llm.executor.host.data.is_pinned()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    llm.engine.planner.assert_idle()


def _syncs(fn):
    """fn's result and how many synchronizing CUDA calls torch saw."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchroniz" in str(w.message) for w in seen)


@cuda
def test_sampling_on_cuda_gives_a_row_its_token_whatever_the_batch_in_one_sync():
    from pdserve.kernels.sampling import sample
    from pdserve.text.sampling_params import SamplingParams

    torch.manual_seed(0)
    logits = torch.randn(64, 32000, device="cuda") * 3
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1),
             SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.3, top_p=0.8),
             SamplingParams(temperature=0.9, top_k=200, top_p=0.95, seed=9, logprobs=2)]
    params = [kinds[i % len(kinds)] for i in range(64)]
    steps, seeds = list(range(64)), [100 + i for i in range(64)]
    torch.cuda.synchronize()
    (batch, _), n_batch = _syncs(lambda: sample(logits, params, steps, seeds))
    for i in (1, 2, 3, 4, 17, 63):
        (alone, _), n_alone = _syncs(lambda: sample(logits[i:i + 1], params[i:i + 1],
                                                   steps[i:i + 1], seeds[i:i + 1]))
        assert alone == [batch[i]], i
        assert n_alone == n_batch               # no sync a row
    assert n_batch <= 2


@cuda
def test_penalties_on_cuda_change_the_logits_as_on_cpu_without_a_sync_a_row():
    from pdserve.kernels.sampling import _penalize
    from pdserve.text.sampling_params import SamplingParams

    torch.manual_seed(0)
    logits = torch.randn(16, 32000) * 3
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25,
                             repetition_penalty=1.3, logit_bias={7: 5.0}) if i % 2
              else SamplingParams() for i in range(16)]
    hist = [(list(range(i, 300 + i)), [i % 5] * 40 + list(range(50))) for i in range(16)]
    want = _penalize(logits, params, hist)
    on_gpu = logits.cuda()
    torch.cuda.synchronize()
    got, n = _syncs(lambda: _penalize(on_gpu, params, hist))
    assert torch.allclose(got.cpu(), want) and n == 0


@cuda
def test_a_round_stages_its_host_lists_without_a_sync():
    from pdserve.kernels.staging import stage_rows

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, pos = stage_rows([[5, 6, 7], [0, 1, 2]], torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ids.tolist() == [5, 6, 7] and pos.tolist() == [0, 1, 2] and ids.is_cuda


@cuda
def test_a_scattered_write_between_gpu_pools_lands_bit_exact_in_another_process():
    pytest.importorskip("nixl")
    from pdserve.transfer import Incarnation, KvWrite, TransferEventKind
    from pdserve.transfer.nixl.transport import NixlTransport
    from pdserve.transfer.nixl.peer_process import make_pool, spawn

    shape = (2, 2, 4, 2, 8)
    proc, conn, md, _ = spawn("decode-0", 1, 64, shape, device="cuda")
    try:
        p = NixlTransport(Incarnation("prefill-0", 1))
        src_pool = make_pool(64, shape, torch.float32, device="cuda")
        p.register_pool(src_pool)
        d_inc = Incarnation("decode-0", 1)
        p.add_peer(d_inc, md)
        conn.send((p.incarnation, p.metadata()))
        src, dst = (0, 1, 2, 3, 17, 40, 41, 63), (10, 11, 12, 13, 2, 50, 51, 0)
        p.write(KvWrite("req-7", 3, d_inc, src, dst))
        done = []
        while not done:
            done = p.poll()
        assert [(e.kind, e.req_id) for e in done] == [(TransferEventKind.DONE, "req-7")], done
        conn.send(("wait", 1, 10.0))
        assert conn.recv() == [(TransferEventKind.LANDED, "req-7", 3,
                               "prefill-0@1")]
        conn.send(("read", dst))
        assert torch.equal(conn.recv(), src_pool[list(src)].cpu())
        p.close()
    finally:
        conn.send(("close",))
        conn.recv()
        proc.join(10)


# ---- structured outputs' masks on the device (issue 55) -----------------------------

def _masks_against_a_reference(device: str) -> None:
    """apply_grammar_masks on `device`: the rows named get -inf exactly where
    their bits forbid a token, the other rows keep their logits bit for
    bit, and the input is not changed (a vocabulary that is not a multiple
    of 32, so the last word's tail bits are cut off)."""
    import numpy as np

    from pdserve.kernels.sampling import apply_grammar_masks

    vocab, rows = 49_153, [0, 2]
    g = torch.Generator().manual_seed(55)
    logits = torch.randn(3, vocab, generator=g)
    bits = np.random.default_rng(55).integers(-2**31, 2**31, size=(2, (vocab + 31) // 32),
                                              dtype=np.int64).astype(np.int32)
    got = apply_grammar_masks(logits.to(device), rows, bits).cpu()
    allowed = np.unpackbits(bits.view(np.uint8), bitorder="little").reshape(2, -1)[:, :vocab]
    want = logits.clone()
    for j, r in enumerate(rows):
        want[r][torch.from_numpy(allowed[j] == 0)] = float("-inf")
    assert torch.equal(got, want)
    assert torch.isfinite(logits).all()


def test_grammar_masks_forbid_exactly_their_bits_on_cpu():
    _masks_against_a_reference("cpu")


@cuda
def test_grammar_masks_forbid_exactly_their_bits_on_cuda():
    _masks_against_a_reference("cuda")
