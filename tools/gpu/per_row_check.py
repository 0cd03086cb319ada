"""The teacher-forced per-row logits check (tests/support/teacher_forced.py) as
numbers: for each device case, flashinfer's largest row error next to the
torch reference's, the tolerance, the worst rows, and whether a planted
window off-by-one is caught. tests/kernels/test_device.py asserts the same checks;
this records them for a first GPU run's report.

    python tools/gpu/per_row_check.py --out per_row.json [--fake --device cpu --quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))    # `support` (the harness and the stand-in)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the reports here (JSON)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fake", action="store_true", help="the CPU stand-in for flashinfer")
    ap.add_argument("--quick", action="store_true", help="one case per (dtype, window)")
    args = ap.parse_args(argv)
    import torch

    if args.fake:
        from support import flashinfer_fake

        sys.modules["flashinfer"] = flashinfer_fake
    from pdserve.kernels.flashinfer_attention import FlashInferAttention
    from support import teacher_forced as tf

    cases = tf.DEVICE_CASES[::8] if args.quick else tf.DEVICE_CASES
    no_sync = torch.device(args.device).type == "cuda"
    rows, ok = [], True
    for case in cases:
        t0 = time.perf_counter()
        try:
            r = tf.check(case, args.device, FlashInferAttention, no_sync=no_sync)
        except Exception as e:          # a sync in a layer, a kernel error: report, go on
            rows.append({"case": case.name, "error": f"{type(e).__name__}: {e}"})
            print(f"{case.name}: {rows[-1]['error']}", flush=True)
            ok = False
            continue
        ok &= r.ok
        rows.append({"case": case.name, "ok": r.ok, "rows": r.rows, "test_max": r.test_max,
                     "tol": r.tol, "ref_p99": r.ref_p99, "logit_scale": r.scale,
                     "worst": [list(w) for w in r.worst[:3]],
                     "seconds": round(time.perf_counter() - t0, 2)})
        print(("ok   " if r.ok else "FAIL ") + r.summary(), flush=True)
    planted = tf.check(tf.Case(torch.bfloat16, 2, 24), args.device, tf.WindowOffByOne)
    caught = not planted.ok
    print(f"planted window off-by-one: {'caught' if caught else 'MISSED'} "
          f"(test max {planted.test_max:.3g} vs tol {planted.tol:.3g})")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "device": args.device, "fake": args.fake, "cases": rows,
            "planted_window_off_by_one": {"caught": caught, "test_max": planted.test_max,
                                          "tol": planted.tol}}, indent=1) + "\n")
    return 0 if ok and caught else 1


if __name__ == "__main__":
    sys.exit(main())
