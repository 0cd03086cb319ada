"""Faults for `pdserve sim --faults FILE`: failure paths at scale.

A YAML (or JSON) list; each entry fires once, at the first chance at or
after `at_s` virtual seconds:

    - {at_s: 12.0, kind: transfer_fail, engine: prefill-0}  # its next KV transfer fails
    - {at_s: 30.0, kind: ack_lost}                           # the next ack to a P is lost
    - {at_s: 50.0, kind: engine_death, engine: decode-1}     # the engine dies

`engine` is optional for transfer_fail (any P) and ack_lost (any P), and
required for engine_death.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from pdserve.scheduler.config import ConfigError

KINDS = ("transfer_fail", "ack_lost", "engine_death")


@dataclass
class Fault:
    at_s: float
    kind: str
    engine: str | None = None
    fired: bool = False

    def matches(self, now: float, engine: str) -> bool:
        return (not self.fired and now >= self.at_s
                and (self.engine is None or self.engine == engine))


def load_faults(path, engine_names: list[str]) -> list[Fault]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"faults file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or []
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, list):
        raise ConfigError(f"{p}: expected a list of faults")
    out = []
    for i, row in enumerate(data):
        where = f"{p.name}: fault {i}"
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: each fault is a mapping with at_s and kind")
        unknown = set(row) - {"at_s", "kind", "engine"}
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]}; "
                              "known keys are: at_s, engine, kind")
        at = row.get("at_s")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or at < 0:
            raise ConfigError(f"{where}: at_s must be a number >= 0, got {at!r}")
        kind = row.get("kind")
        if kind not in KINDS:
            raise ConfigError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        engine = row.get("engine")
        if engine is not None and engine not in engine_names:
            raise ConfigError(f"{where}: no engine named {engine!r}; engines are: "
                              + ", ".join(engine_names))
        if kind == "engine_death" and engine is None:
            raise ConfigError(f"{where}: engine_death needs an engine")
        if kind in ("transfer_fail", "ack_lost") and engine is not None and \
                not engine.startswith("prefill-"):
            raise ConfigError(f"{where}: {kind} names the prefill engine whose transfer or "
                              f"ack it hits; {engine!r} is not one")
        out.append(Fault(float(at), kind, engine))
    return sorted(out, key=lambda f: f.at_s)
