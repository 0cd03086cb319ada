"""The MoE families at tensor_parallel_size 2, each expert split by width
and the experts sharded whole (expert parallelism): two spawned ranks on
gloo run the same greedy rounds as TP 1 and give transformers' greedy
tokens, logits within 1e-5 of TP 1's; each rank holds its share of the
experts only; DeepSeek-V3's latent pages are the same bytes on both ranks,
and a rank's page is the whole latent page (the capacity a rank budgets is
not divided by TP), where Qwen3-MoE's holds half the KV heads.
One spawn runs every case: starting two processes is most of the cost."""

import pytest
import torch

from pdserve.kernels.models.loader import load_model
from pdserve.kernels.models.model_config import read_config
from pdserve.kernels.models.moe.sharding import check_moe_split
from pdserve.kernels.tensor_parallel import TpError, tp_layout
from support.checkpoints import hf_greedy
from support.moe import deepseek_v3_checkpoint, qwen3_moe_checkpoint
from support.tp import PAGES, PS, greedy, run_ranks

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33, 2, 9, 41, 8, 77, 3, 12, 60, 101, 7], [60, 3, 3, 27]]
STEPS = 6
TOL = 1e-5


def _load(path, comm=None, ep=False):
    return load_model(path, preset=None, dtype="float32", attention="torch", tp=comm,
                      expert_parallel=ep)[0]


def _ranks(comm, cases):
    out = []
    for path, ep in cases:
        model = _load(path, comm, ep)
        caches = model.new_caches([PAGES * len(PROMPTS)], PS)
        logits, tokens = greedy(model, PROMPTS, STEPS, caches)
        held = [len(layer.gate_up) for layer in model.expert_layers()]
        width = model.expert_layers()[0].gate_up.shape[1]
        pages = None
        if model.cfg.mla is not None:     # the latent pages each rank wrote, side by side
            pages = comm.all_gather(caches[0].data)
            pages = [p.numpy() for p in pages]
        out.append(([x.numpy() for x in logits], tokens, held, width, pages,
                    caches[0].data[0].nbytes))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    q_hf, q = qwen3_moe_checkpoint(tmp_path_factory.mktemp("q3moe"))
    d_hf, d = deepseek_v3_checkpoint(tmp_path_factory.mktemp("dsv3"))
    return {"qwen3_moe": (q_hf, str(q)), "deepseek_v3": (d_hf, str(d))}


def test_tp2_split_and_expert_parallel_equal_tp1_and_transformers(checkpoints):
    cases = [(path, ep) for _, path in checkpoints.values() for ep in (False, True)]
    got = run_ranks(_ranks, 2, cases)
    for (path, ep), (logits, tokens, held, width, pages, page_bytes) in zip(cases, got):
        hf = next(h for h, p in checkpoints.values() if p == path)
        cfg = read_config(path)
        assert tokens == [hf_greedy(hf, p, STEPS) for p in PROMPTS], (path, ep)
        whole = _load(path)
        want, _ = greedy(whole, PROMPTS, STEPS)
        # a rank's page: the latent entry whole (what the capacity line counts,
        # not divided by TP); Qwen3-MoE's 2 KV heads split, one a rank
        one = whole.new_caches([1], PS)[0].data[0].nbytes
        assert page_bytes == (one if cfg.mla is not None else one // 2), path
        for w, g in zip(want, map(torch.from_numpy, logits)):
            assert torch.allclose(g, w, atol=TOL, rtol=0), (path, ep, (g - w).abs().max())
        e, inter = cfg.moe.num_experts, cfg.moe.intermediate
        # rank 0 holds half the experts whole, or every expert at half its width
        assert (held[0], width) == ((e // 2, 2 * inter) if ep else (e, inter)), (path, ep)
        if pages is not None:
            assert (pages[0] == pages[1]).all(), "latent pages differ between ranks"


def test_expert_parallel_needs_experts_and_a_size_that_divides_them(checkpoints):
    _, path = checkpoints["deepseek_v3"]
    cfg = read_config(path)                       # 4 heads; 8 experts, width 16, shared 16
    assert tp_layout(cfg, 4, expert_parallel=True).expert_parallel
    assert "does not divide the model's 8 experts" in check_moe_split(cfg.moe, 3, True)
    assert "the experts' width 16" in check_moe_split(cfg.moe, 3, False)
    from pdserve.kernels.models.model_config import tiny_config
    with pytest.raises(TpError, match="llama model: it has no experts"):
        tp_layout(tiny_config(), 2, expert_parallel=True)


@pytest.mark.slow       # a TP 2 engine's start: ~20 s on 2 cores
def test_a_tp2_engine_with_experts_sharded_gives_transformers_tokens(checkpoints):
    """DeepSeek-V3 through the engine at TP 2 with expert parallelism, every
    round's digests compared across the ranks: transformers' greedy tokens,
    and rank 0's per-expert counts in the engine's stats."""
    from pdserve import LLM, SamplingParams
    from pdserve.engine.stats import expert_tokens

    hf, path = checkpoints["deepseek_v3"]
    llm = LLM({"model": {"path": path, "expert_parallel": True}}, dtype="float32",
              attention="torch", tensor_parallel_size=2, tensor_parallel_check=True,
              page_size=4, total_pages=64, max_scheduled_tokens=8)
    try:
        sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert [o.token_ids for o in outs] == [hf_greedy(hf, p, STEPS) for p in PROMPTS]
        layers = expert_tokens(llm.model)
        assert [e.layer for e in layers] == [1, 2]
        assert all(sum(e.tokens) == 3 * llm.executor.forward_tokens for e in layers)
    finally:
        llm.close()


def test_expert_parallel_is_a_model_setting_and_vllm_s_flag(checkpoints):
    """model.expert_parallel (true/false, checked), --enable-expert-parallel
    setting it, and `pdserve up`'s check naming the role a size cannot split."""
    from pdserve.config import ServeConfig
    from pdserve.config.flags import Flags, with_flags
    from pdserve.kernels.tensor_parallel import check_roles
    from pdserve.scheduler import ConfigError

    assert ServeConfig.from_dict({"model": {"expert_parallel": True}}).model.expert_parallel
    with pytest.raises(ConfigError, match="model.expert_parallel is 'yes'; use true or false"):
        ServeConfig.from_dict({"model": {"expert_parallel": "yes"}})
    data = with_flags({}, Flags(enable_expert_parallel=True, tensor_parallel_size=2))
    assert data["model"] == {"expert_parallel": True}
    _, path = checkpoints["qwen3_moe"]
    cfg = ServeConfig.from_dict({"model": {"path": path, "expert_parallel": True},
                                 "cluster": {"fused": {"count": 1, "tensor_parallel_size": 3}}})
    with pytest.raises(TpError, match="cluster.fused: tensor_parallel_size 3 does not divide"):
        check_roles(read_config(path), cfg)
