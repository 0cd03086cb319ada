"""Hybrid state models served by the real engine: Qwen3.5 (Gated DeltaNet
layers beside full attention) and LFM2 (short-conv layers beside full
attention), the planner's state group and the executor's state slots
together (spec §1.2). Greedy tokens against transformers, unchanged by
chunk size, by a warm prefix cache whose hits restore state checkpoints
(from the device or the host cache), and by retraction with and without
the host cache; a long request's state slots stay bounded."""

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.scheduler.cache.groups import HOLE

from support.checkpoints import lfm2_checkpoint
from support.checkpoints import qwen3_5_checkpoint

transformers = pytest.importorskip("transformers")
FAMILIES = {"qwen3_5": qwen3_5_checkpoint, "lfm2": lfm2_checkpoint}

PS = 4
BLOCK = 8
NEW = 10


def prompts():
    g = torch.Generator().manual_seed(11)
    base = torch.randint(3, 128, (60,), generator=g).tolist()
    other = torch.randint(3, 128, (30,), generator=g).tolist()
    # the third shares the first's 36-token prefix: a hit at the checkpoint at 32
    return [base[:45], base[:60], base[:36] + other[:20]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    model, d = FAMILIES[request.param](tmp_path_factory.mktemp(request.param))
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
    """Wraps an LLM's executor: forwarded rows, retractions, state slots held."""

    def __init__(self, llm):
        self.retracts, self.forward, self.peak, self.state_loads = 0, 0, 0, 0
        ex = llm.executor
        run = ex.run

        def watched(plan):
            self.retracts += len(plan.retracts)
            self.state_loads += sum(len(ld.device_pages) for ld in plan.loads
                                    if ld.group == ex.state)
            self.forward += sum(op.tokens for op in plan.prefills) + len(plan.decodes)
            for req in [op.req for op in plan.prefills] + list(plan.decodes):
                state = req.state.res.tables[-1]
                self.peak = max(self.peak, sum(1 for s in state if s != HOLE))
            return run(plan)
        ex.run = watched


def serve(d, **engine):
    base = dict(page_size=PS, total_pages=96, max_scheduled_tokens=16, max_batch_size=8,
                state_block=BLOCK)
    base.update(engine)
    llm = LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch", **base)
    return llm, Watch(llm)


def greedy(llm, ps=None):
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(ps or prompts(), sp, use_tqdm=False)]


def test_the_engine_serves_the_state_layers_as_a_snapshot_state_group(served):
    d, _ = served
    llm, _ = serve(d)
    groups = llm.engine.planner.groups
    assert [g.retention for g in groups] == ["full_history", "snapshot_state"]
    assert groups[1].layers == llm.executor.model.cfg.state_layers()
    assert llm.engine.planner.prefix_tokens == BLOCK


@pytest.mark.parametrize("budget", [8, 24, 128])
def test_greedy_tokens_match_transformers_at_every_chunk_size(served, budget):
    d, want = served
    llm, watch = serve(d, max_scheduled_tokens=budget)
    assert greedy(llm) == want
    # a chunk's read state, its checkpoint and final state, a growth block
    assert 0 < watch.peak <= 4
    llm.engine.planner.assert_idle()


def test_a_warm_prefix_cache_restores_checkpoints_and_changes_nothing(served):
    d, want = served
    llm, watch = serve(d)
    assert greedy(llm) == want
    cold = watch.forward
    watch.forward = 0
    assert greedy(llm) == want
    # each prompt resumes at its last published checkpoint (40, 56 and 32 of
    # 45, 60 and 56 tokens; the third's own prompt published nothing past
    # the shared 32): only the tail and the decodes run again
    assert watch.forward == (45 - 40) + (60 - 56) + (56 - 48) + 3 * (NEW - 1) < cold
    llm.engine.planner.assert_idle()


@pytest.mark.parametrize("host_pages", [0, 256])
def test_retraction_with_and_without_the_host_cache_changes_nothing(served, host_pages):
    d, want = served
    ps = prompts()
    llm, watch = serve(d, total_pages=20, safe_steps=1, host_pages=host_pages)
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(ps + ps, sp, use_tqdm=False)]
    assert watch.retracts > 0
    assert got == want + want
    llm.engine.planner.assert_idle()


def test_checkpoints_the_device_evicted_come_back_from_the_host_cache(served):
    """With room for few state slots, the checkpoints the first pass cached
    are evicted from the device by the time the second pass asks; the host
    cache still holds them, and restoring them from there changes nothing."""
    d, want = served
    llm, watch = serve(d, state_slots=6, host_pages=256, max_batch_size=1)
    assert greedy(llm) == want
    cold = watch.forward
    watch.forward = 0
    assert greedy(llm) == want
    assert watch.state_loads > 0 and watch.forward < cold
    llm.engine.planner.assert_idle()
