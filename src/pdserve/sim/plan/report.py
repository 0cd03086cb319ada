"""What `pdserve plan` prints and writes (cli/plan.py is the command).

    DIR/plan.yaml   the base config with the winner's cluster: and
                    engine.max_scheduled_tokens (`pdserve up` and `sim` take it)
    DIR/plan.json   the settings, the winner, every candidate's probes
    DIR/plan.png    req/s per GPU within the SLO against offered rate, a line a
                    candidate
"""

from __future__ import annotations

from pathlib import Path

import yaml

from pdserve.config import ServeConfig
from pdserve.sim.plan.search import Bracket, PlanResult, Status
from pdserve.sim.report import plot_lines
from pdserve.scheduler.config import ConfigError

NOTES = {Status.CONVERGED: "", Status.SEARCHING: "",
         Status.DOMINATED: "dominated",
         Status.INFEASIBLE: "no rate tried passes",
         Status.UNBOUNDED: "passes at every rate tried"}


def _s(v) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f}ms" if v < 1 else f"{v:.2f}s"


def format_table(result: PlanResult) -> str:
    gpus = result.settings.gpus
    rows = [f"{'#':>2} {'shape':<9} {'chunk':>5} {'goodput':>8} {'/GPU':>6} {'attain':>6} "
            f"{'TTFT p50':>8} {'TTFT p90':>8} {'TPOT p50':>8} {'TPOT p90':>8} "
            f"{'fails at':>8} {'sims':>4}  note"]
    for rank, b in enumerate(result.ranked(), 1):
        c, lo, hi = b.candidate, b.lo, b.hi
        if lo is None:
            head = f"{'-':>8} {'-':>6} {'-':>6} " + " ".join(f"{'-':>8}" for _ in range(4))
        else:
            head = (f"{lo.rate_req_s:>8.2f} {lo.rate_req_s / gpus:>6.3f} {lo.attainment:>6.3f} "
                    f"{_s(lo.ttft_p50_s):>8} {_s(lo.ttft_p90_s):>8} "
                    f"{_s(lo.tpot_p50_s):>8} {_s(lo.tpot_p90_s):>8}")
        fails = f"{hi.rate_req_s:.2f}" if hi else "-"
        rows.append(f"{rank:>2} {c.shape:<9} {c.chunk:>5} {head} {fails:>8} "
                    f"{len(b.probes):>4}  {NOTES[b.status]}".rstrip())
    return "\n".join(rows)


def candidate_json(b: Bracket, gpus: int) -> dict:
    c = b.candidate
    good = b.lo.rate_req_s if b.lo else 0.0
    return {"shape": c.shape, "prefill": c.prefill, "decode": c.decode, "fused": c.fused,
            "chunk": c.chunk, "status": b.status.value, "start_factor": b.start,
            "goodput_req_s": good, "goodput_per_gpu": good / gpus,
            "fails_at_req_s": b.hi.rate_req_s if b.hi else None,
            "probes": [p.to_json() for p in sorted(b.probes, key=lambda p: p.factor)]}


def plan_json(result: PlanResult, trace_path: str) -> dict:
    s = result.settings
    best = result.best
    return {"trace": str(trace_path), "requests": result.requests,
            "native_rate_req_s": result.native_rate,
            "slo": {"ttft_s": s.slo.ttft_s, "tpot_s": s.slo.tpot_s},
            "attainment": s.attainment, "gpus": s.gpus, "chunks": list(s.chunks),
            "tolerance": s.tolerance,
            "best": ({k: v for k, v in candidate_json(best, s.gpus).items() if k != "probes"}
                     if best else None),
            "candidates": [candidate_json(b, s.gpus) for b in result.ranked()]}


def plan_yaml(base_path: Path, result: PlanResult, trace_path: str) -> str:
    """The base config file's own mapping with the winner's cluster: and
    chunk budget, checked by the config loader."""
    best, s = result.best, result.settings
    c = best.candidate  # type: ignore[union-attr]
    data = yaml.safe_load(base_path.read_text()) or {}
    data["cluster"] = {"prefill": c.prefill, "decode": c.decode, "fused": c.fused}
    data["engine"] = {**(data.get("engine") or {}), "max_scheduled_tokens": c.chunk}
    sim = data.get("simulate") or {}
    if sim.get("profile") and not Path(sim["profile"]).is_absolute():   # still found from DIR
        sim["profile"] = str((base_path.parent / sim["profile"]).resolve())
    adapters = (data.get("lora") or {}).get("adapters") or {}
    for name, entry in adapters.items():          # LoRA directories, likewise
        key = "path" if isinstance(entry, dict) else None
        path = entry.get("path") if key else entry
        if isinstance(path, str) and not Path(path).is_absolute():
            path = str((base_path.parent / path).resolve())
            if key:
                entry[key] = path
            else:
                adapters[name] = path
    try:
        ServeConfig.from_dict(data)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"the planned config does not load ({e}); the base config "
                          f"{base_path} cannot take cluster {c.shape}, adjust it "
                          "(e.g. its autoscale bounds)") from None
    head = (f"# pdserve plan: {c.shape}, chunk {c.chunk}: {best.lo.rate_req_s:.2f} req/s "  # type: ignore[union-attr]
            f"({best.lo.rate_req_s / s.gpus:.3f} per GPU) with {s.attainment:.0%} of requests\n"  # type: ignore[union-attr]
            f"# at TTFT <= {s.slo.ttft_s:g} s and TPOT <= {s.slo.tpot_s * 1000:g} ms, on "
            f"{result.requests} requests of {trace_path}.\n# Base: {base_path}; every "
            "candidate's probes are in plan.json.\n")
    return head + yaml.safe_dump(data, sort_keys=False)


def plot(result: PlanResult, path: Path) -> bool:
    """Requests a second per GPU that met the SLO (rate x attainment / GPUs)
    against offered rate, a line a candidate. Points under the dashed line
    missed the attainment target; a cross is a run stopped early, plotted
    with the attainment of the part it simulated."""
    s = result.settings
    lines: dict = {}
    stopped: tuple[list, list, str] = ([], [], "stopped early")
    for b in result.ranked():
        pts = sorted(b.probes, key=lambda p: p.factor)
        ys = [p.rate_req_s * p.attainment / s.gpus for p in pts]
        lines[b.candidate.name] = ([p.rate_req_s for p in pts], ys)
        for p, y in zip(pts, ys):
            if p.stopped_early:
                stopped[0].append(p.rate_req_s)
                stopped[1].append(y)
    xs = sorted({x for line in lines.values() for x in line[0]})
    target = ([xs[0], xs[-1]], [x * s.attainment / s.gpus for x in (xs[0], xs[-1])],
              f"{s.attainment:.0%} attainment")
    return plot_lines(path, lines, "offered rate (req/s)",
                      "req/s per GPU meeting the SLO",
                      f"pdserve plan: {s.gpus} GPUs, TTFT<={s.slo.ttft_s:g}s, "
                      f"TPOT<={s.slo.tpot_s * 1000:g}ms", reference=target, marked=stopped)
