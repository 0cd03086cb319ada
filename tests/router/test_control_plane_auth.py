"""The control plane admits only its own deployment: an engine's
EngineControl port takes a call only over mutual TLS with a leaf its
deployment's CA signed (proto/control_tls.py). Every call made without one
(plaintext, no client certificate, a certificate from another authority)
is refused in the TLS handshake, before any handler runs, and the engine
is as it was: same stats, not draining, no peer, no request."""

import grpc
import pytest

from pdserve.proto import control_pb2 as pb
from pdserve.proto import control_pb2_grpc as pbg
from pdserve.proto.control_tls import ControlPlane, ControlTls, DeploymentCA, channel

from support.engine_fakes import server

# every EngineControl call, with the empty message the issue's stranger sent
CALLS = {
    "Subscribe": pb.SubscribeRequest(), "Submit": pb.SubmitRequest(),
    "Abort": pb.AbortEngineRequest(), "RemotePrefill": pb.RemotePrefillRequest(),
    "TransferAck": pb.TransferAckRequest(), "TransferFailed": pb.TransferFailedRequest(),
    "LeaseHeartbeat": pb.HeartbeatRequest(), "TransferEnded": pb.TransferEndedRequest(),
    "GetInfo": pb.InfoRequest(),
    "AddPeer": pb.AddPeerRequest(), "RemovePeer": pb.RemovePeerRequest(), "Stats": pb.InfoRequest(),
    "Drain": pb.DrainEngineRequest(),
    "LoadAdapter": pb.AdapterRequest(), "UnloadAdapter": pb.AdapterRequest(),
}
assert set(CALLS) == {m.name for m in pb.DESCRIPTOR.services_by_name["EngineControl"].methods}


@pytest.fixture(scope="module")
def ca():
    return DeploymentCA.create()


@pytest.fixture
def engine(ca):
    s = server("prefill", "prefill-0", "decode-0", control_tls=ca.issue("prefill-0"))
    s.start("127.0.0.1")
    yield s
    s.shutdown()


def state(s):
    """What a call could have changed: stats, drain, peers, requests."""
    return (s.call(s.stats).SerializeToString(deterministic=True), s.drain.active,
            sorted(s.peer.peers), sorted(s.planner.requests), dict(s.counters))


def call(address: str, creds_channel, method: str):
    stub = pbg.EngineControlStub(creds_channel)
    fn = getattr(stub, method)
    if method == "Subscribe":
        return next(iter(fn(CALLS[method], timeout=5)))
    return fn(CALLS[method], timeout=5)


def stranger_channels(address: str, ca: DeploymentCA) -> dict:
    ours = ca.issue("router")
    other = DeploymentCA.create().issue("intruder")
    return {
        "plaintext": grpc.insecure_channel(address),
        # trusts our CA (so the server's leaf checks out) but shows no leaf
        "no client certificate": grpc.secure_channel(
            address, grpc.ssl_channel_credentials(ours.ca_pem), options=ours.channel_options()),
        # trusts our CA, shows a leaf another authority signed
        "another authority's leaf": grpc.secure_channel(
            address, grpc.ssl_channel_credentials(ours.ca_pem, other.key_pem, other.cert_pem),
            options=ours.channel_options()),
    }


@pytest.mark.parametrize("kind", ["plaintext", "no client certificate",
                                  "another authority's leaf"])
def test_every_control_call_without_the_deployments_leaf_is_refused_and_changes_nothing(
        engine, ca, kind):
    before = state(engine)
    ch = stranger_channels(engine.address, ca)[kind]
    for method in CALLS:
        with pytest.raises(grpc.RpcError) as e:
            call(engine.address, ch, method)
        # no call was ever made: the handshake failed, so gRPC says UNAVAILABLE
        # (UNAUTHENTICATED is a handler's answer; none ran)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE, (method, e.value)
    ch.close()
    assert state(engine) == before
    assert not engine.drain.active


