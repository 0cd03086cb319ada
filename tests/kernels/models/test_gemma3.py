"""Gemma 3 text and sliding-window cache groups, against Hugging Face
transformers on the same weights.

The executor runs hand-made rounds (the planner's multi-group admission is
not used): block tables are built here as the planner's contract describes
them. Full-history tables keep every page; a sliding group's table lets go
of the pages below the window of the forward it is built for (HOLE), and
those pages are filled with NaN, so a sliding layer that read one would
turn the logits to NaN. Windows of 8 tokens against prompts of 40-90 make
every sliding layer's window matter.
"""

import json
import random
import shutil

import pytest
import torch

from pdserve.kernels.models.loader import attention_shape, load_model
from pdserve.kernels.models.model_config import ModelError, read_config
from pdserve.engine.executor.torch_executor import TorchExecutor
from pdserve.scheduler.cache.groups import FULL, HOLE
from pdserve.scheduler.config import EngineConfig
from pdserve.scheduler.fsm import Decoding, Prefilling, Resources
from pdserve.scheduler.plan import LoadOp, Plan, PrefillOp, StoreOp
from pdserve.scheduler.request import Request
from support.planner import save_with_noisy_norms
from support.checkpoints import WINDOW, gemma3_checkpoint

transformers = pytest.importorskip("transformers")

PS = 4                    # page size: windows and chunks cross many pages
ENGINE = EngineConfig(page_size=PS, total_pages=160, sliding_pages=160, max_batch_size=4)
TOL = 1e-4


def hf_checkpoint(tmp_path, arch: str, **overrides):
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.1, tie_word_embeddings=False, **overrides)
    if arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return save_with_noisy_norms(model.float().eval(), tmp_path / arch)


def executor(d, groups=None, engine=ENGINE, attention="torch"):
    model, tok = load_model(str(d), preset=None, dtype="float32", attention=attention)
    return TorchExecutor(model, tok, engine, detokenize=False, groups=groups)


# ---- hand-made rounds ----------------------------------------------------------------

class Tables:
    """Block tables as the planner's contract has them: pages handed out
    from each group's pool in a scrambled order and never reused; a sliding
    group's slots below what the next forward reads go back as HOLE, their
    pages filled with NaN."""

    def __init__(self, ex: TorchExecutor, seed: int = 0):
        rng = random.Random(seed)
        self.ex = ex
        self.free = []
        for c in ex.caches:
            ids = list(range(c.data.shape[0]))
            rng.shuffle(ids)
            self.free.append(ids)
        self.freed = [0] * len(ex.caches)

    def fit(self, req, first_row: int, end: int, replay: bool) -> None:
        """`req`'s tables, ready for a forward over rows [first_row, end)."""
        for g, spec in enumerate(self.ex.groups):
            table = req.state.res.tables[g]
            lo = 0
            if spec.sliding:
                lo = (first_row if replay and spec.replayable
                      else max(first_row - spec.window + 1, 0)) // PS
                table.extend([HOLE] * (lo - len(table)))
                for s in range(lo):
                    if table[s] != HOLE:
                        self.ex.caches[g].data[table[s]] = float("nan")
                        table[s] = HOLE
                        self.freed[g] += 1
            while len(table) * PS < end:
                table.append(self.free[g].pop())


def new_request(rid: str, prompt, groups: int) -> Request:
    req = Request(rid, prompt)
    req.state = Prefilling(Resources(groups), 0, len(prompt))
    return req


