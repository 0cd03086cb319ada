"""`pdserve bench gpu` (issue 54): its roofline arithmetic against the
figures in ../shared/research/gpu-path.md, the peer's model against ours,
and the dry run's tables, each figure derived as the header says. The
figures themselves are the GPU's (tools/gpu/run_device_checks.sh)."""

import pytest
import torch

from pdserve.benchmarks.common.shapes import build, model_config
from pdserve.benchmarks.engine.gpu import Footprint, Limits, _hf_model
from pdserve.cli.main import main

H100 = Limits(bandwidth=3.35e12, flops=989e12)       # the spec sheet's, for the arithmetic


def test_llama_3_8b_reads_15_gb_of_weights_and_128_kib_of_kv_a_token():
    """Every weight but the embedding table (a round reads a few of its
    rows): 6.98 B in the layers and the 0.525 B untied head, bfloat16."""
    fp = Footprint.of(model_config("llama-3-8b"), 2)
    assert fp.weight_bytes == 2 * (32 * 218_112_000 + 128256 * 4096 + 4096)
    assert round(fp.weight_bytes / 1e9, 1) == 15.0
    assert fp.kv_bytes_per_token == 128 * 1024
    ms, bound = fp.decode_roofline_s(1, 1024, H100)
    assert bound == "memory" and round(ms * 1e3, 2) == 4.52    # 4.48 ms of weights + 1k of KV


def test_a_round_is_compute_bound_once_its_multiplies_outlast_its_reads():
    fp = Footprint.of(model_config("llama-3-8b"), 2)
    slow_matmul = Limits(bandwidth=3.35e12, flops=50e12)
    assert fp.decode_roofline_s(256, 1024, H100)[1] == "memory"
    s, bound = fp.decode_roofline_s(256, 1024, slow_matmul)
    assert bound == "compute"
    assert s == pytest.approx((2 * 256 * fp.matmul_params + 4 * 256 * 1025 * 32 * 4096) / 50e12)


def test_a_moe_round_reads_the_experts_its_rows_chose():
    """Qwen3-30B-A3B's layer, 12 layers: 623 M weights a layer, 604 M of
    them its 128 experts; one row reads 8 experts a layer, and a round of
    many rows nearly all 128."""
    fp = Footprint.of(model_config("qwen3-30b-a3b-12l"), 2)
    expert = 3 * 2048 * 768
    layer = 2048 * (4096 + 2 * 512) + 4096 * 2048 + 2 * 2048 + 2 * 128 + 128 * 2048
    assert fp.expert_bytes == 12 * expert * 2 and fp.experts == 128
    assert fp.weight_bytes == 2 * (12 * layer + 151936 * 2048 + 2048)
    assert fp.total_bytes == fp.weight_bytes + 128 * fp.expert_bytes
    assert round(fp.total_bytes / 1e9, 1) == 15.6
    assert fp.experts_read(1) == pytest.approx(8 * fp.expert_bytes)
    assert fp.experts_read(2) == pytest.approx(128 * (1 - (120 / 128) ** 2) * fp.expert_bytes)
    assert fp.experts_read(256) == pytest.approx(128 * fp.expert_bytes, rel=1e-6)
    ms, bound = fp.decode_roofline_s(1, 1024, H100)
    read = fp.weight_bytes + 8 * fp.expert_bytes + 1025 * fp.kv_bytes_per_token
    assert bound == "memory" and ms == pytest.approx(read / 3.35e12)
    active = 12 * (2048 * (4096 + 1024) + 4096 * 2048 + 128 * 2048 + 8 * expert) + 151936 * 2048
    assert fp.matmul_params == active


def test_a_prompt_s_flop_are_its_rows_through_the_weights_and_causal_attention():
    cfg = model_config("tiny")
    fp = Footprint.of(cfg, 4)
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 160       # qkv, o, gate/up/down
    assert fp.matmul_params == 2 * per_layer + 98 * 64
    assert fp.prefill_flop(10) == 2 * 10 * fp.matmul_params + 2 * 10 * 11 * 64 * 2


def test_the_peer_is_our_model_in_transformers():
    """The peer's weights are ours by name, its head tied as ours is:
    float32 logits of one prompt agree."""
    pytest.importorskip("transformers")
    from pdserve.kernels.attention import BatchMeta, SeqMeta

    ours = build("tiny", "float32", "cpu")
    hf, _ = _hf_model("tiny", "float32", torch.device("cpu"))
    ids = torch.tensor([5, 17, 3, 60, 42, 9])
    cache = ours.new_caches([4], 4)
    meta = BatchMeta([SeqMeta(0, 6, 6, [0, 1])], torch.arange(6), torch.arange(6))
    got = ours.forward(ids, [meta], cache, torch.arange(6))
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    assert (got - want).abs().max() < 1e-4


def _table(out: str, header: str) -> list[list[str]]:
    lines = out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    rows = []
    for ln in lines[at + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def test_the_dry_run_prints_each_figure_as_its_header_defines_it(capsys):
    assert main(["bench", "gpu", "--dry-run", "--batches", "1", "3", "--prompts", "40",
                 "--rounds", "3", "--peer-batches", "3"]) == 0
    out = capsys.readouterr().out
    assert "on CPU (dry run)" in out
    decode = _table(out, "| model | batch | step ms")
    assert [r[1] for r in decode] == ["1", "3"]
    for _, b, ms, _, roof, bound, frac, tps in decode:
        step = float(ms.split()[0])
        assert bound in ("memory", "compute")
        assert int(frac.rstrip("%")) == pytest.approx(100 * float(roof) / step, abs=1)
        assert float(tps) == pytest.approx(int(b) / step * 1e3, rel=0.01, abs=0.5)  # printed whole
    (prefill,) = _table(out, "| model | prompt |")
    assert prefill[1] == "40" and float(prefill[3]) == pytest.approx(40 / float(prefill[2]) * 1e3,
                                                                       rel=0.01, abs=0.5)
    moe = [ln for ln in out.splitlines() if ln.startswith("| tiny-moe |")]
    assert len(moe) == 1 + 2 + 1                 # load (no graphs: eager), 2 decodes, 1 prefill
    assert moe[0].split("|")[5].strip() == "0"
    (peer,) = _table(out, "| model | batch | pdserve ms")
    assert peer[1] == "3" and peer[2] == decode[1][2].split()[0]
    assert float(peer[4].rstrip("x")) == pytest.approx(
        float(peer[3].split()[0]) / float(peer[2]), rel=0.01)


def test_on_a_machine_without_a_gpu_it_refuses_in_one_line(capsys):
    """Before anything is built or measured (the device script's dry run
    expects exactly this)."""
    assert main(["bench", "gpu", "--device", "cuda"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("pdserve: error: device 'cuda': no CUDA GPU")
    assert out.err.count("\n") == 1
