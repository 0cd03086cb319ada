"""The draft-model proposer (kernels/spec/draft_model.py, engine/spec/draft.py):
a small model sharing the target's vocabulary drafts k candidates a round;
greedy tokens are those plain decoding gives, fused and P/D, a drafter
equal to the target has every candidate accepted, a sampling drafter's
output follows the target's distribution, and drafts that cannot work are
refused at load with the key and the fix. The draft's K/V live in the
target's pages (tests/engine/spec/test_spec_draft_pages.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.benchmarks.spec.draft import write_random_checkpoint
from pdserve.config import ServeConfig
from pdserve.kernels.attention import TorchAttention
from pdserve.kernels.spec.draft_model import DraftModelProposer
from pdserve.kernels.models.loader import TINY_SEED, attention_shape, build_model
from pdserve.kernels.models.model import random_weights
from pdserve.kernels.models.model_config import tiny_config
from pdserve.kernels.spec.proposers import DraftAsk
from pdserve.kernels.spec.rejection import VerifyRow, verify
from pdserve.engine.local_pair import LocalPair
from pdserve.engine.spec.draft import check_draft_section
from pdserve.engine.spec.speculation import check_peer_spec
from pdserve.scheduler import ConfigError, EngineConfig, RejectedRequest

from test_spec_pd import RealPD, make_prompts

PROMPTS = [[5, 17, 42, 9, 3, 77, 12, 8, 5, 17, 42, 9, 3, 77, 12, 8, 5, 17],
           [5, 17, 42, 9, 3, 77, 12, 8, 90, 91, 4],
           list(range(1, 30)) + list(range(1, 12)),
           [94, 3, 94, 3, 94]]
SAME = {"method": "draft", "num_speculative_tokens": 3, "draft_model": {"preset": "tiny"},
        "gate": False}
CHI2_999_5 = 20.52          # chi-squared at p = 0.001, 5 degrees of freedom


def greedy(n=16):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def write_noisy_tiny(d, noise: float, vocab: int | None = None):
    """The tiny preset's weights plus Gaussian noise, as a Hugging Face
    Llama checkpoint: a draft that agrees with the target often, not
    always (so verifies accept some candidates and reject others).
    `vocab`: another vocabulary size (random weights of that size)."""
    c = tiny_config()
    if vocab is not None:
        return write_random_checkpoint(d, vocab, c.bos_token_id, c.eos_token_ids)
    return write_random_checkpoint(d, c.vocab_size, c.bos_token_id, c.eos_token_ids,
                                   noise_of=random_weights(c, TINY_SEED), noise=noise)


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    d = write_noisy_tiny(tmp_path_factory.mktemp("draft") / "noisy", noise=0.1)
    return {"method": "draft", "num_speculative_tokens": 3, "draft_model": {"path": str(d)},
            "gate": False}


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in LLM().generate(PROMPTS, greedy(), use_tqdm=False)]


def test_a_drafter_equal_to_the_target_accepts_every_candidate(reference):
    """Draft = target (the tiny preset twice): greedy candidates are the
    target's argmax, sampled ones are drawn from q = p; every one is kept."""
    llm = LLM(speculative=SAME)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)] == reference
    c = llm.executor.spec.counts
    assert c.drafts > 0 and c.accepted_tokens == c.draft_tokens
    sampled = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, ignore_eos=True, seed=5)
    llm.generate(PROMPTS[:2], sampled, use_tqdm=False)
    c = llm.executor.spec.counts
    assert c.accepted_tokens == c.draft_tokens > 0
    llm.engine.planner.assert_idle()


@pytest.mark.parametrize("engine", [
    {},
    pytest.param({"max_scheduled_tokens": 8, "page_size": 4},        # chunks; budgets cut rows
                 marks=pytest.mark.slow),
    {"max_scheduled_tokens": 16, "enable_mixed_prefill_decode": False},   # chunked prompts
    {"page_size": 4, "total_pages": 24, "safe_steps": 4},            # retraction; draft evictions
    pytest.param({"overlap": True}, marks=pytest.mark.slow),
])
def test_greedy_tokens_are_identical_with_a_draft_model(reference, noisy, engine):
    llm = LLM(speculative=noisy, **engine)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)] == reference
    c = llm.executor.spec.counts
    assert 0 < c.accepted_tokens < c.draft_tokens      # some kept, some rejected
    llm.engine.planner.check_invariants()
    llm.engine.planner.assert_idle()