def generate(ex, tables, prompts, chunk: int, new_tokens: int, start_rounds=None):
    """Greedy generation through hand-made rounds: every request prefills
    `chunk` tokens a round (request i joins at round start_rounds[i]), then
    decodes, prefills and decodes sharing rounds. Every chunk samples (its
    last row's logits are checked). Returns the requests and, per request,
    {position: logits}."""
    start_rounds = start_rounds or [0] * len(prompts)
    reqs = [new_request(f"r{i}", p, len(ex.groups)) for i, p in enumerate(prompts)]
    done = [0] * len(reqs)
    seen = [{} for _ in reqs]
    rnd = 0
    while any(len(r.output) < new_tokens for r in reqs):
        ops, decodes = [], []
        for i, r in enumerate(reqs):
            if rnd < start_rounds[i] or len(r.output) >= new_tokens:
                continue
            if done[i] < r.prompt_len:
                n = min(chunk, r.prompt_len - done[i])
                tables.fit(r, done[i], done[i] + n, replay=False)
                ops.append(PrefillOp(r, done[i], n, completes=True))
                done[i] += n
            else:
                tables.fit(r, r.num_tokens - 1, r.num_tokens, replay=False)
                decodes.append(r)
        logits, rows = ex.forward(Plan(round=rnd, prefills=ops, decodes=decodes))
        for req, row in zip(rows, logits):
            i = reqs.index(req)
            p = done[i] - 1 if req in [op.req for op in ops] else req.num_tokens - 1
            seen[i][p] = row
            if p == req.num_tokens - 1:          # the prompt's end, or a decode: take a token
                req.output.append(int(row.argmax()))
                req.num_tokens += 1
                req.state = Decoding(req.state.res)
        rnd += 1
    return reqs, seen


