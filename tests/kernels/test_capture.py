"""The captured decode step (kernels/capture.py): a decode round run over
static buffers padded to a batch bucket gives the eager forward's logits
(float32, within 1e-5) and the same greedy tokens, for Llama, Mistral's
sliding window and Gemma 3's two cache groups; what it declines (state
layers, mixed rounds, tables wider than its buckets) runs eagerly."""

import random

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels.attention import BatchMeta, SeqMeta
from pdserve.kernels.capture import (CaptureMode, DecodeCapture, bucket_of, buckets,
                                     choose_capture)
from pdserve.kernels.models.loader import load_model
from pdserve.scheduler.cache.groups import HOLE
from pdserve.scheduler.config import ConfigError, EngineConfig

transformers = pytest.importorskip("transformers")

PS = 4
TOL = 1e-5


def mistral(tmp_path):
    from support.checkpoints import hf_model
    return hf_model(tmp_path, "mistral")[1]            # one group, every layer slides over 16


def gemma3(tmp_path):
    from support.checkpoints import gemma3_checkpoint
    return gemma3_checkpoint(tmp_path)[1]              # a sliding group (8) and a full one


def decode_round(model, pages: list[int], ctxs: list[int], rng: random.Random):
    """One decode BatchMeta per cache group for sequences of `ctxs` tokens
    (each decoding its last), their pages drawn from each group's pool; a
    sliding group's pages below the window are HOLE."""
    metas = []
    for g, spec in enumerate(model.groups):
        window = spec.window if spec.sliding else None
        free = list(range(pages[g]))
        rng.shuffle(free)
        seqs, slots = [], []
        for i, ctx in enumerate(ctxs):
            n = -(-ctx // PS)
            table = [free.pop() for _ in range(n)]
            kv_start = max(ctx - window, 0) if window else 0
            table = [HOLE] * (kv_start // PS) + table[kv_start // PS:]
            p = ctx - 1
            seqs.append(SeqMeta(i, 1, ctx, table, kv_start))
            slots.append(table[p // PS] * PS + p % PS)
        metas.append(BatchMeta(seqs, torch.tensor(slots), torch.tensor([c - 1 for c in ctxs]),
                               num_decodes=len(ctxs), window=window))
    return metas


def fresh_metas(metas):
    return [BatchMeta(m.seqs, m.slot_mapping, m.positions, m.num_decodes, m.window)
            for m in metas]


def static_capture(model):
    """96 pages a cache group with random K/V, and one more (the scratch),
    and a capture of their decode rounds up to 8 rows and 16 pages, its
    buffers run eagerly: (pages per group, caches, capture)."""
    pages = [96] * len(model.groups)
    caches = model.new_caches([p + 1 for p in pages], PS)     # the last page: the scratch
    torch.manual_seed(1)
    for c in caches:
        c.data.normal_()
    windows = [s.window if s.sliding else None for s in model.groups]
    return pages, caches, DecodeCapture(model, caches, CaptureMode.STATIC, max_batch=8,
                                        max_pages=16, windows=windows)


@pytest.mark.parametrize("family", ["tiny-llama", "mistral", "gemma3"])
def test_the_captured_step_gives_the_eager_logits(tmp_path, family):
    path = {"tiny-llama": None, "mistral": mistral, "gemma3": gemma3}[family]
    model, _ = load_model(path(tmp_path) if path else None, "tiny" if path is None else None,
                          dtype="float32", attention="torch")
    pages, caches, cap = static_capture(model)
    assert cap.capture() >= 0 and cap.batch_sizes == [1, 2, 4, 8]
    rng = random.Random(0)
    for ctxs in ([5], [9, 30, 2], [17, 4, 33, 12, 8], [40] * 8):
        metas = decode_round(model, pages, ctxs, rng)
        ids = torch.tensor([rng.randrange(model.cfg.vocab_size) for _ in ctxs])
        assert cap.covers(metas)
        got = cap.run(ids, metas)
        want = model.forward(ids, fresh_metas(metas), caches, torch.arange(len(ctxs)))
        assert got.shape == want.shape and got.dtype == torch.float32
        assert (got - want).abs().max() < TOL, (family, ctxs)
    assert cap.replays == 4


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """flashinfer's stand-in (tests/support/flashinfer_fake.py), float32
    allowed, so the captured and the eager steps compare exactly."""
    import sys

    from support import flashinfer_fake

    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_fake)
    monkeypatch.setattr(flashinfer_fake, "DTYPES", [torch.float32])
    return flashinfer_fake


@pytest.mark.parametrize("family", ["tiny-llama", "mistral", "gemma3"])
def test_the_captured_flashinfer_step_plans_its_wrappers_and_gives_the_eager_logits(
        tmp_path, family, fake_flashinfer):
    """With flashinfer's attention a bucket is a decode wrapper in
    CUDA-graph mode per cache group over fixed buffers, planned before each
    run (the stand-in's run reads only those buffers, as a replay does):
    rounds of 1 to 8 rows, padded to 1, 2, 4 and 8, give the eager
    flashinfer step's logits and the torch backend's, a sliding group
    reading from its window's first page. One width bucket: flashinfer's
    grid does not depend on the table."""
    from pdserve.kernels.flashinfer_attention import CapturedDecode, FlashInferAttention

    path = {"tiny-llama": None, "mistral": mistral, "gemma3": gemma3}[family]
    model, _ = load_model(path(tmp_path) if path else None, "tiny" if path is None else None,
                          dtype="float32", attention="torch")
    c = model.cfg
    torch_attention = model.attention
    model.attention = FlashInferAttention(c.num_heads, c.num_kv_heads, c.head_dim,
                                          c.sliding_window)
    pages, caches, cap = static_capture(model)
    cap.capture()
    assert cap.widths == [16] and cap.steps == 4
    wrappers = {(b, g): gb.planned for (b, _), bk in cap._buckets.items()
                for g, gb in enumerate(bk.groups)}
    assert all(isinstance(w, CapturedDecode) and w.wrapper.graph and w.wrapper.plans == 1
               for w in wrappers.values())              # planned once at capture, padding only
    rng = random.Random(0)
    for ctxs in ([5], [9, 30, 2], [17, 4, 33, 12, 8], [40] * 8, [3, 64]):
        metas = decode_round(model, pages, ctxs, rng)
        ids = torch.tensor([rng.randrange(c.vocab_size) for _ in ctxs])
        scratch_before = [cache.data[-1].clone() for cache in caches]
        b = bucket_of(len(ctxs), cap.batch_sizes)
        plans = [wrappers[b, g].wrapper.plans for g in range(len(model.groups))]
        got = cap.run(ids, metas)
        assert [wrappers[b, g].wrapper.plans for g in range(len(model.groups))] == \
            [p + 1 for p in plans]                      # each group's, once before its run
        # the same round again, eagerly: its K/V are rewritten where they went
        want = model.forward(ids, fresh_metas(metas), caches, torch.arange(len(ctxs)))
        assert (got - want).abs().max() < TOL, (family, ctxs)
        model.attention, flash = torch_attention, model.attention
        reference = model.forward(ids, fresh_metas(metas), caches, torch.arange(len(ctxs)))
        model.attention = flash
        assert (got - reference).abs().max() < TOL, (family, ctxs)
        if len(ctxs) == b:                       # no padding: the scratch page untouched
            assert all(torch.equal(a, cache.data[-1])
                       for a, cache in zip(scratch_before, caches))
    assert cap.replays == 5


def test_a_captured_flashinfer_bucket_refuses_a_row_past_its_pages(fake_flashinfer):
    """A row whose table is wider than the bucket's pages is not run
    captured (run gives None: the engine runs it eagerly), and planning one
    directly is a clear error, not a silent overrun of the indices buffer."""
    from pdserve.kernels.flashinfer_attention import FlashInferAttention

    model, _ = load_model(None, "tiny", dtype="float32", attention="torch")
    c = model.cfg
    model.attention = FlashInferAttention(c.num_heads, c.num_kv_heads, c.head_dim)
    caches = model.new_caches([33], PS)
    cap = DecodeCapture(model, caches, CaptureMode.STATIC, max_batch=4, max_pages=4,
                        windows=[None])
    rng = random.Random(0)
    wide = decode_round(model, [32], [30], rng)                           # 8 pages > 4
    assert cap.run(torch.zeros(1, dtype=torch.long), wide) is None
    planned = cap._bucket(1, 4).groups[0].planned
    with pytest.raises(ValueError, match="reads 8 pages, its bucket holds 4"):
        model.attention.plan_captured(planned, wide[0].seqs, PS, 32)


def test_a_round_it_cannot_run_goes_back_to_eager():
    model, _ = load_model(None, "tiny", dtype="float32", attention="torch")
    caches = model.new_caches([33], PS)
    cap = DecodeCapture(model, caches, CaptureMode.STATIC, max_batch=4, max_pages=4,
                        windows=[None])
    rng = random.Random(0)
    assert not cap.covers(decode_round(model, [32], [3] * 5, rng))     # past the largest batch
    assert cap.run(torch.zeros(1, dtype=torch.long),
                   decode_round(model, [32], [30], rng)) is None       # 8 pages > 4
    mixed = decode_round(model, [32], [6, 3], rng)
    mixed[0].num_decodes = 1                                            # a prefill among them
    assert not cap.covers(mixed)


def test_buckets_are_powers_of_two_up_to_the_limit():
    assert buckets(1) == [1] and buckets(6) == [1, 2, 4, 6] and buckets(8) == [1, 2, 4, 8]
    assert bucket_of(3, [1, 2, 4, 6]) == 4 and bucket_of(7, [1, 2, 4, 6]) is None


def test_auto_captures_on_cuda_only_and_says_why_not(tmp_path):
    model, _ = load_model(None, "tiny", dtype="float32", attention="torch")
    assert choose_capture("auto", model) == (
        CaptureMode.OFF, "auto on CPU: torch.compile's decode step did not pay for its compile "
        "on a two-core host (docs/benchmarks.md); capture: on compiles it")
    assert choose_capture("on", model)[0] is CaptureMode.COMPILE
    assert choose_capture("off", model) == (CaptureMode.OFF, "engine.capture is off")
    from support.checkpoints import lfm2_checkpoint
    hybrid, _ = load_model(lfm2_checkpoint(tmp_path / "lfm2")[1], None, dtype="float32")
    assert choose_capture("on", hybrid) == (CaptureMode.OFF,
                                            "the model's state layers run eagerly")


def test_a_bad_capture_setting_is_a_clear_error():
    with pytest.raises(ConfigError, match="engine.capture is 'yes'; use auto"):
        EngineConfig(capture="yes")


@pytest.mark.parametrize("family", ["tiny-llama",
                                    pytest.param("gemma3", marks=pytest.mark.slow)])
def test_an_engine_with_the_step_captured_generates_the_same_tokens(tmp_path, monkeypatch,
                                                                    family):
    """Served rounds through the capture (its static buffers, run eagerly:
    what COMPILE and CUDA_GRAPH record) give eager's greedy tokens."""
    import pdserve.engine.executor.torch_executor as executor

    model = {"preset": "tiny"} if family == "tiny-llama" else {"path": str(gemma3(tmp_path))}
    engine = dict(page_size=PS, total_pages=128, sliding_pages=128, max_batch_size=6,
                  max_scheduled_tokens=32)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 90) for _ in range(n)] for n in (5, 23, 40, 11, 17)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def tokens():
        llm = LLM({"model": model}, dtype="float32", attention="torch", **engine)
        return llm, [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    eager_llm, want = tokens()
    assert eager_llm.executor.capture is None
    monkeypatch.setattr(executor, "choose_capture", lambda setting, m: (CaptureMode.STATIC, "t"))
    llm, got = tokens()
    assert got == want
    assert llm.executor.capture.replays >= 10         # the decode rounds went through it


def test_an_engine_with_flashinfer_s_decode_captured_generates_the_same_tokens(
        monkeypatch, fake_flashinfer):
    """The engine's own capture at load with flashinfer's attention (the
    stand-in, on CPU): its decode rounds go through the planned wrappers,
    prefill rounds through the eager ones, and the greedy tokens are the
    torch backend's uncaptured."""
    import pdserve.engine.executor.torch_executor as executor
    import pdserve.kernels.models.loader as loader
    from pdserve.kernels.flashinfer_attention import FlashInferAttention

    engine = dict(page_size=PS, total_pages=128, max_batch_size=6, max_scheduled_tokens=32)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 90) for _ in range(n)] for n in (5, 23, 40, 11, 17)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def tokens():
        llm = LLM({"model": {"preset": "tiny"}}, dtype="float32", attention="torch", **engine)
        return llm, [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    _, want = tokens()
    monkeypatch.setattr(loader, "choose_backend",
                        lambda name, device, dtype, **kw: (FlashInferAttention(**kw), "t"))
    monkeypatch.setattr(executor, "choose_capture", lambda setting, m: (CaptureMode.STATIC, "t"))
    llm, got = tokens()
    assert llm.model.attention.name == "flashinfer" and llm.executor.capture.planned
    assert got == want
    assert llm.executor.capture.replays >= 10


def test_a_moe_on_the_grouped_path_is_captured_and_counts_only_its_real_rows():
    """Qwen3-MoE's shape with its experts on torch's grouped matmul (what a
    GPU runs in bfloat16; on CPU here): the captured step gives the eager
    logits, and its padding rows (3 and 5 real rows in buckets of 4 and 8)
    are routed but not counted among the experts' tokens."""
    from pdserve.benchmarks.common.shapes import build
    from pdserve.kernels.models.moe.experts import GROUPED, LOOP

    model = build("tiny-moe", "float32", "cpu")
    assert choose_capture("on", model)[0] is CaptureMode.OFF      # its experts loop on CPU
    for e in model.expert_layers():
        e.path = GROUPED
    assert choose_capture("on", model)[0] is CaptureMode.COMPILE
    pages, caches, cap = static_capture(model)
    cap.capture()
    rng = random.Random(2)
    for ctxs in ([9, 30, 2], [17, 4, 33, 12, 8]):
        metas = decode_round(model, pages, ctxs, rng)
        ids = torch.tensor([rng.randrange(model.cfg.vocab_size) for _ in ctxs])
        before = [e.counts.clone() for e in model.expert_layers()]
        got = cap.run(ids, metas)
        counted = [e.counts - b for e, b in zip(model.expert_layers(), before)]
        want = model.forward(ids, fresh_metas(metas), caches, torch.arange(len(ctxs)))
        assert (got - want).abs().max() < TOL
        for e, c, b in zip(model.expert_layers(), counted, before):
            assert int(c.sum()) == len(ctxs) * 2                  # top 2 of each real row
            assert torch.equal(e.counts - b - c, c)               # eager counted the same
    assert all(e.live_rows is None for e in model.expert_layers())
    model.expert_layers()[0].path = LOOP
    assert "experts loop" in choose_capture("on", model)[1]


def test_an_engine_with_a_moe_step_captured_generates_the_same_tokens_and_counts(
        tmp_path, monkeypatch):
    """A Qwen3-MoE checkpoint on the grouped path, its decode rounds through
    the capture's buffers: eager's greedy tokens, and each sparse layer
    counts top_k tokens for every row computed, padding rows left out."""
    import pdserve.engine.executor.torch_executor as executor
    from pdserve.engine.stats import expert_tokens
    from pdserve.kernels.models.moe.experts import GROUPED
    from support.moe import qwen3_moe_checkpoint

    _, d = qwen3_moe_checkpoint(tmp_path)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 120) for _ in range(n)] for n in (5, 23, 11)]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine = dict(page_size=PS, total_pages=128, max_batch_size=6, max_scheduled_tokens=32)

    def run(captured: bool):
        if captured:
            monkeypatch.setattr(executor, "choose_capture",
                                lambda setting, m: (CaptureMode.STATIC, "t"))
            monkeypatch.setattr("pdserve.kernels.models.moe.experts.choose_experts_path",
                                lambda layers, device, dtype: (GROUPED, "t"))
        with LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch",
                 **engine) as llm:
            tokens = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            counts = [sum(e.tokens) for e in expert_tokens(llm.model)]
            replays = llm.executor.capture.replays if captured else 0
            return tokens, counts, llm.executor.forward_tokens, replays
    want, want_counts, _, _ = run(False)
    got, counts, rows, replays = run(True)
    assert got == want and replays >= 5
    assert counts == want_counts == [2 * rows] * len(counts)
