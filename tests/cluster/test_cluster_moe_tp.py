"""Both MoE families through the cluster with P at tensor_parallel_size 2
(its experts sharded: model.expert_parallel) and D at 1: the disaggregated
route gives the offline engine's greedy tokens, every prompt's pages
crossing P -> D between the two sizes (a latent page from P's rank 0 only;
Qwen3-MoE's two KV heads merged from both P ranks), and no engine keeps a
pinned page. One deployment a family, each shared by its tests."""

import pytest

from pdserve import LLM, SamplingParams
from pdserve.client import Client

from support.deployed import by_name, deployed
from support.moe import deepseek_v3_checkpoint, qwen3_moe_checkpoint
from support.checkpoints import build_tokenizer, save_tokenizer

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow           # Ray's start and a TP 2 engine's ranks, twice

ENGINE = {"page_size": 4, "total_pages": 160, "max_scheduled_tokens": 16, "max_batch_size": 8}
PROMPTS = ["Disaggregated prefill moves the KV cache from one engine to another.",
           "The quick brown fox jumps over the lazy dog.", "a"]
TOKENS = 10
FAMILIES = {"deepseek_v3": deepseek_v3_checkpoint, "qwen3_moe": qwen3_moe_checkpoint}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    tok = build_tokenizer()
    d = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param](d, vocab_size=tok.get_vocab_size())
    save_tokenizer(tok, d)
    model = {"path": str(d), "dtype": "float32", "attention": "torch"}
    llm = LLM({"model": model}, **ENGINE)
    sp = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    cfg = {"model": {**model, "expert_parallel": True},
           "engine": {**ENGINE, "tensor_parallel_check": True},
           "cluster": {"prefill": {"count": 1, "tensor_parallel_size": 2}, "decode": 1}}
    with deployed(cfg, engine_options={"transfer_timeout_s": 20.0}) as dep:
        yield dep, want


def test_p_at_tp2_to_d_at_tp1_gives_the_offline_engine_s_tokens(family):
    dep, want = family
    with Client(dep.address, timeout=120) as c:
        got = [c.generate(p, max_tokens=TOKENS, ignore_eos=True).token_ids for p in PROMPTS]
        assert got == want
        stats = by_name(c)
        assert stats["prefill-0"]["transfers"] == stats["decode-0"]["transfers"] == len(PROMPTS)
        assert stats["prefill-0"]["pinned_pages"] == stats["decode-0"]["pinned_pages"] == 0
