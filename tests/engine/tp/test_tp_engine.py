"""A tensor-parallel engine: one planner on rank 0, each round's forward
sent to the other rank (a spawned process), every rank computing its shard.
Greedy tokens equal a TP 1 engine's; the debug digest check passes on
honest ranks and fails loudly when a rank's view differs; a rank that dies
or stops downs the engine with TpLost instead of hanging it."""

import dataclasses
import os
import pickle
import signal
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.kernels.tensor_parallel import TpLost
from pdserve.engine.tp.leader import TpLeader
from pdserve.engine.tp.messages import TpForward
from pdserve.engine.tp.worker import TpDivergence, TpSpec
from pdserve.scheduler.config import ConfigError, EngineConfig
from support.tp import greedy

PROMPTS = ["hello there", "tensor parallel", "a", "the quick brown fox jumps"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(page_size=4, total_pages=256, max_scheduled_tokens=16, max_batch_size=8)


def _tokens(llm) -> list:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_tp2_engine_gives_tp1_tokens_with_every_round_checked():
    """Chunked prefills (16 tokens a round over four prompts), mixed rounds
    and batched decodes: the same greedy tokens; with
    tensor_parallel_check every round's digests were compared."""
    want = _tokens(LLM(dtype="float32", attention="torch", **ENGINE))
    tp = LLM(dtype="float32", attention="torch", tensor_parallel_size=2,
             tensor_parallel_check=True, **ENGINE)
    try:
        assert _tokens(tp) == want
        assert tp.model.round > len(PROMPTS)     # rounds went to the other rank, checked
    finally:
        tp.close()


@pytest.mark.slow
def test_tp2_engine_with_overlap_gives_tp1_tokens():
    """engine.overlap: the forward (and so the round's send) runs on the
    executor's forward thread while the next plan is built."""
    want = _tokens(LLM(dtype="float32", attention="torch", **ENGINE))
    tp = LLM(dtype="float32", attention="torch", tensor_parallel_size=2, overlap=True,
             tensor_parallel_check=True, **ENGINE)
    try:
        assert _tokens(tp) == want
    finally:
        tp.close()


class _Lying(TpLeader):
    """Rank 0 tells the other rank other tokens than the ones it runs at round 2."""

    def _send_bytes(self, payload: bytes) -> None:
        msg = pickle.loads(payload)
        if isinstance(msg, TpForward) and msg.round == 2:
            payload = pickle.dumps(dataclasses.replace(msg, ids=(msg.ids + 1) % 98))
        super()._send_bytes(payload)


def test_a_rank_whose_view_differs_fails_the_round_loudly():
    """Rank 1 gets a valid round, though not rank 0's: the digests differ
    at round 2 and the forward raises TpDivergence (a TpLost: the engine
    goes down), on rank 0 as on rank 1."""
    lost: list = []
    leader = _Lying(TpSpec(None, "tiny", "float32", "torch", "cpu", 2, 30.0, check=True),
                    on_lost=lost.append)
    try:
        with pytest.raises(TpDivergence, match=r"ranks \[1\] diverge from rank 0 at round 2"):
            greedy(leader, [[5, 6, 7], [8, 9]], 4)
        assert len(lost) == 1
        leader.procs[0].join(30)
        assert leader.procs[0].exitcode == 3         # rank 1 saw it too, and left
    finally:
        leader.close()


def _leader(timeout_s: float, lost: list) -> LLM:
    llm = LLM(dtype="float32", attention="torch", tensor_parallel_size=2,
              tensor_parallel_timeout_s=timeout_s, **ENGINE)
    llm.model.on_lost = lost.append
    return llm


def test_a_killed_rank_downs_the_engine():
    lost: list = []
    llm = _leader(30.0, lost)
    try:
        assert _tokens(llm)
        worker = llm.model.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        # the engine fails the round's requests with the rank's loss (a served
        # engine's on_lost exits its process first: Ray restarts it whole)
        with pytest.raises(RuntimeError, match="TpLost: tensor-parallel rank 1 .* exited"):
            _tokens(llm)
        assert len(lost) == 1
        with pytest.raises(RuntimeError, match="TpLost"):   # and stays down
            _tokens(llm)
    finally:
        llm.close()


def test_a_large_round_to_a_stopped_rank_does_not_block_rank_0():
    """A round larger than a pipe holds (256 requests' tables: 80 KB) to a
    rank that stopped reading: rank 0's write gives up at the timeout."""
    lost: list = []
    leader = TpLeader(TpSpec(None, "tiny", "float32", "torch", "cpu", 2, 2.0),
                      on_lost=lost.append)
    worker = leader.procs[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TpLost, match="not taken by every tensor-parallel rank"):
            leader._written(leader._send_bytes(b"x" * (256 << 10)), 256 << 10)
        assert time.monotonic() - t0 < 10 and len(lost) == 1
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        leader.close()


@pytest.mark.slow
def test_a_stopped_rank_downs_the_engine_within_the_timeout():
    """SIGSTOP: the process lives, its pipe is open, it just never meets
    rank 0 in the collective. The collective's timeout (3 s) ends it."""
    lost: list = []
    llm = _leader(3.0, lost)
    worker = llm.model.procs[0]
    try:
        assert _tokens(llm)
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="TpLost"):
            _tokens(llm)
        assert time.monotonic() - t0 < 30
        assert len(lost) == 1
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        llm.close()


def test_tiers_a_tp_engine_lacks_are_refused_by_name():
    with pytest.raises(ConfigError, match="host_pages with tensor_parallel_size 2"):
        EngineConfig(tensor_parallel_size=2, host_pages=64)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_a_cluster_count_may_carry_its_tensor_parallel_size():
    from pdserve.config import ServeConfig, role_engine

    cfg = ServeConfig.from_dict({"engine": {"tensor_parallel_size": 1},
                                 "cluster": {"fused": {"count": 2, "tensor_parallel_size": 2}}})
    assert cfg.cluster.fused == 2 and cfg.cluster.tp_size("fused") == 2
    assert role_engine(cfg, "fused").tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"unknown key.*tp"):
        ServeConfig.from_dict({"cluster": {"fused": {"count": 1, "tp": 2}}})
    with pytest.raises(ConfigError, match="cluster.fused is a mapping without count"):
        ServeConfig.from_dict({"cluster": {"fused": {"tensor_parallel_size": 2}}})


def test_a_family_not_sharded_is_refused_for_its_role():
    from pdserve.config import ServeConfig
    from pdserve.kernels.models.model_config import tiny_config
    from pdserve.kernels.tensor_parallel import TpError, check_roles

    cfg = ServeConfig.from_dict({"cluster": {"fused": {"count": 1, "tensor_parallel_size": 2}}})
    with pytest.raises(TpError, match="cluster.fused: tensor_parallel_size 2 with a lfm2 model"):
        check_roles(dataclasses.replace(tiny_config(), arch="lfm2"), cfg)
    check_roles(tiny_config(), cfg)


def test_lora_under_tensor_parallelism_is_refused_by_name(tmp_path):
    from pdserve.config import ServeConfig

    with pytest.raises(ConfigError, match="lora with tensor_parallel_size > 1"):
        ServeConfig.from_dict({"lora": {"adapters": {"sql": str(tmp_path)}},
                               "cluster": {"fused": {"count": 1, "tensor_parallel_size": 2}}})
