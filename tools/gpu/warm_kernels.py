"""Compile the flashinfer kernels the device checks use, before they run.

flashinfer 0.7.4 JIT-compiles each (dtype, head_dim, sliding window) module
with nvcc the first time it is planned, minutes each on a fresh host, and
caches it on disk (FLASHINFER_WORKSPACE_BASE). This warms every module that
tests/kernels/test_device.py and `pdserve bench llm --device cuda` will plan, one
process per module so that their builds share the host's cores, through
the same `FlashInferAttention.warm_up` an engine's loader calls (a 1-row
and a 65-row prefill, a decode, a mixed round; groups 1 and 8, so both the
CUDA-core and the tensor-core decode). It writes how long each took.

    python tools/gpu/warm_kernels.py --out warm.json [--fake --device cpu]

--fake runs the plumbing on CPU against tests/support/flashinfer_fake.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))    # `support` (the cases and the stand-in)


def combos() -> list[tuple[str, int, int | None]]:
    """(dtype, head_dim, window) of every module the device checks plan."""
    from support.teacher_forced import DEVICE_CASES

    out = []
    for c in DEVICE_CASES:
        key = (str(c.dtype).removeprefix("torch."), c.head_dim, c.window)
        if key not in out:
            out.append(key)
    for key in (("bfloat16", 64, None),     # bench llm's llama-110m, bench gpu's SmolLM2
                ("bfloat16", 128, None)):   # bench gpu's Llama-3-8B
        if key not in out:
            out.append(key)
    return out


def warm_one(dtype: str, head_dim: int, window: int | None, device: str, fake: bool) -> list:
    import torch

    if fake:
        from support import flashinfer_fake

        sys.modules["flashinfer"] = flashinfer_fake
    from pdserve.kernels.flashinfer_attention import FlashInferAttention

    ran = []
    for group in (1, 8):
        att = FlashInferAttention(2 * group, 2, head_dim, window)
        ran += [f"group {group}: {what}" for what in att.warm_up(getattr(torch, dtype), device)]
    return ran


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the timings here (JSON)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fake", action="store_true", help="the CPU stand-in for flashinfer")
    ap.add_argument("--one", help=argparse.SUPPRESS)        # dtype:head_dim:window, a child
    args = ap.parse_args(argv)
    if args.one:
        dtype, head_dim, window = args.one.split(":")
        ran = warm_one(dtype, int(head_dim), int(window) if window != "none" else None,
                       args.device, args.fake)
        print(f"{args.one}: {len(ran)} shapes ran", flush=True)
        return 0
    started = time.perf_counter()
    jobs = []
    for dtype, head_dim, window in combos():
        spec = f"{dtype}:{head_dim}:{window if window else 'none'}"
        cmd = [sys.executable, __file__, "--one", spec, "--device", args.device] + \
            (["--fake"] if args.fake else [])
        jobs.append((spec, time.perf_counter(), subprocess.Popen(cmd)))
    results = []
    for spec, t0, proc in jobs:
        rc = proc.wait()
        results.append({"module": spec, "rc": rc, "seconds": round(time.perf_counter() - t0, 1)})
        print(f"warm {spec}: rc={rc} after {results[-1]['seconds']} s", flush=True)
    total = round(time.perf_counter() - started, 1)
    print(f"warmed {len(results)} modules in {total} s (in parallel)")
    if args.out:
        Path(args.out).write_text(json.dumps({"total_seconds": total, "modules": results},
                                             indent=1) + "\n")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
