"""`lora:`: the LoRA adapters a deployment serves, and how one `pdserve up
--lora-modules` value reads (flags.py adds them to the file's; docs/lora.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.scheduler.config import ConfigError, check_keys, check_positive_int


@dataclass(frozen=True)
class LoraConfig:
    """`lora:`: PEFT LoRA adapters served beside the base model, each
    selected by its name in a request's `model` (docs/lora.md)."""
    adapters: tuple = ()             # (name, PEFT directory), in config order
    max_loras: int = 1               # adapters on the device at once (slots)
    max_lora_rank: int = 16          # the largest rank an adapter may have
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: max_loras)
    runtime_updates: bool = False    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    pinned: tuple = ()               # names of adapters never evicted (adapters.NAME.pinned)

    @classmethod
    def from_dict(cls, data, base: Path | None = None) -> "LoraConfig":
        """`base`: the config file's folder, which a relative adapter path is read from."""
        if data is None:
            return cls()
        data = dict(check_keys(data, "lora", {"adapters", "max_loras", "max_lora_rank",
                                              "max_cpu_loras", "runtime_updates"}))
        adapters = data.pop("adapters", None) or {}
        if not isinstance(adapters, dict):
            raise ConfigError(f"lora.adapters must map names to PEFT directories "
                              f"({{name: path}}), got {adapters!r}")
        pairs, pinned = [], []
        for name, path in adapters.items():
            if isinstance(path, dict):          # {path: DIR, pinned: true}
                entry = check_keys(path, f"lora.adapters.{name}", {"path", "pinned"})
                path, pin = entry.get("path"), entry.get("pinned", False)
                if not isinstance(pin, bool):
                    raise ConfigError(f"lora.adapters.{name}.pinned must be true or false, "
                                      f"got {pin!r}")
                if pin:
                    pinned.append(str(name))
            if not isinstance(path, str) or not path.strip():
                raise ConfigError(f"lora.adapters.{name} is {path!r}; give the path of a "
                                  "PEFT adapter directory (or {path: DIR, pinned: true})")
            if base is not None and not Path(path).is_absolute():
                path = str(base / path)
            pairs.append((str(name), path))
        cfg = cls(adapters=tuple(pairs), pinned=tuple(pinned), **data)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not isinstance(self.runtime_updates, bool):
            raise ConfigError(f"lora.runtime_updates must be true or false, got "
                              f"{self.runtime_updates!r}")
        for k in ("max_loras", "max_lora_rank"):
            check_positive_int(getattr(self, k), f"lora.{k}")
        c = self.max_cpu_loras
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or
                              c < self.max_loras):
            raise ConfigError(f"lora.max_cpu_loras must be an integer >= lora.max_loras "
                              f"({self.max_loras}): every adapter on the device is also kept "
                              f"in host memory; got {c!r}")
        if self.pinned and len(self.pinned) >= self.max_loras:
            raise ConfigError(f"lora.adapters pins {len(self.pinned)} adapters "
                              f"({', '.join(self.pinned)}) for lora.max_loras={self.max_loras} "
                              "device slots; one slot must stay free for the unpinned "
                              f"adapters: raise max_loras to {len(self.pinned) + 1} or pin fewer")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def enabled(self) -> bool:
        """Engines get adapter slots: adapters are named, or may be loaded."""
        return bool(self.adapters) or self.runtime_updates


def lora_module(m: str) -> tuple[str, str, bool]:
    """One --lora-modules value: `name=path`, or vLLM's JSON form
    `{"name": ..., "path": ..., "pinned": true}`; (name, path, pinned)."""
    usage = ('give name=path (a PEFT directory) or JSON such as '
             '\'{"name": "sql", "path": "/adapters/sql", "pinned": true}\'')
    if m.lstrip().startswith("{"):
        import json

        try:
            spec = json.loads(m)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--lora-modules {m!r} is not valid JSON ({e}); {usage}") from None
        extra = set(spec) - {"name", "path", "pinned", "base_model_name"}
        name, path, pin = spec.get("name"), spec.get("path"), spec.get("pinned", False)
        if extra or not isinstance(name, str) or not name or not isinstance(path, str) \
                or not path or not isinstance(pin, bool):
            what = f"unknown keys {sorted(extra)}" if extra else \
                "name and path must be non-empty strings and pinned true or false"
            raise ConfigError(f"--lora-modules {m!r}: {what}; {usage}")
        return name, path, pin
    name, sep, path = m.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora-modules {m!r}: {usage}")
    return name, path, False
