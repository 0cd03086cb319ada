"""Mutual TLS for the control plane: who may call an engine's EngineControl
service (the router, and the deployment's other engines) and nobody else.

A deployment has one certificate authority. `DeploymentCA.create()` makes
a fresh one in memory when `pdserve up` starts (nothing to set up, nothing
written to disk); `issue(name)` signs a leaf certificate for each engine
and for the router, and each gets its leaf, its key and the CA's
certificate as a `ControlTls` (through its Ray actor's arguments). A user
may bring their own CA and leaf instead (`ControlTls.from_files`,
config `control_plane:`).

Both ends of every control connection present a leaf and check the other's
against the CA: an engine's server requires a client certificate
(`require_client_auth`), and its clients (the router's links, a peer's
channel) check the server's. A connection without a certificate, or with
one another authority signed, fails in the TLS handshake, before any
handler runs. Leaves name the DNS name `SERVER_NAME`, not an address:
engines move when Ray restarts them, so clients check that name
(`grpc.ssl_target_name_override`) and the CA's signature, which is what
identifies the deployment.

`ControlTls | None` is what the rest of the code passes around: None is
the insecure control plane (`--insecure-control-plane`), plaintext.
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

import grpc

from pdserve.proto.keepalive import channel_options

SERVER_NAME = "pdserve-control"     # the DNS name every leaf carries and clients check
LEAF_DAYS = 30                      # a deployment's leaves (re-issued at every start)
CA_DAYS = 365


@dataclasses.dataclass(frozen=True, repr=False)
class ControlTls:
    """One party's credentials on the control plane: the CA's certificate
    (what it trusts), its own leaf certificate and private key (PEM)."""
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    server_name: str = SERVER_NAME

    def __post_init__(self) -> None:
        for field in ("ca_pem", "cert_pem", "key_pem"):
            value = getattr(self, field)
            if not isinstance(value, bytes) or b"-----BEGIN " not in value:
                raise ValueError(f"ControlTls.{field} is not PEM data: give the file's "
                                 "contents ('-----BEGIN ...')")

    def __repr__(self) -> str:           # never print the key
        return f"ControlTls(server_name={self.server_name!r})"

    @classmethod
    def from_files(cls, ca: str | Path, cert: str | Path, key: str | Path,
                   server_name: str = SERVER_NAME) -> "ControlTls":
        """Bring-your-own credentials: the CA certificate that signed every
        party's leaf, and this party's leaf and key (PEM files)."""
        out = {}
        for what, path in (("ca", ca), ("cert", cert), ("key", key)):
            try:
                out[what] = Path(path).read_bytes()
            except OSError as e:
                raise ValueError(f"control_plane.{what}: cannot read {path!r} "
                                 f"({e.strerror or e}); give a PEM file that exists") from None
        return cls(out["ca"], out["cert"], out["key"], server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        """An engine's port: its leaf, and a client leaf the CA signed required."""
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)],
                                           root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client's end: the server checked against the CA, our leaf shown."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem,
                                            private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)]


def add_port(server, address: str, tls: ControlTls | None) -> int:
    """Bind `address` on a grpc (or grpc.aio) server, with mutual TLS
    unless `tls` is None; returns the port."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def channel(address: str, tls: ControlTls | None, options=()) -> grpc.Channel:
    """A blocking channel to an engine (a peer's), with keepalive
    (proto/keepalive.py)."""
    if tls is None:
        return grpc.insecure_channel(address, options=channel_options(options))
    return grpc.secure_channel(address, tls.channel_credentials(),
                               options=channel_options(options) + tls.channel_options())


def aio_channel(address: str, tls: ControlTls | None, options=()) -> grpc.aio.Channel:
    """An asyncio channel to an engine (the router's), with keepalive."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=channel_options(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(),
                                   options=channel_options(options) + tls.channel_options())


@dataclasses.dataclass(frozen=True, repr=False)
class DeploymentCA:
    """A certificate authority of one deployment, in memory: its key signs
    the leaves of the deployment's engines and routers (and of engines the
    autoscaler adds later, so the autoscaler holds it too)."""
    cert_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:
        return "DeploymentCA(...)"

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path) -> "DeploymentCA":
        """Your CA (its certificate and private key, PEM): pdserve issues the
        deployment's leaves from it."""
        out = []
        for what, path in (("ca_cert", cert), ("ca_key", key)):
            try:
                out.append(Path(path).read_bytes())
            except OSError as e:
                raise ValueError(f"control_plane.{what}: cannot read {path!r} "
                                 f"({e.strerror or e}); give a PEM file that exists") from None
        return cls(out[0], out[1])

    @classmethod
    def create(cls, name: str = "pdserve deployment") -> "DeploymentCA":
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                             crl_sign=True, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(cert.public_bytes(serialization.Encoding.PEM),
                   key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))

    def issue(self, name: str, server_name: str = SERVER_NAME) -> ControlTls:
        """A leaf for party `name` (an engine, a router): both a server and a
        client certificate, for `server_name`, signed by this CA."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        ca_cert = x509.load_pem_x509_certificate(self.cert_pem)
        ca_key = serialization.load_pem_private_key(self.key_pem, password=None)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(server_name)]),
                               critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
        return ControlTls(self.cert_pem, cert.public_bytes(serialization.Encoding.PEM),
                          key.private_bytes(serialization.Encoding.PEM,
                                            serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()), server_name)


@dataclasses.dataclass(frozen=True, repr=False)
class ControlPlane:
    """Where a secure deployment's parties get their credentials: a CA that
    issues each one a leaf (made at start, or yours), or one leaf they all
    use (yours). The autoscaler holds it too, for the engines it adds."""
    ca: DeploymentCA | None = None
    shared: ControlTls | None = None
    server_name: str = SERVER_NAME

    def __post_init__(self) -> None:
        if (self.ca is None) == (self.shared is None):
            raise ValueError("ControlPlane: give a CA that issues leaves or one shared leaf")

    def __repr__(self) -> str:
        return "ControlPlane(...)"

    def for_party(self, name: str) -> ControlTls:
        """The credentials of party `name` (an engine, a router)."""
        if self.shared is not None:
            return self.shared
        assert self.ca is not None
        return self.ca.issue(name, self.server_name)
