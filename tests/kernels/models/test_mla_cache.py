"""Latent attention's cache as what it is: one entry a token and layer
(DeepSeek-V3's latent and rotary key), no heads, no K and V. Its bytes are
what the engine's capacity line, the host and disk tiers and `pdserve
plan`'s cost model count; pages stored to host, evicted and read back from
host or disk give transformers' tokens; and the choice between absorbed
and expanded attention follows the multiply-adds."""

import dataclasses

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.executor.torch_executor import TorchExecutor
from pdserve.kernels.models.loader import load_model
from pdserve.scheduler.capacity import capacity_report
from pdserve.scheduler.config import EngineConfig
from pdserve.sim.calibrate.sweep import model_facts
from pdserve.sim.cost.profile import Profile, RoundCost, load_profile, save_profile
from pdserve.sim.cost.roofline import MODELS, CostModel, GPUS
from support.checkpoints import hf_greedy
from support.moe import deepseek_v3_checkpoint

transformers = pytest.importorskip("transformers")

PS = 4
WIDTH = 32 + 8                  # the test checkpoint's kv_lora_rank + qk_rope_head_dim
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return deepseek_v3_checkpoint(tmp_path_factory.mktemp("dsv3"))


def test_the_capacity_line_counts_a_latent_page_s_bytes(checkpoint):
    """A page of 4 tokens over 3 layers holds 3 x 4 x 40 float32 values:
    the device pool, the host pool and the capacity report agree."""
    _, d = checkpoint
    model, tok = load_model(str(d), preset=None, dtype="float32", attention="torch")
    cfg = EngineConfig(page_size=PS, total_pages=32, host_pages=8)
    ex = TorchExecutor(model, tok, cfg)
    page = 3 * PS * WIDTH * 4
    assert ex.group_bytes() == [page] and ex.hosts[0].data[0].nbytes == page
    report = capacity_report(cfg, ex.groups, ex.group_bytes())
    assert report["bytes"] == 32 * page and report["tokens"] == 32 * PS
    assert ex.caches[0].layout() == f"kv:3x1x{PS}x1x{WIDTH}"


def test_host_and_disk_tiers_serve_latent_pages(checkpoint, tmp_path):
    """A prompt's latent pages are stored to host and written to disk;
    other prompts push them off the device; the prompt again hits (host
    or disk) and decodes transformers' tokens; a restart on the same disk
    directory reads them back from disk."""
    hf, d = checkpoint
    prompt = [(5 * i + 7) % 120 + 1 for i in range(24)]
    others = [[1 + j] + [(3 * i + 11 * j) % 110 + 5 for i in range(23)] for j in range(3)]
    disk = {"path": str(tmp_path), "prefetch_policy": "wait_complete"}

    def llm():
        return LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch",
                   page_size=PS, total_pages=16, host_pages=24, max_scheduled_tokens=8,
                   disk_cache=disk)

    want = hf_greedy(hf, prompt, SP.max_tokens)
    first = llm()
    assert first.generate([prompt], SP, use_tqdm=False)[0].token_ids == want
    first.generate(others, SP, use_tqdm=False)
    (again,) = first.generate([prompt], SP, use_tqdm=False)
    hits = first.engine.planner.hits
    assert again.token_ids == want and again.cached_tokens >= 20
    assert hits.host_tokens + hits.disk_tokens >= 20
    assert first.executor.disk.flush()
    first.executor.close()
    restarted = llm()
    (cold,) = restarted.generate([prompt], SP, use_tqdm=False)
    assert cold.token_ids == want and restarted.engine.planner.hits.disk_tokens >= 20
    restarted.engine.planner.assert_idle()


def test_the_cost_model_sees_deepseek_v3_s_latent_bytes():
    """68.6 KiB a token over 61 layers (576 bf16 values each), against 504
    KiB for Llama 3.1 405B: what a host copy, a disk page and a P -> D
    transfer of a token cost in `pdserve sim` and `pdserve plan`."""
    v3, dense = MODELS["deepseek-v3"], MODELS["llama-3-405b"]
    assert v3.kv_bytes_per_token == 61 * 576 * 2 == 70_272
    assert dense.kv_bytes_per_token == 126 * 2 * 8 * 128 * 2
    assert v3.group_page_bytes(v3.groups(), 16) == [70_272 * 16]
    h100 = GPUS["h100"]
    assert CostModel(v3, h100).copy_seconds(1000) * 7 < CostModel(dense, h100).copy_seconds(1000)


def test_calibration_reads_latent_attention_off_the_model_and_keeps_it(checkpoint, tmp_path):
    """`pdserve calibrate`'s model facts: one part a token, 40 values, the
    experts a token does not run left out of the active parameters; a
    profile carries kv_parts through its file."""
    _, d = checkpoint
    model, _ = load_model(str(d), preset=None, dtype="float32", attention="torch")
    facts = model_facts(model, "small-v3")
    assert (facts.kv_parts, facts.kv_heads, facts.head_dim) == (1, 1, WIDTH)
    assert facts.kv_bytes_per_token == 3 * WIDTH * 4
    # 2 sparse layers x 5 idle experts x 3 matrices of 64 x 16
    assert facts.params - facts.active_params == 2 * 5 * 3 * 64 * 16
    p = Profile(RoundCost(0.001, 0.003, 0.0002, 1e-5, 1e-8, 0.002, 1e-7),
                dataclasses.replace(facts, active_params=0.0), 5e9, {"device": "cpu"})
    save_profile(p, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml").model.kv_parts == 1


def test_each_sequence_attends_the_way_with_fewer_multiply_adds(checkpoint):
    """DeepSeek-V3's shape: a decode row absorbed at any context; a first
    chunk expanded; a short chunk over a long cached context absorbed.
    absorb=False (the reference) expands everything."""
    from pdserve.kernels.models.moe.mla import MlaAttention
    from pdserve.kernels.models.moe.specs import MlaSpec

    att = MlaAttention(MlaSpec(1536, 512, 128, 64, 128, True, 192 ** -0.5), 128)
    assert att.absorbs(1, 2) and att.absorbs(1, 100_000)
    assert not att.absorbs(512, 512) and att.absorbs(16, 4112) and att.absorbs(128, 2176)
    att.absorb = False
    assert not att.absorbs(1, 4096)
