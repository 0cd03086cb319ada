"""Reading a config file: `load_config`, and the configs pdserve ships in
its `deploy/` folder, found through importlib.resources so that a command
works from an installed package as from the checkout."""

from __future__ import annotations

import dataclasses
import importlib.resources
from pathlib import Path

import yaml

from pdserve.config.serve import ServeConfig
from pdserve.scheduler.config import ConfigError


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
    try:
        cfg = ServeConfig.from_dict(data, p.parent)
    except TypeError as e:       # a field of the wrong shape
        raise ConfigError(f"{p}: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    prof = cfg.simulate.profile
    if prof and not Path(prof).is_absolute():    # beside the config, wherever it runs from
        cfg = dataclasses.replace(cfg, simulate=dataclasses.replace(
            cfg.simulate, profile=str(p.parent / prof)))
    return dataclasses.replace(cfg, control_plane=cfg.control_plane.beside(p.parent))
