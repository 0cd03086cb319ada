"""P/D with latent attention's cache: P ships the latent pages, D lands
them. The cache is the same on every rank of a tensor-parallel engine, so
the transfer plan sends each D rank one copy whatever P's size, never
packs or unpacks, and each D rank is told its pages landed; a peer whose
pages hold K and V is refused at the handshake, both sides named. A P/D
pair in one process gives the fused engine's (and transformers') tokens
for both MoE families."""

import time

import pytest
import torch

from pdserve import SamplingParams
from pdserve.engine.local_pair import LocalPair
from pdserve.engine.executor.torch_executor import TorchExecutor
from pdserve.engine.tp.transfer import kv_layout
from pdserve.kernels.models.loader import load_model
from pdserve.scheduler.config import EngineConfig
from pdserve.transfer.kv_layout import KvLayout
from pdserve.transfer.tp.pieces import KvPiece, PieceWire, bytes_per_rank, piece_wire, plan_pieces
from pdserve.transfer.tp.rank_agent import KvRankAgent
from support.checkpoints import hf_greedy
from support.moe import deepseek_v3_checkpoint, qwen3_moe_checkpoint

transformers = pytest.importorskip("transformers")

LAYERS, PS, WIDTH = 3, 4, 40


def _latent(tp: int) -> KvLayout:
    return KvLayout(tp, 1, WIDTH, "float32", PS, (LAYERS,), parts=1)


@pytest.mark.parametrize("p,d,want", [
    (1, 1, [KvPiece(0, 0, 0, 1, 0, 0)]),
    (2, 1, [KvPiece(0, 0, 0, 1, 0, 0)]),                            # one copy, from rank 0
    (1, 2, [KvPiece(0, 0, 0, 1, 0, 0), KvPiece(0, 1, 0, 1, 0, 0)]),  # each D rank its copy
    (2, 2, [KvPiece(0, 0, 0, 1, 0, 0), KvPiece(1, 1, 0, 1, 0, 0)]),  # rank to rank
    (4, 2, [KvPiece(0, 0, 0, 1, 0, 0), KvPiece(1, 1, 0, 1, 0, 0)]),
])
def test_each_d_rank_gets_one_copy_of_the_latent_page(p, d, want):
    pieces = plan_pieces(_latent(p), _latent(d))
    assert pieces == want
    page = LAYERS * 1 * PS * WIDTH * 4
    for x in pieces:            # whole pages on both sides: nothing packed, nothing unpacked
        assert piece_wire(x, _latent(p), _latent(d), 0, 4) == PieceWire(page, False, False, 0)
    moved = bytes_per_rank(_latent(p), _latent(d), [10], 4)
    assert moved.received == (10 * page,) * d and sum(moved.sent) == 10 * page * d


def test_a_latent_peer_and_a_k_v_peer_are_refused_naming_both():
    dense = KvLayout(1, 1, WIDTH, "float32", PS, (LAYERS,))
    with pytest.raises(ValueError, match=r"prefill-0 \(tensor_parallel_size 1: a latent entry "
                                         r"of 40 a token.*decode-0 .*1 KV heads x 40.*their "
                                         r"K/V parts differ"):
        _latent(1).check_peer("prefill-0", dense, "decode-0")
    assert KvLayout.from_json(_latent(2).as_json()) == _latent(2)
    old = dense.as_json()
    del old["parts"]                     # a peer from before latent layouts: K and V
    assert KvLayout.from_json(old) == dense


