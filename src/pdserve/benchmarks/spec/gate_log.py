"""The speculation gate's round log (engine/spec/gate.py `GateRound`s), as
`pdserve bench spec` prints it beside its table: for each gated case and
batch bucket, how many decode-only rounds ran each side, the tokens they
delivered per CPU second (what the gate compares), the probes and
switches, and the side the bucket ended on. It shows why the gate ended
where it did: a case that lost with the gate on either spent its rounds
probing, or measured speculation as paying."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.spec.gate import GateMode, GateRound, bucket


@dataclass
class BucketSummary:
    bucket: int
    rounds: dict               # speculating -> rounds
    tokens: dict               # speculating -> tokens delivered
    cpu: dict                  # speculating -> CPU seconds
    probes: int                # probes begun
    switches: int              # chosen side changed
    end: GateMode              # the mode after its last round

    def rate(self, side: bool) -> float:
        return self.tokens[side] / self.cpu[side] if self.cpu[side] > 0 else 0.0


def summarize(log: list[GateRound]) -> list[BucketSummary]:
    """Per bucket, in bucket order. A probe begins where the mode turns to a
    probe; a switch where the mode outside probes changes side."""
    out: dict[int, BucketSummary] = {}
    prev: dict[int, GateMode] = {}
    plain: dict[int, GateMode] = {}        # the last mode outside probes
    for r in log:
        b = bucket(r.batch)
        s = out.setdefault(b, BucketSummary(b, {True: 0, False: 0}, {True: 0, False: 0},
                                            {True: 0.0, False: 0.0}, 0, 0, r.mode))
        s.rounds[r.speculating] += 1
        s.tokens[r.speculating] += r.tokens
        s.cpu[r.speculating] += r.cpu_s if r.cpu_s is not None else r.wall_s
        p = prev.get(b)
        if r.mode in (GateMode.PROBE_ON, GateMode.PROBE_OFF) and p != r.mode:
            s.probes += 1
        if r.mode in (GateMode.ON, GateMode.OFF):
            if plain.get(b, r.mode) != r.mode:
                s.switches += 1
            plain[b] = r.mode
        prev[b] = r.mode
        s.end = r.mode
    return [out[b] for b in sorted(out)]


def print_table(logs: dict) -> None:
    """`logs`: case name -> its gate's rounds over every repeat."""
    rows = [(name, s) for name, log in logs.items() for s in summarize(log)]
    if not rows:
        return
    print("\nThe gate's rounds (decode-only rounds, every repeat; tokens per CPU second "
          "is what it compares):\n")
    print("| case | batch bucket | rounds on | rounds off | tokens/CPU s on | "
          "tokens/CPU s off | probes | switches | mode at end |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, s in rows:
        on, off = s.rate(True), s.rate(False)
        print(f"| {name} | {s.bucket} | {s.rounds[True]} | {s.rounds[False]} | "
              f"{f'{on:.0f}' if on else '-'} | {f'{off:.0f}' if off else '-'} | {s.probes} | "
              f"{s.switches} | {s.end.value} |", flush=True)
