"""The captured decode step on a GPU (CUDA graphs) and compiled on CPU
(torch.compile), against the eager step: the same logits, and what it
saves. `device` tests need a CUDA GPU (`pytest -m device
tests/kernels/test_capture_device.py`); the `slow` one compiles on CPU. Each
prints its step times and capture time (-s shows them)."""

import random

import pytest
import torch

from pdserve.benchmarks.common.timing import median_ms
from pdserve.kernels.capture import CaptureMode, DecodeCapture
from pdserve.kernels.models.loader import load_model
from test_capture import PS, decode_round, fresh_metas


def _timed(fn) -> float:
    """The median of 20 calls, in ms (synchronised on a GPU)."""
    return median_ms(fn, 20, torch.cuda.synchronize if torch.cuda.is_available() else
                     (lambda: None))


def captured_against_eager(device, mode, dtype, batches, tol):
    model, _ = load_model(None, "tiny", dtype=dtype, attention="torch", device=device)
    pages = [64 * max(batches)]
    caches = model.new_caches([p + 1 for p in pages], PS)
    for c in caches:
        c.data.normal_()
    cap = DecodeCapture(model, caches, mode, max_batch=max(batches), max_pages=16,
                        windows=[None])
    seconds = cap.capture()
    rng = random.Random(0)
    report = [f"{mode.value}: captured in {seconds:.1f} s"]
    for b in batches:
        metas = decode_round(model, pages, [rng.randrange(8, 60) for _ in range(b)], rng)
        ids = torch.tensor([rng.randrange(90) for _ in range(b)], device=device)
        metas = [type(m)(m.seqs, m.slot_mapping.to(device), m.positions.to(device),
                         m.num_decodes, m.window) for m in metas]
        got = cap.run(ids, metas).clone()
        want = model.forward(ids, fresh_metas(metas), caches, torch.arange(b, device=device))
        assert (got - want).abs().max() < tol, b
        eager = _timed(lambda: model.forward(ids, fresh_metas(metas), caches,
                                             torch.arange(b, device=device)))
        replay = _timed(lambda: cap.run(ids, metas))
        report.append(f"batch {b}: eager {eager:.2f} ms, captured {replay:.2f} ms "
                      f"({eager / replay:.1f}x)")
    print("\n".join(report))
    return cap


@pytest.mark.device
def test_cuda_graphs_replay_the_eager_step_faster():
    cap = captured_against_eager("cuda", CaptureMode.CUDA_GRAPH, "float32", [1, 16, 64], 1e-5)
    assert all(cap._bucket(b, 16).graph is not None for b in (1, 16, 64))


@pytest.mark.slow
def test_torch_compile_on_cpu_gives_the_eager_logits():
    captured_against_eager("cpu", CaptureMode.COMPILE, "float32", [1, 3], 1e-5)


@pytest.mark.device
@pytest.mark.parametrize("shape", ["llama-110m", "smollm2-135m"])
def test_flashinfer_s_captured_decode_gives_the_eager_step_s_tokens(shape):
    """flashinfer's decode in CUDA graphs, bfloat16, against its eager
    step on the same pages: logits within bfloat16's rounding (in graph
    mode flashinfer always splits the keys, so the sums' order may differ),
    and the same greedy token wherever eager's top two logits are further
    apart than that difference; each bucket a graph, planned and replayed
    with no host sync that torch sees (the tables reach the GPU from
    pinned memory). Prints the step times."""
    from pdserve.benchmarks.common.shapes import build

    model = build(shape, "bfloat16", "cuda", "flashinfer")
    assert model.attention.name == "flashinfer"
    graphs_against_eager(model, f"{shape} flashinfer bfloat16")


@pytest.mark.device
def test_a_moe_s_captured_decode_gives_the_eager_step_s_tokens_and_counts():
    """Qwen3-30B-A3B's layer (two of them, a 4k vocabulary), its experts on
    torch's grouped matmul, captured with flashinfer's decode: as above,
    and each sparse layer counts top 8 of every real row, padding left out."""
    import dataclasses

    from pdserve.kernels.models.loader import (attention_shape, build_model,
                                               checkpoint_weight_names, load_backend)
    from pdserve.kernels.models.model import random_weights
    from pdserve.kernels.models.moe.experts import GROUPED
    from pdserve.kernels.models.moe.specs import MoeSpec
    from pdserve.kernels.models.shapes import model_config

    cfg = dataclasses.replace(model_config("qwen3-30b-a3b-12l"), num_layers=2, vocab_size=4096,
                              moe=MoeSpec(128, 8, 768, (0, 1), True))
    bf16 = torch.bfloat16
    backend = load_backend("flashinfer", "cuda", bf16, attention_shape(cfg))
    model = build_model(cfg, random_weights(cfg, 0, bf16, "cuda", checkpoint_weight_names(cfg)),
                        bf16, "cuda", backend)
    assert all(e.path is GROUPED for e in model.expert_layers()), model.experts_why
    graphs_against_eager(model, "qwen3-moe 2 layers, grouped experts")


def graphs_against_eager(model, label: str) -> None:
    """`model`'s decode captured in CUDA graphs up to batch 64 against its
    eager step over the same pages, at batch 1, 5, 16 and 64: the checks
    above (a MoE's replay counting top k tokens a real row), the times
    printed."""
    moe = model.expert_layers() if model.cfg.moe is not None else []
    pages = [64 * 64]
    caches = model.new_caches([p + 1 for p in pages], PS)
    for c in caches:
        c.data.normal_()
    cap = DecodeCapture(model, caches, CaptureMode.CUDA_GRAPH, max_batch=64, max_pages=64,
                        windows=[None])
    seconds = cap.capture()
    assert cap.widths == [64] and all(bk.graph is not None for bk in cap._buckets.values())
    rng = random.Random(0)
    report = [f"{label}: captured in {seconds:.1f} s"]
    for b in (1, 5, 16, 64):
        metas = decode_round(model, pages, [rng.randrange(8, 250) for _ in range(b)], rng)
        ids = torch.tensor([rng.randrange(model.cfg.vocab_size) for _ in range(b)],
                           device="cuda")
        metas = [type(m)(m.seqs, m.slot_mapping.cuda(), m.positions.cuda(), m.num_decodes,
                         m.window) for m in metas]
        torch.cuda.synchronize()                    # the last plan's copies are done
        before = [e.counts.clone() for e in moe]
        torch.cuda.set_sync_debug_mode("error")     # planned and replayed without a sync
        try:
            got = cap.run(ids, metas)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for e, c in zip(moe, before):               # the padding rows are not counted
            assert int((e.counts - c).sum()) == e.spec.top_k * b, b
        got = got.float().clone()
        want = model.forward(ids, fresh_metas(metas), caches,
                             torch.arange(b, device="cuda")).float()
        diff = (got - want).abs().max().item()
        assert diff <= 0.02 * want.abs().max().item() + 1e-2, (b, diff)
        top = want.topk(2, dim=-1).values
        clear = (top[:, 0] - top[:, 1]) > 2 * diff
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), b
        eager = _timed(lambda: model.forward(ids, fresh_metas(metas), caches,
                                             torch.arange(b, device="cuda")))
        replay = _timed(lambda: cap.run(ids, metas))
        report.append(f"batch {b}: eager {eager:.2f} ms, captured {replay:.2f} ms "
                      f"({eager / replay:.1f}x), max |logit diff| {diff:.1e}")
    print("\n".join(report))