@pytest.mark.parametrize("p,d", [(1, 2), (2, 1)])
def test_nixl_writes_land_the_latent_page_whole_on_each_d_rank(p, d):
    """Real NIXL between one agent per rank: every D rank's written pages
    equal P's, the rest untouched, one report per D rank, one descriptor a
    page a piece, no packing."""
    torch.manual_seed(p + 3 * d)
    pages = 10
    whole = torch.randn(pages, LAYERS, 1, PS, 1, WIDTH)
    p_lay, d_lay = _latent(p), _latent(d)
    p_agents = [KvRankAgent(f"prefill-0@1#{r}", r, [whole.clone()], p_lay) for r in range(p)]
    d_pools = [torch.full_like(whole, 7.0) for _ in range(d)]
    d_agents = [KvRankAgent(f"decode-0@1#{r}", r, [pool], d_lay) for r, pool in enumerate(d_pools)]
    try:
        pieces = plan_pieces(p_lay, d_lay)
        p_metas = [a.meta() for a in p_agents]
        assert [a.accept("prefill-0", p_lay, p_metas) for a in d_agents] == [1] * d
        d_metas = [a.meta() for a in d_agents]
        assert sum(a.connect("decode-0", d_lay, d_metas) for a in p_agents) == len(pieces)
        src, dst = [1, 4, 5], [0, 8, 9]
        for a in p_agents:
            assert a.post("decode-0", "r1", [src], [dst], b"note") == []
        ends, landed = [], {r: [] for r in range(d)}
        deadline = time.monotonic() + 20
        while len(ends) < len(pieces) or any(not v for v in landed.values()):
            assert time.monotonic() < deadline
            for a in p_agents:
                ends += a.poll()[0]
            for r, a in enumerate(d_agents):
                landed[r] += a.poll()[1]
        assert all(e.ok for e in ends)
        assert all(len(v) == 1 for v in landed.values())
        for pool in d_pools:
            assert torch.equal(pool[dst], whole[src])
            assert bool((pool[[i for i in range(pages) if i not in dst]] == 7.0).all())
        assert sum(a.packed_bytes for a in p_agents) == 0
        assert sum(a.unpacked_bytes for a in d_agents) == 0
        assert sum(a.descriptors for a in p_agents) == len(src) * len(pieces)
    finally:
        for a in p_agents + d_agents:
            a.close()


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return deepseek_v3_checkpoint(tmp_path_factory.mktemp("dsv3"))


def test_an_engine_s_layout_says_latent(deepseek):
    _, d = deepseek
    model, tok = load_model(str(d), preset=None, dtype="float32", attention="torch")
    ex = TorchExecutor(model, tok, EngineConfig(page_size=PS, total_pages=16))
    assert kv_layout(model, ex, PS) == _latent(1)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_a_p_d_pair_gives_transformers_tokens(family, deepseek, tmp_path):
    """P prefills in chunks, its pages copied into D's landing pages as a
    transport writes them, D decodes: transformers' greedy tokens."""
    hf, d = deepseek if family == "deepseek_v3" else qwen3_moe_checkpoint(tmp_path)
    model, tok = load_model(str(d), preset=None, dtype="float32", attention="torch")
    pair = LocalPair(model, tok, EngineConfig(page_size=PS, total_pages=64,
                                              max_scheduled_tokens=8))
    prompts = [[(7 * i + 3) % 120 + 1 for i in range(21)], [5, 9, 11, 60, 2]]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert pair.generate(prompts, sp) == [hf_greedy(hf, p, 6) for p in prompts]
    pair.P.assert_idle()
    pair.D.assert_idle()


def test_bench_transfer_s_table_of_bytes_a_prompt_token_costs(capsys):
    """`pdserve bench transfer --token-bytes`: DeepSeek-V3's 576 bf16 values
    a layer (68.6 KiB a token) against Llama 3.1 405B's 504 KiB, on the
    wire in all and to each D rank; at D TP 8 each rank takes its own
    latent copy where the dense model's heads split."""
    from pdserve.benchmarks.transfer.handoff import token_bytes_rows
    from pdserve.cli.main import main

    rows = {r["model"]: r["wire"] for r in token_bytes_rows()}
    assert rows["deepseek-v3"][(1, 1)] == (61 * 576 * 2, 61 * 576 * 2)
    assert rows["deepseek-v3"][(8, 8)] == (8 * 61 * 576 * 2, 61 * 576 * 2)
    assert rows["llama-3-405b"][(8, 8)] == (126 * 2 * 8 * 128 * 2, 126 * 2 * 128 * 2)
    assert main(["bench", "transfer", "--token-bytes"]) == 0
    assert "deepseek-v3           68.6       68.6/68.6" in capsys.readouterr().out
