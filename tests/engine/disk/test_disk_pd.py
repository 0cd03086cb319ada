"""The disk (L3) tier under P/D on the CPU engine (the tiny model): D loads
the prefix it finds on disk and asks P only for the rest, P loads its own
disk hit and computes only the rest, and the greedy tokens are those of a
fused engine without the tier. A D read that misses after admission
withholds the peer pull; P is then asked for the whole prompt.

The two engines run in-process on one model; what the cluster carries
between them (the ask, the KV write into D's landing pages, the first
token, the ack) is done by hand, as the loopback transport would."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.disk.groups import window_files
from pdserve.engine.disk.model_match import weights_fingerprint
from pdserve.engine.disk.tier import DiskTier
from pdserve.engine.engine import Engine
from pdserve.engine.executor.torch_executor import TorchExecutor
from pdserve.scheduler.config import DiskCacheConfig
from pdserve.scheduler.round.grammar import Role
from pdserve.scheduler.planner import Planner
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.transfer.disk.fake import FakeStore
from pdserve.transfer.disk.store import DiskOp

ENGINE = dict(page_size=4, total_pages=48, host_pages=24, max_scheduled_tokens=64)
SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BASE = list(range(10, 58))                      # 48 tokens: 12 pages
TURNS = [BASE + [60 + i, 61 + i, 62 + i, 63 + i, 64 + i] for i in range(2)]
PAGES = 14                                      # the 53-token prompts' pages P writes into D


@pytest.fixture(scope="module")
def base() -> LLM:
    return LLM(None, **ENGINE)


@pytest.fixture(scope="module")
def reference(base) -> list[list[int]]:
    """A fused engine's tokens, no disk tier."""
    return [o.token_ids for o in base.generate(TURNS, SP, use_tqdm=False)]


@dataclasses.dataclass
class Shipped:
    first_page: int             # the first page D asked for
    pages: int                  # pages P wrote into D's landing pages
    p_computed: int             # prompt tokens P's forwards computed
    p_disk_tokens: int          # prompt tokens P read from disk


class PDNode:
    """A P and a D engine on one node: both disk tiers on `store`."""

    def __init__(self, llm: LLM, store: FakeStore, d_policy: str = "wait_complete"):
        self.llm = llm
        self.P = self._engine(Role.PREFILL, store, "wait_complete")
        self.D = self._engine(Role.DECODE, store, d_policy)
        self.withheld = 0           # D's asks withheld after their admission round

    def _engine(self, role: Role, store, policy: str) -> Engine:
        m = self.llm.model
        cfg = dataclasses.replace(self.llm.engine_config, disk_cache=DiskCacheConfig(
            path="fake", prefetch_policy=policy))
        ex = TorchExecutor(m, self.llm.tokenizer, cfg, disk=None)
        ex.disk = DiskTier(cfg.disk_cache, store, model_id=weights_fingerprint(m),
                           dtype="float32", layout=ex.caches[0].layout(),
                           page_size=cfg.page_size, state=ex.state_files(),
                           windows=window_files(ex.groups, ex.caches))
        return Engine(role.value, Planner(cfg, role, groups=ex.groups), ex,
                      forget_finished=False)

    def generate(self, rid: str, prompt: list[int], before_build=None) -> tuple[list, Shipped]:
        """`prompt`'s tokens through D (asking P), and what P shipped.
        `before_build(D)`: called once before D's first round."""
        P, D = self.P, self.D
        req = Request(rid, list(prompt), SamplingLimits(max_new_tokens=SP.max_tokens))
        D.executor.register(rid, SP, fallback_seed=1, prompt=req.prompt.tokens)
        D.submit(req)
        if before_build is not None:
            before_build(D)
        shipped = None
        while D.planner.has_work():
            out = D.step()
            for op in out.plan.remote_prefills if out is not None else ():
                if op.req.id not in D.planner.landing:  # as the loop's peer_work: not asked
                    self.withheld += 1
                    continue
                shipped = self._prefill_on_p(op)
            D.planner.check_invariants()
        D.planner.assert_idle()
        P.planner.assert_idle()
        assert shipped is not None
        return req.output, shipped

    def _prefill_on_p(self, ask) -> Shipped:
        """P prefills the prompt (its disk hit read, the rest computed) and
        its pages from `ask.first_page` land in D's landing pages."""
        P, D = self.P, self.D
        r = ask.req
        twin = Request(r.id, r.prompt.tokens, SamplingLimits(max_new_tokens=1))
        twin.first_page = ask.first_page
        P.executor.register(twin.id, SamplingParams(max_tokens=1, temperature=0,
                                                    ignore_eos=True), fallback_seed=1)
        disk0 = P.planner.hits.disk_tokens
        P.submit(twin)
        computed = 0
        while True:
            out = P.step()
            assert out is not None, "P stalled"
            computed += sum(op.tokens for op in out.plan.prefills)
            P.planner.check_invariants()
            if out.plan.remote_decodes:
                (ship,) = out.plan.remote_decodes
                break
        for g, (src, dst) in enumerate(zip(ship.src, ask.landing)):    # every group's slots
            into, out = D.executor.caches[g], P.executor.caches[g]
            if g == D.executor.state:
                into.copy_slots_from(out, src, dst)
            else:
                into.copy_pages_from(out, src, dst)
        stopped = D.executor.on_token(r, ship.first_token)
        D.planner.transfer_landed(r.id, ship.first_token, stopped)
        P.planner.peer_ack(r.id)
        P.executor.forget(r.id)
        return Shipped(ask.first_page, len(ship.src[0]), computed,
                       P.planner.hits.disk_tokens - disk0)

    def close(self) -> None:
        assert self.D.executor.disk.flush() and self.P.executor.disk.flush()


