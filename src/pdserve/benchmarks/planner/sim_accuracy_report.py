"""What `pdserve bench sim-accuracy` prints once its runs are in (measured
or replayed): per config and level, the real deployment's TTFT and TPOT
against the simulator's on the same requests, with the error; the same at
each measured speed; the profile against the engines' own rounds; and the
cells within tolerance (what the tests hold it to)."""

from __future__ import annotations

import statistics


def ms(v) -> str:
    return f"{v * 1000:.0f} ms" if v is not None else "-"


def pct(v) -> str:
    return f"{v:+.0%}" if v is not None else "-"


def cores(v) -> str:
    return f"{v:.2f} cores" if v is not None else "unknown"


def _median_cell(values) -> tuple:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None, "-"
    mid = statistics.median(xs)
    spread = f" ({xs[0] * 1000:.0f}-{xs[-1] * 1000:.0f})" if len(xs) > 1 else ""
    return mid, ms(mid) + spread


def table(results: list[dict], sim: str = "sim") -> list[str]:
    """Markdown rows: per config and level, the median over runs (min-max)
    of the real deployment and of the simulator on each run's requests
    (`sim`: the result key, "sim" or "sim_own_speed"), TTFT and TPOT at p50
    and p90; the error is median sim / median real - 1."""
    lines = ["| config | level | rate req/s | metric | real p50 (runs) | sim p50 (runs) | "
             "err p50 | real p90 (runs) | sim p90 (runs) | err p90 |",
             "| --- | --- | ---: | --- | --- | ---: | ---: | --- | ---: | ---: |"]
    for res in results:
        for lv in res["levels"]:
            runs = [r for r in res["runs"] if r["level"] == lv["level"] and sim in r]
            if not runs:
                continue
            rate = f"{lv['rate']:.2f}" if lv["rate"] else "closed, c=1"
            for metric in ("ttft_s", "tpot_s"):
                cells = []
                for q in ("p50", "p90"):
                    _, real_cell = _median_cell([r[metric][q] for r in runs])
                    _, sim_cell = _median_cell([r[sim][metric][q] for r in runs])
                    err = cell_error(runs, sim, metric, q)
                    cells += [real_cell, sim_cell, f"{err:+.0%}" if err is not None else "-"]
                lines.append(f"| {res['config']} | {lv['level']} | {rate} | "
                             f"{metric[:-2].upper()} | " + " | ".join(cells) + " |")
    return lines


def cell_error(runs: list[dict], sim: str, metric: str, q: str) -> float | None:
    """Median of the simulated runs over median of the real ones, minus 1."""
    real, _ = _median_cell([r[metric][q] for r in runs])
    simulated, _ = _median_cell([r[sim][metric][q] for r in runs])
    return simulated / real - 1 if real and simulated is not None else None


def within(results: list[dict], sim: str = "sim", tolerance: float = 0.10,
           q: str = "p50") -> tuple[int, int]:
    """(cells whose error at `q` is within `tolerance`, cells), a cell being
    one metric (TTFT, TPOT) of one level of one config."""
    errs = [cell_error([r for r in res["runs"] if r["level"] == lv["level"] and sim in r],
                       sim, metric, q)
            for res in results for lv in res["levels"] for metric in ("ttft_s", "tpot_s")]
    errs = [e for e in errs if e is not None]
    return sum(abs(e) <= tolerance for e in errs), len(errs)  # type: ignore[arg-type]


def rounds_table(results: list[dict]) -> list[str]:
    """Markdown rows: per config and level, how the profile predicts the
    rounds the real engines ran (median over runs): its error per round at
    the median, and on their summed (busy) time."""
    lines = ["| config | level | engine rounds | simulated rounds | profile error per round "
             "(p50) | on busy time |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for res in results:
        for lv in res["levels"]:
            runs = [r for r in res["runs"]
                    if r["level"] == lv["level"] and r.get("rounds", {}).get("count")]
            if not runs:
                continue
            rds = [r["rounds"] for r in runs]
            med = {k: statistics.median(r[k] for r in rds) for k in ("err_p50", "busy_err")}
            sim = sum(r["sim"].get("rounds", 0) for r in runs)
            lines.append(f"| {res['config']} | {lv['level']} | "
                         f"{sum(r['count'] for r in rds)} | {sim or '-'} | "
                         f"{pct(med['err_p50'])} | {pct(med['busy_err'])} |")
    return lines


def print_report(results: list[dict], profile: str, replay: str | None,
                  one_speed: bool) -> None:
    """Each config's workload, the real-against-simulated tables (with the
    profile, and at each measured speed), the profile against the engines'
    own rounds, and the CPU others used meanwhile."""
    for res in results:
        w = res["workload"]
        print(f"{res['config']}: {w['requests']} requests of {w['prompt_len']} prompt tokens "
              f"and {w['max_tokens']} output tokens (concurrency 1: {w['alone']}); "
              f"{max(r['repeat'] for r in res['runs']) + 1} real run(s) a level; saturation "
              f"{res['saturation_req_per_s']:.2f} req/s")
    print(f"profile {profile}" + (f"; real runs replayed from {replay}" if replay else ""))
    for line in table(results):
        print(line)
    hit, cells = within(results)
    print(f"{hit} of {cells} cells within 10% at p50")
    kinds = "" if one_speed else ", per round kind"
    for view, speed, how in (
            ("sim_own_speed", "at the engines' own speed", f"the run's busy-time error{kinds}"),
            ("sim_probed", "at the probed speed",
             f"the busy-time error of a probe just before{kinds}"),
            ("sim_previous", "at the previous run's speed",
             f"the busy-time error of the level's previous run{kinds}; a level's first run "
             "has none")):
        hit, cells = within(results, view)
        if cells:
            print(f"the same runs, each simulated {speed} (the profile's round costs scaled "
                  f"by {how}):")
            for line in table(results, view):
                print(line)
            print(f"{hit} of {cells} cells within 10% at p50 {speed}")
    rows = rounds_table(results)
    if len(rows) > 2:
        print("the profile against the rounds the engines ran (their own timings):")
        for line in rows:
            print(line)
    loads = [r["foreign_cores"] for res in results for r in res["runs"]
             if r["foreign_cores"] is not None]
    if loads:
        print(f"CPU used outside this benchmark during the real runs: median "
              f"{statistics.median(loads):.2f} cores, max {max(loads):.2f}")
