"""Reading a config file: `load_config`, and the configs pdserve ships in
its `deploy/` folder, found through importlib.resources so that a command
works from an installed package as from the checkout."""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
from pathlib import Path

import yaml

from pdserve.config.flags import CERTIFICATES, Flags, with_flags
from pdserve.config.serve import ServeConfig
from pdserve.scheduler.config import ConfigError

# what `pdserve up` (and `bench serve` given model flags alone) starts from
# when given no --config: SmolLM2 on 1P+1D, found in the package (shipped)
UP_CONFIG = "deploy/local-pd.yaml"


def shipped(name: str) -> Path:
    """A file pdserve ships in its `deploy/` folder (configs, the demo trace,
    the Prometheus and Grafana files), read from the installed package."""
    path = Path(str(importlib.resources.files("pdserve") / "deploy" / name))
    if not path.exists():
        raise ConfigError(f"pdserve ships no {name!r}; shipped: {', '.join(shipped_names())}")
    return path


def shipped_names() -> list[str]:
    folder = importlib.resources.files("pdserve") / "deploy"
    return sorted(f.name for f in folder.iterdir() if f.name.endswith((".yaml", ".yml")))


def load_config(path) -> ServeConfig:
    """Load a config file. A path that names no file but a shipped config
    (`local-pd.yaml` or `deploy/local-pd.yaml`) loads the shipped one, so the
    README's commands work from an installed package as from the checkout."""
    data, p = read_config_file(path)
    return _build(data, p, str(p))


def load_with_flags(path, flags: Flags) -> tuple[ServeConfig, dict]:
    """The config file `path` (None: the defaults) with the command line's
    `flags` over it (flags.py), and the mapping it was built from: its paths
    absolute, so that, saved anywhere, it is this config again."""
    data: dict = {}
    p = None
    if path is not None:
        raw, p = read_config_file(path)
        data = rebased(raw, p.parent)
    where = str(p) if p is not None else "the default config"
    if flags != Flags():
        where += " with the command line's flags"
    try:
        merged = with_flags(data, flags)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return _build(merged, p, where), merged


def read_config_file(path) -> tuple[dict, Path]:
    """A config file's mapping (empty for an empty file) and where it was
    read from (a shipped config's own path, when `path` names one)."""
    p = Path(path)
    if not p.is_file() and not p.is_absolute() and p.parent in (Path("."), Path("deploy")) \
            and p.name in shipped_names():
        p = shipped(p.name)
    if not p.is_file():
        what = "is a directory, not a YAML file" if p.is_dir() else "does not exist"
        where = f" (a relative path is read from {Path.cwd()})" if not p.is_absolute() else ""
        raise ConfigError(f"config file {str(p)!r} {what}{where}; give --config a YAML file, "
                          f"such as one pdserve ships: {', '.join(shipped_names())}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    return ({} if data is None else data), p


def rebased(data, folder: Path) -> dict:
    """`data` with the paths a file reads beside itself (LoRA adapters, the
    control plane's certificates, the simulator's profile) made absolute.
    The model's path and the disk cache's are read from where the command
    runs, in a file as on the command line: left as they are."""
    if not isinstance(data, dict):
        return data             # ServeConfig.from_dict says what is wrong with it

    def at(v):
        return v if not isinstance(v, str) or Path(v).is_absolute() \
            else os.path.abspath(folder / v)
    out = dict(data)
    lora = out.get("lora")
    if isinstance(lora, dict) and isinstance(lora.get("adapters"), dict):
        out["lora"] = {**lora, "adapters": {
            name: {**v, "path": at(v.get("path"))} if isinstance(v, dict) else at(v)
            for name, v in lora["adapters"].items()}}
    cp = out.get("control_plane")
    if isinstance(cp, dict):
        out["control_plane"] = {k: at(v) if k in CERTIFICATES else v for k, v in cp.items()}
    sim = out.get("simulate")
    if isinstance(sim, dict) and "profile" in sim:
        out["simulate"] = {**sim, "profile": at(sim["profile"])}
    return out


def _build(data, p: Path | None, where: str) -> ServeConfig:
    """ServeConfig of `data`, read from file `p` (None: from no file), its
    errors prefixed with `where`."""
    try:
        cfg = ServeConfig.from_dict(data, p.parent if p is not None else None)
    except TypeError as e:       # a field of the wrong shape
        raise ConfigError(f"{where}: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if p is None:
        return cfg
    prof = cfg.simulate.profile
    if prof and not Path(prof).is_absolute():    # beside the config, wherever it runs from
        cfg = dataclasses.replace(cfg, simulate=dataclasses.replace(
            cfg.simulate, profile=str(p.parent / prof)))
    return dataclasses.replace(cfg, control_plane=cfg.control_plane.beside(p.parent))