def test_d_loads_its_disk_prefix_and_p_computes_and_ships_only_the_rest(base, reference):
    """Turn 1 fills the node's disk (P writes what it computed, D what
    landed). A restarted node serves turn 2: D reads the shared prefix
    from disk and asks P for the pages after it; P reads the same prefix
    from disk and computes only the rest; the tokens are a fused engine's."""
    store = FakeStore()
    node = PDNode(base, store)
    out, first = node.generate("t1", TURNS[0])
    assert out == reference[0]
    assert first.first_page == 0 and first.pages == PAGES and first.p_computed == len(TURNS[0])
    node.close()
    node = PDNode(base, store)                  # a restart: device and host empty
    out, second = node.generate("t2", TURNS[1])
    assert out == reference[1]
    hit = 12                                    # BASE's 12 pages, 48 tokens
    assert node.D.planner.hits.disk_tokens == hit * 4
    assert second.first_page == hit and second.pages == PAGES - hit
    assert second.p_disk_tokens == hit * 4
    assert second.p_computed == len(TURNS[1]) - hit * 4
    assert node.withheld == 0
    node.close()


def test_a_d_read_that_misses_withholds_the_pull_and_p_computes_everything(base, reference):
    """best_effort admits on what the EXISTS probe found; the read then
    drops: D retracts before asking (no suffix ever lands on its empty
    prefix pages) and asks P for the whole prompt. P's own reads drop too,
    so P computes it all. The tokens are a fused engine's."""
    store = FakeStore()
    node = PDNode(base, store)
    node.generate("t1", TURNS[0])
    node.close()
    node = PDNode(base, store, d_policy="best_effort")

    def probe_landed(D):
        store.faults.drop = {c for op, c in store.log if op is DiskOp.PUT}
        D.executor.disk.before_build(D.planner)     # EXISTS finds them, GETs drop
        assert store.drain()

    out, shipped = node.generate("t2", TURNS[1], before_build=probe_landed)
    assert out == reference[1]
    assert node.D.planner.hits.disk_missed == 1 and node.D.planner.hits.disk_tokens == 0
    assert node.withheld == 1
    assert shipped.first_page == 0 and shipped.pages == PAGES
    assert shipped.p_computed == len(TURNS[1])
    node.close()

