"""A sliding-window model (Gemma 3, window 8) served by the real engine:
the planner's cache groups and the executor together, greedy tokens against
transformers, unchanged by chunk size, by a warm prefix cache, by bounded
replay, and by retraction with and without the host cache; the pages a long
request holds on the sliding group stay bounded by window + chunk."""

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.scheduler.cache.groups import HOLE
from pdserve.scheduler.capacity import sliding_request_pages

from support.checkpoints import WINDOW, gemma3_checkpoint

transformers = pytest.importorskip("transformers")

PS = 4
NEW = 10


def prompts():
    g = torch.Generator().manual_seed(7)
    base = torch.randint(3, 128, (60,), generator=g).tolist()
    other = torch.randint(3, 128, (30,), generator=g).tolist()
    # the third shares the first's 36-token prefix: a hit when the first is cached
    return [base[:45], base[:60], base[:36] + other[:20]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model, d = gemma3_checkpoint(tmp_path_factory.mktemp("sliding"))
    want = []
    with torch.no_grad():
        for p in prompts():
            ids = list(p)
            for _ in range(NEW):          # greedy by whole recomputation: no cache to doubt
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            want.append(ids[len(p):])
    return d, want


class Watch:
    """Wraps an LLM's executor: what each round's plan asked for."""

    def __init__(self, llm):
        self.llm, self.replayed, self.retracts, self.peak, self.forward = llm, 0, 0, 0, 0
        ex = llm.executor
        run = ex.run

        def watched(plan):
            self.replayed += sum(op.replay for op in plan.prefills)
            self.retracts += len(plan.retracts)
            self.forward += sum(op.tokens + op.replay for op in plan.prefills) + len(plan.decodes)
            for req in [op.req for op in plan.prefills] + list(plan.decodes):
                sliding = req.state.res.tables[1]
                self.peak = max(self.peak, sum(1 for pg in sliding if pg != HOLE))
            return run(plan)
        ex.run = watched


def serve(d, **engine):
    base = dict(page_size=PS, total_pages=96, sliding_pages=64, max_scheduled_tokens=16,
                max_batch_size=8)
    base.update(engine)
    llm = LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch", **base)
    return llm, Watch(llm)


def greedy(llm, ps=None):
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(ps or prompts(), sp, use_tqdm=False)]


def test_greedy_tokens_match_transformers_at_every_chunk_size(checkpoint):
    d, want = checkpoint
    for budget in (16, 24, 128):
        llm, watch = serve(d, max_scheduled_tokens=budget)
        assert greedy(llm) == want, budget
        # the sliding group held its window and one chunk, never the prompt
        assert 0 < watch.peak <= sliding_request_pages(llm.engine_config, WINDOW, budget)
        if budget < 60:
            assert watch.peak < -(-60 // PS)
        llm.engine.planner.assert_idle()


def test_a_warm_prefix_cache_serves_both_groups_and_changes_nothing(checkpoint):
    d, want = checkpoint
    llm, watch = serve(d)
    assert greedy(llm) == want
    cold = watch.forward
    watch.forward = 0
    assert greedy(llm) == want
    # the second pass found its prompts cached, sliding lookback included:
    # each computes at most its last page, then decodes
    assert watch.forward <= 3 * (PS + NEW - 1) < cold
    llm.engine.planner.assert_idle()


def test_bounded_replay_regenerates_the_window_exactly(checkpoint):
    d, want = checkpoint
    llm, watch = serve(d, sliding_replay=True, max_scheduled_tokens=64)
    (grp,) = [g for g in llm.engine.planner.groups if g.sliding]
    # four sliding layers stacked, each reading 7 positions back
    assert grp.replayable and llm.engine.planner.replay_tokens == 4 * (WINDOW - 1)
    assert greedy(llm) == want
    assert greedy(llm) == want
    assert watch.replayed > 0
    assert llm.engine.planner.coord.groups[1].index.num_cached == 0
    llm.engine.planner.assert_idle()


@pytest.mark.parametrize("host_pages", [0, 256])
def test_retraction_with_and_without_the_host_cache_changes_nothing(checkpoint, host_pages):
    d, want = checkpoint
    ps = prompts()
    llm, watch = serve(d, total_pages=28, sliding_pages=40, safe_steps=1, host_pages=host_pages)
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(ps + ps, sp, use_tqdm=False)]
    assert watch.retracts > 0
    assert got == want + want
    llm.engine.planner.assert_idle()
