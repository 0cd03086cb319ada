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
