"""The routed experts' two paths (kernels/models/moe/experts.py): torch's
grouped matmul, which a GPU runs in bfloat16 without waiting on the
device, against the loop of one matmul pair an expert; both on CPU, where
`F.grouped_mm` runs too. And which path a device gets, and why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from pdserve.kernels.models.moe.experts import (GROUPED, LOOP, DenseMlp, Experts,
                                                choose_experts_path)
from pdserve.kernels.models.moe.specs import SIGMOID, SOFTMAX, MoeSpec
from support.moe import qwen3_moe_checkpoint

H, I, E = 32, 24, 16

QWEN = MoeSpec(E, 2, I, (0,), True, SOFTMAX)
DEEPSEEK = MoeSpec(E, 3, I, (0,), True, SIGMOID, n_group=4, topk_group=2,
                   correction_bias=True, routed_scaling=2.5, shared_intermediate=I,
                   router_fp32=True)


def experts(spec: MoeSpec, seed: int, dtype=torch.float32, count: int = E,
            first: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).to(dtype)
    shared = DenseMlp(draw(2 * I, H), draw(H, I)) if spec.shared_intermediate else None
    bias = torch.randn(E, generator=g) * 0.1 if spec.correction_bias else None
    return Experts(spec, draw(E, H), draw(count, 2 * I, H), draw(count, H, I), first, bias,
                   shared)


@pytest.mark.parametrize("spec", [QWEN, DEEPSEEK], ids=["qwen3-moe", "deepseek-v3"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_the_grouped_path_gives_the_loops_outputs_and_counts(spec, rows):
    """Few rows leave most experts empty; many give each several."""
    loop, grouped = experts(spec, 1), experts(spec, 1)
    grouped.path = GROUPED
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows))
    want, got = loop.forward(x), grouped.forward(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(grouped.counts, loop.counts) and int(loop.counts.sum()) == rows * spec.top_k


def test_in_bfloat16_the_grouped_sum_is_at_least_as_close_to_float32():
    """The grouped path adds a token's k outputs in float32, the loop in
    bfloat16: against the float32 loop, the grouped is no further off."""
    ref = experts(QWEN, 2)
    loop, grouped = experts(QWEN, 2, torch.bfloat16), experts(QWEN, 2, torch.bfloat16)
    grouped.path = GROUPED
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(3))
    want = ref.forward(x)
    err_loop = (loop.forward(x.bfloat16()).float() - want).abs().max()
    err_grouped = (grouped.forward(x.bfloat16()).float() - want).abs().max()
    assert err_grouped <= err_loop * 1.01


def test_the_engine_gives_the_same_greedy_tokens_on_either_path(tmp_path):
    """A Qwen3-MoE checkpoint served with its sparse layers on the grouped
    path: the loop's greedy tokens, and the same expert counts."""
    _, d = qwen3_moe_checkpoint(tmp_path)
    prompts = [[(7 * i + 3) % 120 + 1 for i in range(23)], [5, 9, 11, 60]]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out, counts = [], []
    for path in (LOOP, GROUPED):
        with LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch", page_size=4,
                 total_pages=64) as llm:
            for e in llm.model.expert_layers():
                e.path = path
            out.append([o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
            counts.append([e.counts.tolist() for e in llm.model.expert_layers()])
    assert out[0] == out[1] and counts[0] == counts[1]


def test_cpu_runs_the_loop():
    assert choose_experts_path([experts(QWEN, 0)], "cpu", torch.bfloat16)[0] == LOOP


@pytest.mark.parametrize("layer,dtype,why", [
    (experts(QWEN, 0, count=8, first=8), torch.bfloat16, "expert parallelism"),
    (experts(QWEN, 0), torch.float16, "takes bfloat16 on CUDA, not torch.float16"),
])
def test_cuda_runs_the_loop_where_the_grouped_matmul_does_not_apply(layer, dtype, why):
    path, reason = choose_experts_path([layer], "cuda", dtype)
    assert path == LOOP and why in reason


def test_a_device_whose_grouped_matmul_fails_runs_the_loop_and_says_why(monkeypatch):
    layer = experts(QWEN, 0, torch.bfloat16)

    def refuse(*args, **kwargs):
        raise RuntimeError("grouped gemm needs sm90")
    monkeypatch.setattr(F, "grouped_mm", refuse)     # here the CUDA tensors fail first
    path, why = choose_experts_path([layer], "cuda", torch.bfloat16)
    assert path == LOOP and "torch's grouped matmul failed here" in why


@pytest.mark.device
def test_on_a_gpu_bfloat16_runs_the_grouped_path_with_the_loops_outputs():
    loop, grouped = (experts(DEEPSEEK, 4, torch.bfloat16) for _ in range(2))
    for e in (loop, grouped):
        for name in ("router", "bias", "gate_up", "down", "counts"):
            setattr(e, name, getattr(e, name).cuda())
        e.shared = DenseMlp(e.shared.gate_up.cuda(), e.shared.down.cuda())
    path, why = choose_experts_path([grouped], "cuda", torch.bfloat16)
    assert path == GROUPED, why
    grouped.path = GROUPED
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(5)).bfloat16().cuda()
    torch.cuda.set_sync_debug_mode("error")       # the grouped path never waits on the device
    try:
        got = grouped.forward(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = loop.forward(x)
    assert torch.allclose(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(grouped.counts, loop.counts)


def test_torch_grouped_matmul_takes_the_transposed_expert_weights_as_the_loop_does():
    """The call the grouped path makes: rows sorted by expert, offsets of
    each expert's last row, weights [E, out, in] transposed."""
    w = torch.randn(3, 5, 4)
    x = torch.randn(6, 4)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    got = F.grouped_mm(x, w.transpose(1, 2), offs=offs)
    want = torch.cat([F.linear(x[:2], w[0]), F.linear(x[2:6], w[2])])
    assert torch.allclose(got, want, atol=1e-6)
