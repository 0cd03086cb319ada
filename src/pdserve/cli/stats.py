"""`pdserve stats`: a running deployment's engines, a row each (pages,
requests, transfers), then what only some engines have: ill health (a
stuck loop or output thread, silence), cache groups,
speculation (mean acceptance length, the gate), round timings, why requests
wait."""

from __future__ import annotations

from pdserve.benchmarks.common.options import client_key, client_key_argument
from pdserve.cli.remote import said


def add_arguments(p) -> None:
    p.add_argument("--address", required=True, help="the router, HOST:PORT")
    client_key_argument(p)


def run(args) -> int:
    from pdserve.client import Client

    def go():
        rows = Client(args.address, api_key=client_key(args)).stats()
        print(f"{'engine':<20} {'role':<8} {'used':>6} {'pinned':>6} {'total':>6} "
              f"{'running':>7} {'waiting':>7} {'transfers':>9} {'finished':>8}")
        for r in rows:
            print(f"{r['name']:<20} {r['role']:<8} {r['used_pages']:>6} {r['pinned_pages']:>6} "
                  f"{r['total_pages']:>6} {r['running']:>7} {r['waiting']:>7} "
                  f"{r['transfers']:>9} {r['finished']:>8}")
        for r in rows:
            if r["unhealthy"]:
                print(f"  {r['name']} is unhealthy: {r['unhealthy']} (loop quiet "
                      f"{r['loop_quiet_s']:.1f} s, output thread on one batch "
                      f"{r['outputs_busy_s']:.1f} s)")
        for r in rows:
            if r["quarantined_pages"] or r["stale_jobs"] or r["stale_messages"]:
                print(f"  {r['name']} holds {r['quarantined_pages']} landing pages quarantined "
                      "(a write given up on may still reach them; they come back when its "
                      f"prefill engine says it ended); dropped {r['stale_jobs']} stale jobs "
                      f"and {r['stale_messages']} messages from old incarnations")
        for r in rows:
            groups = r["cache_groups"]
            if len(groups) > 1:
                print(f"  {r['name']} holds {r['kv_capacity_tokens']:,} tokens: " + "; ".join(
                    (f"window {g['window']}" if g["window"] else "full history") +
                    f" {g['used_pages']}/{g['total_pages']} pages" for g in groups))
        for r in rows:
            tiers = r["cached_tokens_by_tier"]
            if r["prefix_queries"] and any(tiers.values()):
                print(f"  {r['name']} found cached {sum(tiers.values()):,} of "
                      f"{r['prefix_queries']:,} prompt tokens: " + ", ".join(
                          f"{t} {tiers.get(t, 0):,}" for t in ("device", "host", "disk")))
            d = r["disk_cache"]
            if d:
                print(f"  {r['name']} disk tier: {d.get('bytes_read', 0):,} bytes read, "
                      f"{d.get('bytes_written', 0):,} written; prefetches "
                      f"{d.get('prefetch_complete', 0)} complete, "
                      f"{d.get('prefetch_timed_out', 0)} timed out, "
                      f"{d.get('prefetch_partial', 0)} partial; reads "
                      f"{d.get('reads_hit', 0)} hit, {d.get('reads_missed', 0)} missed")
        for r in rows:
            if r["spec_gate"]:
                print("  " + spec_summary(r))
        for r in rows:
            if r["rounds"]:
                print(f"  {r['name']} ran {r['rounds']:,} rounds in {r['round_seconds']:.1f} s "
                      f"({r['round_cpu_seconds'] / r['round_seconds']:.0%} of it on a core), "
                      f"{r['round_tokens'] / r['rounds']:.1f} tokens a round")
        for r in rows:
            for w in r["waiting_requests"]:
                print(f"  {r['name']} waits {w['request_id']}: {w['reason']} ({w['detail']})")
        return 0
    return said(go)


def spec_summary(r: dict) -> str:
    """One engine's speculation in a line: mean acceptance length (tokens a
    verify gives: accepted candidates and one more), acceptance per
    position, and the gate."""
    d = r["spec_decode"]
    drafts, carried, accepted = (d.get(k, 0) for k in
                                 ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    line = f"{r['name']} speculation: {drafts:,} verifies"
    if drafts:
        line += (f", mean acceptance length {1 + accepted / drafts:.2f}, "
                 f"{accepted / carried if carried else 0:.0%} of {carried:,} candidates "
                 "accepted (by position: " + ", ".join(
                     f"{n / drafts:.0%}" for n in r["spec_accepted_per_pos"]) + ")")
    on, off = r["spec_tokens_per_s"]
    line += f"; gate {r['spec_gate']}"
    if on and off:
        line += f" ({on:,.0f} tokens a CPU second with, {off:,.0f} without)"
    return line
