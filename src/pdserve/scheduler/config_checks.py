"""What every configuration section shares: the error a user's bad value
raises, and the two checks each section runs (a positive integer, a
mapping of known keys).

Apart from config.py so that a section defined beside the engine's
(speculation.py's SpecConfig) uses them without importing the
EngineConfig that holds it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value a user supplied is invalid."""


def check_positive_int(value, key: str) -> None:
    """A ConfigError naming `key` unless `value` is an int >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")


def check_keys(data, where: str, known) -> dict:
    """`data` as a mapping whose keys are all in `known`, or a ConfigError
    that names the stray key (and the likely one meant)."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    for key in data:
        if key not in known:
            import difflib

            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {where}.{near[0]}? " if near else ""
            raise ConfigError(f"unknown key {where}.{key}; {hint}known keys are: "
                              f"{', '.join(sorted(known))}")
    return data