@torch.no_grad()
def assert_matches_transformers(model, reqs, seen, new_tokens: int) -> None:
    for req, rows in zip(reqs, seen):
        ids = req.prompt.tokens + req.output
        want = model(torch.tensor([ids])).logits[0]
        for p, got in rows.items():
            err = float((got - want[p]).abs().max())
            assert err < TOL, f"{req.id} position {p}: logits off by {err:.3g}"
        ref = model.generate(torch.tensor([req.prompt.tokens]), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        assert req.output == ref[0, req.prompt_len:].tolist()


PROMPTS = [[(7 * i + 3) % 120 + 1 for i in range(70)],
           [(11 * i + 5) % 120 + 1 for i in range(45)]]


# ---- model facts -----------------------------------------------------------------------

def test_gemma3_config_groups_local_and_global_layers(tmp_path):
    _, d = gemma3_checkpoint(tmp_path)
    cfg = read_config(d)
    assert cfg.arch == "gemma3" and cfg.tie_word_embeddings and cfg.head_dim == 16
    assert [cfg.layer_window(i) for i in range(6)] == [8, 8, None, 8, 8, None]
    assert (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.rope_local_theta) == \
        (100_000.0, 2.0, 10_000.0)
    full, local = cfg.cache_groups()
    assert not full.sliding and full.layers == (2, 5)
    assert local.sliding and local.window == WINDOW and local.layers == (0, 1, 3, 4)
    assert not local.replayable and cfg.cache_groups(replayable=True)[1].replayable


def test_older_gemma3_configs_name_the_pattern_and_rope_bases_their_own_way(tmp_path):
    """Before transformers 5: sliding_window_pattern, rope_theta and
    rope_scaling for global layers, rope_local_base_freq for local ones."""
    _, d = gemma3_checkpoint(tmp_path)
    raw = json.loads((d / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        raw.pop(key, None)
    raw.update(sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    (d / "config.json").write_text(json.dumps(raw))
    cfg = read_config(d)
    assert [cfg.layer_window(i) for i in range(6)] == [8] * 5 + [None]
    assert (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.rope_local_theta) == (1e6, 8.0, 1e4)
    assert cfg.rope_local_scaling is None


def test_the_multimodal_gemma3_checkpoint_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}))
    with pytest.raises(ModelError, match="text-only Gemma3ForCausalLM"):
        read_config(tmp_path)


def test_llama_has_one_full_group_and_mistral_one_sliding_group(tmp_path):
    from pdserve.kernels.models.model_config import tiny_config

    (only,) = tiny_config().cache_groups()
    assert not only.sliding and only.layers == (0, 1)
    _, d = hf_checkpoint(tmp_path, "mistral", sliding_window=WINDOW)
    (only,) = read_config(d).cache_groups(replayable=True)
    assert only.sliding and only.window == WINDOW and only.layers == (0, 1) and only.replayable


def test_qwen2_slides_from_max_window_layers_up_and_only_with_use_sliding_window(tmp_path):
    _, d = hf_checkpoint(tmp_path, "qwen2", use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1)
    full, local = read_config(d).cache_groups()
    assert full.layers == (0,) and local.layers == (1,) and local.window == WINDOW
    _, d = hf_checkpoint(tmp_path / "off", "qwen2", sliding_window=WINDOW, max_window_layers=1)
    (only,) = read_config(d).cache_groups()
    assert not only.sliding


# ---- against transformers ----------------------------------------------------------------

@pytest.mark.parametrize("chunk", [100, 16, 5])
def test_gemma3_matches_transformers_through_chunked_paged_prefill_and_decode(tmp_path, chunk):
    model, d = gemma3_checkpoint(tmp_path)
    ex = executor(d)
    tables = Tables(ex)
    reqs, seen = generate(ex, tables, PROMPTS, chunk, new_tokens=10, start_rounds=[0, 1])
    assert_matches_transformers(model, reqs, seen, 10)
    assert tables.freed[1] > 10 and tables.freed[0] == 0     # sliding pages went back


def test_sliding_layers_never_read_the_pages_below_their_window(tmp_path):
    """The freed pages hold NaN: one read would poison every later logit."""
    _, d = gemma3_checkpoint(tmp_path)
    ex = executor(d)
    tables = Tables(ex)
    reqs, seen = generate(ex, tables, PROMPTS[:1], 16, new_tokens=6)
    assert tables.freed[1] >= (70 - WINDOW) // PS - 1
    assert all(torch.isfinite(row).all() for row in seen[0].values())
    last_row = reqs[0].num_tokens - 2                     # the last decode's position
    lo = (last_row - WINDOW + 1) // PS
    assert reqs[0].state.res.tables[1][:lo + 1] == [HOLE] * lo + [reqs[0].state.res.tables[1][lo]]
    assert HOLE not in reqs[0].state.res.tables[1][lo:]


def test_the_window_matters_at_these_lengths(tmp_path):
    """The test above would not notice a layer that ignored its window
    unless the window changes the logits: with it widened, they differ."""
    model, d = gemma3_checkpoint(tmp_path)
    wide = tmp_path / "wide"
    shutil.copytree(d, wide)
    raw = json.loads((wide / "config.json").read_text())
    raw["sliding_window"] = 4096
    (wide / "config.json").write_text(json.dumps(raw))
    ex = executor(wide)
    _, seen = generate(ex, Tables(ex), PROMPTS[:1], 100, new_tokens=1)
    want = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert float((seen[0][69] - want.detach()).abs().max()) > 100 * TOL


def test_gemma3_final_logit_softcap_matches_transformers(tmp_path):
    model, d = gemma3_checkpoint(tmp_path, final_logit_softcapping=2.0)
    ex = executor(d)
    reqs, seen = generate(ex, Tables(ex), PROMPTS, 16, new_tokens=6, start_rounds=[0, 1])
    assert_matches_transformers(model, reqs, seen, 6)


def test_attention_softcap_is_transformers_eager_softcap():
    """attn_logit_softcapping caps the scaled scores before the mask, as
    Google's Gemma reference and transformers' eager attention function do.
    (transformers' Gemma3Attention never passes it that function, so a
    whole-model comparison cannot check it; every released Gemma 3 sets it
    null.)"""
    from types import SimpleNamespace

    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

    from pdserve.kernels.attention import BatchMeta, SeqMeta, TorchAttention
    from pdserve.kernels.kv_cache import KVCache

    torch.manual_seed(0)
    T, h, kvh, dh = 21, 4, 2, 16
    q, k, v = torch.randn(T, h, dh) * 2, torch.randn(T, kvh, dh) * 2, torch.randn(T, kvh, dh)
    att = TorchAttention(h, kvh, dh, scale=0.25, softcap=1.5)
    cache = KVCache(1, 8, PS, kvh, dh, torch.float32, "cpu")
    table = [5, 2, 7, 0, 3, 1]
    pos = torch.arange(T)
    slots = torch.tensor([table[p // PS] * PS + p % PS for p in range(T)])
    got = torch.cat([   # 20 rows as a prefill, the last one as a decode over the pages
        att.forward(q[:20], k[:20], v[:20], *cache.layer(0),
                    BatchMeta([SeqMeta(0, 20, 20, table)], slots[:20], pos[:20],
                              window=WINDOW)),
        att.forward(q[20:], k[20:], v[20:], *cache.layer(0),
                    BatchMeta([SeqMeta(0, 1, 21, table, kv_start=21 - WINDOW)], slots[20:],
                              pos[20:], num_decodes=1, window=WINDOW))])
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - WINDOW)
    mask = torch.zeros(T, T).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=h // kvh, training=False)
    want, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], mask, scaling=0.25, softcap=1.5)
    assert float((got - want[0]).abs().max()) < 1e-5


def test_mistral_with_every_layer_sliding_matches_transformers(tmp_path):
    model, d = hf_checkpoint(tmp_path, "mistral", sliding_window=WINDOW)
    ex = executor(d)
    assert len(ex.caches) == 1 and ex.groups[0].sliding
    assert not ex.model.cfg.full_history              # the router bounds prompts by context
    tables = Tables(ex)
    reqs, seen = generate(ex, tables, PROMPTS, 7, new_tokens=10, start_rounds=[0, 2])
    assert_matches_transformers(model, reqs, seen, 10)
    assert tables.freed[0] > 10


def test_qwen2_with_full_and_sliding_layers_matches_transformers(tmp_path):
    model, d = hf_checkpoint(tmp_path, "qwen2", use_sliding_window=True, sliding_window=WINDOW,
                             max_window_layers=1)
    ex = executor(d)
    assert [len(c.data[0]) for c in ex.caches] == [1, 1]          # one layer in each
    assert ex.model.cfg.full_history
    reqs, seen = generate(ex, Tables(ex), PROMPTS, 16, new_tokens=8, start_rounds=[0, 1])
    assert_matches_transformers(model, reqs, seen, 8)


# ---- replay rows (spec §1.3) ---------------------------------------------------------------

def _prefix_run(ex, tables, prompt, prefix: int):
    """A first request computes `prompt[:prefix]`; its pages are the prefix
    cache a second request then starts on."""
    first = new_request("prefix", prompt[:prefix], len(ex.groups))
    tables.fit(first, 0, prefix, replay=False)
    ex.forward(Plan(round=0, prefills=[PrefillOp(first, 0, prefix, completes=True)]))
    return first.state.res.tables


def _nudge(ex, g, pages):
    """Move the pages' K/V by a hair (far below the logits' tolerance), so a
    rewrite of them from recomputed rows would show as a change."""
    with torch.no_grad():
        ex.caches[g].data[pages] += 1e-6
    return ex.caches[g].data[pages].clone()


def _replayed(ex, tables, req, prefix: int, replay: int):
    tables.fit(req, prefix - replay, req.prompt_len, replay=True)
    op = PrefillOp(req, prefix, req.prompt_len - prefix, completes=True, replay=replay)
    logits, _ = ex.forward(Plan(round=1, prefills=[op]))
    return logits[0]


@pytest.mark.parametrize("prefix,replay", [(8, 8), (24, 24)], ids=["prefix-le-window",
                                                                    "whole-prefix"])
def test_replay_regenerates_sliding_kv_and_leaves_the_full_group_s_prefix_alone(
        tmp_path, prefix, replay):
    """Full-history pages of the prefix are shared (prefix cache); the
    replayable sliding group has none, so the chunk re-feeds the prefix:
    its rows run through every layer, their K/V land in the sliding group
    only, and the logits are the uncached ones."""
    model, d = gemma3_checkpoint(tmp_path)
    ex = executor(d, groups=read_config(d).cache_groups(replayable=True))
    tables = Tables(ex)
    prompt = PROMPTS[0]
    shared = _prefix_run(ex, tables, prompt, prefix)[0][:prefix // PS]
    before = _nudge(ex, 0, shared)
    req = new_request("hit", prompt, len(ex.groups))
    req.state.res.tables[0].extend(shared)                   # the hit: full history only
    got = _replayed(ex, tables, req, prefix, replay)
    assert torch.equal(ex.caches[0].data[shared], before)    # not rewritten
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -1]
    assert float((got - want).abs().max()) < TOL
    sliding = req.state.res.tables[1]
    assert torch.isfinite(ex.caches[1].data[[p for p in sliding if p != HOLE]]).all()


def test_a_replay_of_one_window_writes_the_sliding_pages_it_reads(tmp_path):
    """A hit at 24 re-fed from 16 (one window): the replayed rows' sliding
    K/V are written before the chunk's rows read them; nothing reads below
    the replay (those slots are HOLE, their pages NaN)."""
    _, d = gemma3_checkpoint(tmp_path)
    ex = executor(d, groups=read_config(d).cache_groups(replayable=True))
    tables = Tables(ex)
    prompt = PROMPTS[0]
    shared = _prefix_run(ex, tables, prompt, 24)[0][:24 // PS]
    before = _nudge(ex, 0, shared)
    req = new_request("hit", prompt, len(ex.groups))
    req.state.res.tables[0].extend(shared)
    got = _replayed(ex, tables, req, 24, WINDOW)
    assert torch.equal(ex.caches[0].data[shared], before)
    sliding = req.state.res.tables[1]
    assert sliding[:16 // PS] == [HOLE] * (16 // PS)
    assert torch.isfinite(got).all()
    written = ex.caches[1].data[sliding[16 // PS:24 // PS]]
    assert torch.isfinite(written).all() and written.abs().sum() > 0


def test_replay_rows_are_not_written_into_groups_that_are_not_replayable(tmp_path):
    """Both groups prefix-cached: re-fed rows must leave both groups' shared
    pages alone, and attend over them."""
    model, d = gemma3_checkpoint(tmp_path)
    ex = executor(d)
    tables = Tables(ex)
    prompt = PROMPTS[0]
    prefix, replay = 24, WINDOW
    prior = _prefix_run(ex, tables, prompt, prefix)
    req = new_request("hit", prompt, len(ex.groups))
    snapshots = []
    for g, table in enumerate(prior):
        # the hit's pages: the sliding group's from the re-fed rows' window on
        lo = (prefix - replay - WINDOW + 1) // PS if ex.groups[g].sliding else 0
        shared = [HOLE] * lo + table[lo:prefix // PS]
        req.state.res.tables[g].extend(shared)
        live = [p for p in shared if p != HOLE]
        snapshots.append((g, live, _nudge(ex, g, live)))
    got = _replayed(ex, tables, req, prefix, replay)
    for g, live, before in snapshots:
        assert torch.equal(ex.caches[g].data[live], before), f"group {g} rewritten"
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -1]
    assert float((got - want).abs().max()) < TOL


# ---- the executor's pools ---------------------------------------------------------------

def test_each_group_has_its_own_pool_sized_by_group_pages(tmp_path):
    from pdserve.scheduler.capacity import group_pages

    _, d = gemma3_checkpoint(tmp_path)
    engine = EngineConfig(page_size=PS, total_pages=100, max_batch_size=2, host_pages=7)
    ex = executor(d, engine=engine)
    want = group_pages(engine, ex.groups)
    assert [c.data.shape[:2] for c in ex.caches] == [(want[0], 2), (want[1], 4)]
    assert [h.data.shape[:2] for h in ex.hosts] == [(7, 2), (7, 4)]
    assert ex.cache is ex.caches[0] and ex.host is ex.hosts[0]


def test_stores_and_loads_copy_within_their_group(tmp_path):
    _, d = gemma3_checkpoint(tmp_path)
    ex = executor(d, engine=EngineConfig(page_size=PS, total_pages=16, sliding_pages=16,
                                         host_pages=8))
    for c in ex.caches:
        c.data.copy_(torch.randn(c.data.shape))
    src = ex.caches[1].data[[3, 4]].clone()
    other = ex.caches[0].data[[3, 4]].clone()
    res = ex.run(Plan(round=0, stores=[StoreOp(1, "r", [3, 4], [5, 6], pinned=True, group=1)]))
    assert res.stores_done == [1] and torch.equal(ex.hosts[1].data[[5, 6]], src)
    assert not ex.hosts[0].data.any()
    res = ex.run(Plan(round=1, loads=[LoadOp(2, "r", [5, 6], [9, 10], group=1)]))
    assert res.loads_done == [2] and torch.equal(ex.caches[1].data[[9, 10]], src)
    assert torch.equal(ex.caches[0].data[[3, 4]], other)


def test_groups_that_are_not_the_model_s_are_refused(tmp_path):
    _, d = gemma3_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="are not the model's"):
        executor(d, groups=[FULL])


def test_a_hole_inside_the_window_is_an_error_not_a_read(tmp_path):
    _, d = gemma3_checkpoint(tmp_path)
    ex = executor(d)
    req = new_request("r", PROMPTS[0][:20], len(ex.groups))
    Tables(ex).fit(req, 0, 20, replay=False)
    req.state.res.tables[1][3] = HOLE                       # positions 12-15: in 19's window
    with pytest.raises(RuntimeError, match="lacks a page"):
        ex.forward(Plan(round=0, prefills=[PrefillOp(req, 12, 8, completes=True)]))


# ---- flashinfer, through the CPU stand-in -------------------------------------------------

def test_flashinfer_gets_each_group_s_window_and_pages(tmp_path, monkeypatch):
    """Per group: its own plan, window_left = W - 1 and the window's pages
    only (the freed ones hold NaN), Gemma's scale; the torch backend's
    logits."""
    import sys

    from support import flashinfer_fake

    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_fake)
    monkeypatch.setattr(flashinfer_fake, "DTYPES", [torch.float32])
    from pdserve.kernels.flashinfer_attention import FlashInferAttention

    _, d = gemma3_checkpoint(tmp_path)
    ref = executor(d)
    _, want = generate(ref, Tables(ref), PROMPTS, 16, new_tokens=6, start_rounds=[0, 1])
    ex = executor(d)
    att = ex.model.attention = FlashInferAttention(**attention_shape(ex.model.cfg))
    _, got = generate(ex, Tables(ex), PROMPTS, 16, new_tokens=6, start_rounds=[0, 1])
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        for p in w:
            assert float((w[p] - g[p]).abs().max()) < TOL
    assert set(att._groups) == {None, WINDOW}
    assert att._groups[WINDOW].prefill.window_left == WINDOW - 1
    assert att._groups[None].prefill.window_left == -1
    assert att._groups[WINDOW].decode.scale == 16 ** -0.5


def test_exact_replay_needs_every_stacked_sliding_layer_s_reach(tmp_path):
    """Re-feeding one window regenerates only the lowest sliding layer
    exactly: each layer above reads W - 1 positions further back. The model
    declares the rows that suffice, the sum over its sliding layers of
    W - 1 (4 x 7 here), and with them the logits are the uncached ones."""
    model, d = gemma3_checkpoint(tmp_path)
    groups = read_config(d).cache_groups(replayable=True)
    depth = groups[1].replay
    assert depth == 4 * (WINDOW - 1)
    prompt = PROMPTS[0]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -1]
    errors = {}
    for replay in (WINDOW, depth):
        ex = executor(d, groups=groups)
        tables = Tables(ex)
        shared = _prefix_run(ex, tables, prompt, 40)[0][:40 // PS]
        req = new_request("hit", prompt, len(ex.groups))
        req.state.res.tables[0].extend(shared)
        errors[replay] = float((_replayed(ex, tables, req, 40, replay) - want).abs().max())
    assert errors[WINDOW] > 100 * TOL and errors[depth] < TOL, errors