@pytest.mark.slow
def test_prefix_hits_serve_the_drafts_k_v_too(reference, noisy):
    """The second pass hits the target's prefix cache, whose pages hold the
    draft's K/V beside the target's: the drafter computes only what the
    target computes, and the tokens do not change."""
    llm = LLM(speculative=noisy, page_size=4)
    first = [o.token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    drafter = llm.executor.spec.proposer
    fed, computed = drafter.kept_rows, llm.executor.forward_tokens
    again = [o.token_ids for o in llm.generate(
        [p + t[:8] for p, t in zip(PROMPTS, first)], greedy(8), use_tqdm=False)]
    assert first == reference and again == [t[8:16] for t in reference]
    assert llm.engine.planner.hits.device_tokens > 0
    # the draft fed no more rows than the target computed
    assert drafter.kept_rows - fed <= llm.executor.forward_tokens - computed


def test_p_drafts_on_the_completing_forward_and_d_verifies_to_the_fused_tokens(noisy):
    llm = LLM(page_size=4)
    prompts = make_prompts(llm)
    want = [o.token_ids for o in llm.generate(prompts, greedy(16), use_tqdm=False)]
    pd = RealPD(llm, speculative=noisy)
    assert pd.generate(prompts, greedy(16)) == want
    assert pd.shipped_drafts > 0 and pd.first_verifies > 0
    assert pd.px.spec.proposer.forwards > 0          # P ran the drafter on its prompts
    assert pd.dx.spec.counts.accepted_tokens > 0
    # D drafts from the pages P shipped, with the draft's K/V in them: it
    # never fed a prompt's rows itself
    assert pd.dx.spec.proposer.kept_rows < sum(len(p) for p in prompts)


def test_a_pair_with_an_equal_draft_accepts_everything_d_verifies(reference):
    cfg = EngineConfig(page_size=4, total_pages=128, speculative=SAME)
    llm = LLM()
    pd = LocalPair(llm.model, llm.tokenizer, cfg)
    assert pd.generate(PROMPTS[:2], greedy()) == reference[:2]
    c = pd.dx.spec.counts
    assert c.accepted_tokens == c.draft_tokens > 0


def tiny_draft(vocab: int, seed: int, layers: int = 1):
    cfg = dataclasses.replace(tiny_config(), vocab_size=vocab, num_layers=layers,
                              bos_token_id=0, eos_token_ids=(vocab - 1,))
    return build_model(cfg, random_weights(cfg, seed), torch.float32, "cpu",
                       TorchAttention(**attention_shape(cfg)))


class Solo:
    """A draft proposer over caches of its own (no target): each ask's
    block table is a run of fresh pages, the last `scratch` pages spare."""

    def __init__(self, model, pages: int, page_size: int, scratch: int = 8):
        self.ps, self.next = page_size, 0
        caches = model.new_caches([pages + scratch], page_size)
        self.drafter = DraftModelProposer(model, caches, [list(range(pages, pages + scratch))],
                                          page_size)

    def ask(self, *args, **kw) -> DraftAsk:
        """A DraftAsk whose table holds its context's positions (the new
        token's page and the candidates' come from the scratch pages)."""
        a = DraftAsk(*args, **kw)
        n = -(-(len(a.context) - 1) // self.ps)
        self.next += n
        return dataclasses.replace(a, tables=(list(range(self.next - n, self.next)),))

    def propose(self, asks):
        return self.drafter.propose(asks)


def test_sampled_output_with_a_draft_model_follows_the_target_distribution():
    """A real draft model on a 6-token vocabulary samples its candidates
    from q (its own logits under the request's temperature); each verify's
    first token, over 4,000 seeds, is distributed as the target's p
    (chi-squared at p = 0.001), though q is far from p."""
    drafter = Solo(tiny_draft(6, seed=3), pages=1, page_size=8, scratch=4000)
    sp = SamplingParams(temperature=1.5)
    n = 4000
    # one-token contexts: every request's rows batch as decodes
    asks = [drafter.ask(f"r{s}", [2], 2, sp, s, 0) for s in range(n)]
    drafts = drafter.propose(asks)
    assert all(len(d.tokens) == 2 and d.probs.shape == (2, 6) for d in drafts)
    torch.manual_seed(7)
    target = torch.randn(3, 6) * 1.5           # the target's rows: fixed, context-free
    p = torch.softmax(target[0].double() / 1.5, -1)
    rows = [VerifyRow(d.tokens, sp, s, 0, d.probs) for s, d in enumerate(drafts)]
    out = verify(target.repeat(n, 1), rows)
    first = [0] * 6
    for o in out:
        first[o[0]] += 1
    chi2 = sum((c - n * q) ** 2 / (n * q) for c, q in zip(first, p.tolist()))
    assert chi2 < CHI2_999_5, (first, p)
    q0 = drafts[0].probs[0].double()
    assert (q0 - p).abs().max() > 0.1           # q is not p: min(1, p/q) did the work
    # the draft drew its first candidates from q0: the same test against q0
    drawn = [0] * 6
    for d in drafts:
        drawn[d.tokens[0]] += 1
    assert sum((c - n * q) ** 2 / (n * q) for c, q in zip(drawn, q0.tolist())) < CHI2_999_5


def test_a_seeded_request_drafts_the_same_alone_or_batched():
    drafter = Solo(tiny_draft(98, seed=4), pages=64, page_size=4)
    sp = SamplingParams(temperature=1.0, seed=11)
    ask = drafter.ask("a", list(range(1, 14)), 3, sp, 11, 5)
    alone = drafter.propose([ask])[0].tokens
    others = [drafter.ask(f"o{i}", list(range(i, i + 9)), 2, sp, i, 0) for i in range(5)]
    batched = drafter.propose(others[:2] + [ask] + others[2:])[2].tokens
    assert batched == alone


def test_a_draft_proposes_no_further_than_its_positions():
    model = tiny_draft(98, seed=4)
    model.cfg = dataclasses.replace(model.cfg, max_position=12)
    drafter = Solo(model, pages=16, page_size=4)
    got = drafter.propose([drafter.ask("a", list(range(1, 11)), 5),
                           drafter.ask("b", [1] * 13, 2)])
    assert [len(d.tokens) for d in got] == [3, 0]       # positions 10 and 11; none past 12


def test_a_draft_with_another_vocabulary_is_refused_at_load(tmp_path):
    write_noisy_tiny(tmp_path / "v256", 0.0, vocab=256)     # the target's is 98
    spec = {"method": "draft", "draft_model": {"path": str(tmp_path / "v256")}}
    with pytest.raises(ConfigError) as e:
        LLM(speculative=spec)
    msg = str(e.value)
    assert "engine.speculative.draft_model" in msg and "256 tokens" in msg and "98" in msg
    assert "same tokenizer" in msg
    # `pdserve up` makes the same check from the config alone, before Ray starts
    with pytest.raises(ConfigError, match="256 tokens where the target's has 98"):
        check_draft_section({"path": str(tmp_path / "v256")}, tiny_config())


@pytest.mark.parametrize("spec, words", [
    ({"method": "draft", "num_speculative_tokens": 0, "draft_model": {"preset": "tiny"}},
     "num_speculative_tokens must be an integer in [1, 16]"),
    ({"method": "drafty"}, "method is 'drafty', which does not exist; use one of ngram, draft"),
    ({"method": "draft"}, "give engine.speculative.draft_model"),
    ({"method": "draft", "draft_model": {"preset": "tiny", "path": "/x"}}, "either path or preset"),
    ({"method": "draft", "draft_model": {"preset": "tiny", "device": "cuda"}}, "device"),
    ({"method": "draft", "draft_model": {"dtype": "float32"}}, "names no model"),
    ({"method": "ngram", "draft_model": {"preset": "tiny"}}, "set method: draft"),
])
def test_bad_draft_settings_are_refused_with_the_key(spec, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        ServeConfig.from_dict({"speculative": spec})


def test_a_draft_with_tensor_parallelism_is_refused():
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(speculative=SAME, tensor_parallel_size=2)


def test_the_handshake_compares_the_draft_model():
    cfg = EngineConfig(speculative=SAME)
    line = cfg.speculative.describe()
    assert line == "method=draft num_speculative_tokens=3 draft_model=preset:tiny"
    other = line.replace("preset:tiny", "path:/models/draft")
    peer = type("AddPeer", (), {"engine": "prefill-0", "spec_config": other})()
    with pytest.raises(RejectedRequest, match="draft_model=path:/models/draft"):
        check_peer_spec("decode-0", cfg, peer)
    check_peer_spec("decode-0", cfg, type("AddPeer", (), {"engine": "p", "spec_config": line})())


@pytest.mark.slow
def test_bench_spec_draft_cases(capsys):
    """`pdserve bench spec --draft-only` on the tiny preset: the target
    drafting for itself keeps every candidate, a random draft checkpoint
    with its vocabulary keeps few, and every output equals speculation off."""
    from pdserve.cli.main import main

    code = main(["bench", "spec", "--preset", "tiny", "--dtype", "float32", "--draft-only",
                 "--concurrency", "1,2", "--requests", "1", "--max-tokens", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in out.splitlines()
            if ln.startswith("| ") and not ln.startswith("| case") and "---" not in ln]
    assert [r[0] for r in rows] == ["off", "ngram k=3", "draft = target k=3",
                                    "random draft k=3"] * 2
    for r in rows:
        done, total = r[-1].split("/")
        assert done == total
        if r[0] == "draft = target k=3":
            kept, carried = r[2].split("/")
            assert kept == carried and int(carried) > 0


@pytest.mark.slow
def test_a_sliding_window_draft_drafts_for_its_own_target(tmp_path):
    """Gemma 3 (local and global layers) drafting for itself: the draft's
    windows are masked in its own cache, every candidate is accepted, and
    the tokens are plain decoding's."""
    pytest.importorskip("transformers")
    from test_spec_models import gemma3_checkpoint, greedy as gemma_greedy, serve

    d = gemma3_checkpoint(tmp_path / "gemma")[1]
    want = gemma_greedy(serve(d))
    llm = serve(d, speculative={"method": "draft", "num_speculative_tokens": 3,
                                "draft_model": {"path": str(d), "attention": "torch"},
                                "gate": False})
    assert gemma_greedy(llm) == want
    c = llm.executor.spec.counts
    assert c.accepted_tokens == c.draft_tokens > 0
    llm.engine.planner.assert_idle()