def test_a_leaf_of_the_deployment_is_served(engine, ca):
    """The baseline of the refusals above: the same port answers a leaf
    the deployment's CA issued."""
    with channel(engine.address, ca.issue("router")) as ch:
        stub = pbg.EngineControlStub(ch)
        assert stub.GetInfo(pb.InfoRequest(), timeout=5).engine == "prefill-0"
        assert stub.Stats(pb.InfoRequest(), timeout=5).total_pages == 256


def test_a_plaintext_engine_is_reached_in_plaintext_only_when_insecure():
    """--insecure-control-plane: control_tls None serves plaintext (what the
    warning is about)."""
    s = server("prefill", "prefill-0", "decode-0")
    s.start("127.0.0.1")
    try:
        with grpc.insecure_channel(s.address) as ch:
            assert pbg.EngineControlStub(ch).GetInfo(pb.InfoRequest(), timeout=5).role == "prefill"
    finally:
        s.shutdown()


def test_bring_your_own_ca_and_leaf_from_files(tmp_path, ca):
    """control_plane: {ca_cert, ca_key} issues leaves from your CA;
    {ca_cert, cert, key} gives every party your one leaf. Both serve."""
    from pdserve.config import ControlPlaneConfig

    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    (tmp_path / "ca.key").write_bytes(ca.key_pem)
    leaf = ca.issue("shared")
    (tmp_path / "leaf.pem").write_bytes(leaf.cert_pem)
    (tmp_path / "leaf.key").write_bytes(leaf.key_pem)
    issuing = ControlPlaneConfig.from_dict({"ca_cert": "ca.pem", "ca_key": "ca.key"}) \
        .beside(tmp_path).credentials()
    shared = ControlPlaneConfig.from_dict({"ca_cert": "ca.pem", "cert": "leaf.pem",
                                           "key": "leaf.key"}).beside(tmp_path).credentials()
    for plane in (issuing, shared):
        assert isinstance(plane, ControlPlane)
        s = server("decode", "decode-0", "prefill-0", control_tls=plane.for_party("decode-0"))
        s.start("127.0.0.1")
        try:
            with channel(s.address, plane.for_party("router")) as ch:
                assert pbg.EngineControlStub(ch).GetInfo(pb.InfoRequest(), timeout=5).engine \
                    == "decode-0"
        finally:
            s.shutdown()


@pytest.mark.parametrize("given, says", [
    ({"cert": "a.pem"}, "give ca_cert and ca_key"),
    ({"ca_cert": "a.pem", "key": "k.pem"}, "give ca_cert and ca_key"),
    ({"insecure": True, "ca_cert": "a.pem", "ca_key": "k"}, "drop one or the other"),
    ({"insecure": "yes"}, "true or false"),
    ({"secure": True}, "unknown key control_plane.secure"),
])
def test_control_plane_config_mistakes_are_named(given, says):
    from pdserve.config import ControlPlaneConfig
    from pdserve.scheduler.config import ConfigError

    with pytest.raises(ConfigError, match=says):
        ControlPlaneConfig.from_dict(given)


def test_a_missing_certificate_file_is_named():
    with pytest.raises(ValueError, match="cannot read '/nowhere/ca.pem'"):
        ControlTls.from_files("/nowhere/ca.pem", "/nowhere/c.pem", "/nowhere/k.pem")


def test_credentials_never_print_their_key(ca):
    leaf = ca.issue("x")
    assert b"PRIVATE" in leaf.key_pem
    assert "PRIVATE" not in repr(leaf) and "PRIVATE" not in repr(ca)


def test_the_control_plane_is_secure_unless_the_config_says_insecure():
    """No control_plane: section: a CA made at start issues the leaves;
    insecure: true (what --insecure-control-plane sets) is plaintext."""
    from pdserve.config import ServeConfig

    plane = ServeConfig.from_dict({}).control_plane.credentials()
    assert isinstance(plane, ControlPlane) and plane.ca is not None
    a, b = plane.for_party("prefill-0"), plane.for_party("decode-0")
    assert a.ca_pem == b.ca_pem and a.cert_pem != b.cert_pem     # one CA, a leaf each
    assert ServeConfig.from_dict({"control_plane": {"insecure": True}}) \
        .control_plane.credentials() is None
