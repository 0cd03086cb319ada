"""`control_plane:`: the TLS the router and the engines speak gRPC under
(proto/control_tls.py makes the credentials; docs/operations.md, "The
control plane")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from pdserve.scheduler.config import ConfigError, check_keys


@dataclass(frozen=True)
class ControlPlaneConfig:
    """`control_plane:`: how the router and the engines know each other.
    By default a CA made at start issues every party a leaf (mutual TLS);
    `ca_cert` + `ca_key` issue them from your CA instead; `ca_cert` + `cert`
    + `key` give every party your one leaf. `insecure: true` is plaintext
    (anyone who reaches an engine's port may drive it)."""
    insecure: bool = False
    ca_cert: str | None = None       # PEM files; relative paths are read beside the config
    ca_key: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str = "pdserve-control"   # the DNS name every leaf carries
    engine_host: str | None = None   # where engines bind (None: the address Ray gives the node)

    @classmethod
    def from_dict(cls, data) -> "ControlPlaneConfig":
        data = check_keys(data, "control_plane", {f.name for f in dataclasses.fields(cls)})
        cfg = cls(**data)
        if not isinstance(cfg.insecure, bool):
            raise ConfigError(f"control_plane.insecure must be true or false, "
                              f"got {cfg.insecure!r}")
        for name in ("ca_cert", "ca_key", "cert", "key", "engine_host"):
            v = getattr(cfg, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ConfigError(f"control_plane.{name} must be a path or address, got {v!r}")
        if not isinstance(cfg.server_name, str) or not cfg.server_name.strip():
            raise ConfigError(f"control_plane.server_name must be a DNS name, "
                              f"got {cfg.server_name!r}")
        given = {n for n in ("ca_cert", "ca_key", "cert", "key") if getattr(cfg, n)}
        if given and given not in ({"ca_cert", "ca_key"}, {"ca_cert", "cert", "key"}):
            raise ConfigError(
                f"control_plane gives {', '.join(sorted(given))}: give ca_cert and ca_key "
                "(pdserve issues each engine a leaf from your CA), or ca_cert, cert and key "
                "(every engine and the router use your one leaf), or none (a CA made at start)")
        if given and cfg.insecure:
            raise ConfigError("control_plane.insecure is true and certificates are given: "
                              "drop one or the other")
        return cfg

    def beside(self, folder: Path) -> "ControlPlaneConfig":
        """Relative certificate paths read from `folder` (the config's)."""
        def at(v):
            return v if v is None or Path(v).is_absolute() else str(folder / v)
        return dataclasses.replace(self, ca_cert=at(self.ca_cert), ca_key=at(self.ca_key),
                                   cert=at(self.cert), key=at(self.key))

    def credentials(self):
        """The deployment's `ControlPlane` (proto/control_tls.py): None when
        insecure; else the CA that issues each party's leaf, or the one leaf
        given. A file that cannot be read is a ValueError that names it."""
        from pdserve.proto.control_tls import ControlPlane, ControlTls, DeploymentCA

        if self.insecure:
            return None
        if self.cert:
            return ControlPlane(shared=ControlTls.from_files(
                self.ca_cert, self.cert, self.key, self.server_name))  # type: ignore[arg-type]
        if self.ca_key:
            return ControlPlane(ca=DeploymentCA.from_files(self.ca_cert, self.ca_key),
                                server_name=self.server_name)
        return ControlPlane(ca=DeploymentCA.create(), server_name=self.server_name)
