"""Each control message is checked before it changes anything
(engine/control_checks.py at the RPC edge, the peer protocol for what
depends on its state): a malformed or hostile one is INVALID_ARGUMENT and
leaves no request, page, peer or lease behind."""

import grpc
import pytest

from pdserve.proto import control_pb2 as pb
from pdserve.proto import router_pb2 as rpb
from pdserve.engine.rpc import EngineControlServicer
from pdserve.transfer.loopback import LoopbackFabric

from support.engine_fakes import rpc, server

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def pair():
    """P and D on one fabric, each knowing the other; handlers run inline."""
    fabric = LoopbackFabric()
    p = server("prefill", "prefill-0", "decode-0", fabric, vocab_size=100)
    d = server("decode", "decode-0", "prefill-0", fabric, vocab_size=100)
    for s in (p, d):
        s.call = lambda fn, timeout=30.0: fn()
    return p, d


def untouched(s) -> bool:
    return (not s.planner.requests and s.stats().used_pages == 0 and not s.owner
            and len(s.peer.leases) == 0 and not s.peer.remote)


def prefill(**over) -> pb.RemotePrefillRequest:
    fields = dict(request_id="x", token_ids=list(range(1, 10)), first_page=0,
                  landing_pages=[0, 1, 2], epoch=1, target_engine="decode-0",
                  target_incarnation=1, prefill_incarnation=1)
    return pb.RemotePrefillRequest(**{**fields, **over})


def submit(**over) -> pb.SubmitRequest:
    fields = dict(request_id="x", token_ids=[1, 2, 3], subscriber="router",
                  sampling=rpb.SamplingOptions(max_tokens=2))
    return pb.SubmitRequest(**{**fields, **over})


def test_a_well_formed_remote_prefill_is_taken():
    p, _ = pair()
    assert rpc(EngineControlServicer(p), "RemotePrefill", prefill()) is None
    assert "x" in p.planner.requests


@pytest.mark.parametrize("hostile", [
    dict(token_ids=[1, 2, 100]),                    # past the vocabulary (an embedding's index)
    dict(token_ids=[]),
    dict(landing_pages=[0, 1, 256]),                # past D's pool of 256 pages
    dict(landing_pages=[0, 0, 1]),                  # a page twice
    dict(first_page=4),                             # past the prompt's 3 pages
    dict(target_engine="decode-9"),                 # not a registered peer
    dict(target_incarnation=2),                     # not the registered incarnation
    dict(prefill_incarnation=0), dict(prefill_incarnation=2),   # not this P's
    dict(request_id=""), dict(request_id="a" * 257), dict(request_id="a\nb"),
    dict(epoch=0),
    dict(sampling=rpb.SamplingOptions(logit_bias={100: 1.0})),
    dict(sampling=rpb.SamplingOptions(top_p=float("nan"))),
])
def test_a_hostile_remote_prefill_is_invalid_and_leaves_no_trace(hostile):
    p, _ = pair()
    assert rpc(EngineControlServicer(p), "RemotePrefill", prefill(**hostile)) is INVALID
    assert untouched(p)


def test_remote_prefill_to_a_decode_engine_is_refused():
    _, d = pair()
    assert rpc(EngineControlServicer(d), "RemotePrefill",
               prefill(target_engine="prefill-0")) is INVALID
    assert untouched(d)


@pytest.mark.parametrize("hostile", [
    dict(token_ids=[1, 100]), dict(token_ids=[]), dict(subscriber=""),
    dict(prior_output=4), dict(request_id="\x00"),
    dict(sampling=rpb.SamplingOptions(max_tokens=2, logit_bias={2**32 - 1: 5.0})),
])
def test_a_hostile_submit_is_invalid_and_leaves_no_trace(hostile):
    _, d = pair()
    assert rpc(EngineControlServicer(d), "Submit", submit(**hostile)) is INVALID
    assert untouched(d) and not d.outputs.opened


def test_submit_to_a_prefill_engine_is_refused():
    p, _ = pair()
    assert rpc(EngineControlServicer(p), "Submit", submit()) is INVALID
    assert untouched(p)


@pytest.mark.parametrize("metadata", [b"", b"junk", b"decode-1@7"])
def test_add_peer_with_metadata_the_transport_refuses_keeps_nothing_of_the_peer(metadata):
    """An engine learns a peer's NIXL metadata only from an AddPeer it can
    load: one it cannot leaves neither a peer nor a transport entry."""
    p, _ = pair()
    before = (sorted(p.peer.peers), p.transport.peers())
    assert rpc(EngineControlServicer(p), "AddPeer", pb.AddPeerRequest(
        engine="decode-1", incarnation=1, address="127.0.0.1:9", nixl_metadata=metadata)) \
        is INVALID
    assert (sorted(p.peer.peers), p.transport.peers()) == before


def test_an_add_peer_older_than_the_incarnation_known_is_refused_and_the_newer_kept():
    """A late AddPeer for an engine's earlier incarnation (it restarted
    since) would point the engine back at a process that is gone."""
    p, _ = pair()
    s = EngineControlServicer(p)
    fields = dict(engine="decode-1", address="127.0.0.1:9")
    assert rpc(s, "AddPeer", pb.AddPeerRequest(incarnation=2, nixl_metadata=b"decode-1@2",
                                               **fields)) is None
    assert rpc(s, "AddPeer", pb.AddPeerRequest(incarnation=1, nixl_metadata=b"decode-1@1",
                                               **fields)) is INVALID
    assert p.peer.peers["decode-1"].incarnation == 2


@pytest.mark.parametrize("hostile", [
    dict(engine="prefill-0"),                 # itself
    dict(incarnation=0), dict(address="nowhere"), dict(address="h:99999"),
])
def test_a_malformed_add_peer_is_invalid(hostile):
    p, _ = pair()
    fields = dict(engine="decode-1", incarnation=1, address="127.0.0.1:9",
                  nixl_metadata=b"decode-1@1")
    assert rpc(EngineControlServicer(p), "AddPeer",
               pb.AddPeerRequest(**{**fields, **hostile})) is INVALID
    assert sorted(p.peer.peers) == ["decode-0"]


def test_a_transfer_ack_without_its_decode_engine_releases_nothing():
    """An ack names the D it comes from; one that does not is refused, and
    one from a D the twin is not for is ignored."""
    p, _ = pair()
    s = EngineControlServicer(p)
    assert rpc(s, "RemotePrefill", prefill()) is None
    assert rpc(s, "TransferAck", pb.TransferAckRequest(request_id="x", epoch=1)) is INVALID
    assert rpc(s, "TransferAck", pb.TransferAckRequest(request_id="x", engine="decode-0",
                                                       epoch=1)) is INVALID   # no incarnation
    assert rpc(s, "TransferAck", pb.TransferAckRequest(request_id="x", engine="decode-7",
                                                       epoch=1, incarnation=1)) is None
    assert "x" in p.planner.requests
    assert rpc(s, "TransferAck", pb.TransferAckRequest(request_id="x", engine="decode-0",
                                                       epoch=1, incarnation=1)) is None
    assert untouched(p)


@pytest.mark.parametrize("deadline", [float("nan"), float("inf"), -1.0, 1e9])
def test_a_drain_with_a_deadline_out_of_range_is_invalid_and_the_engine_serves_on(deadline):
    _, d = pair()
    assert rpc(EngineControlServicer(d), "Drain", pb.DrainEngineRequest(deadline_s=deadline)) \
        is INVALID
    assert not d.drain.active


@pytest.mark.parametrize("hostile", [
    dict(adapter="sql"),                            # a name without its load's id
    dict(adapter_id=3),                             # an id without a name
    dict(adapter="a\x00b", adapter_id=1),           # a control character in the name
])
def test_a_submit_naming_an_adapter_badly_is_refused_and_leaves_nothing(hostile):
    _, d = pair()
    assert rpc(EngineControlServicer(d), "Submit", submit(**hostile)) is INVALID
    assert untouched(d)


@pytest.mark.parametrize("call", ["LoadAdapter", "UnloadAdapter"])
@pytest.mark.parametrize("hostile", [dict(name="", id=1), dict(name="sql", id=0),
                                     dict(name="sql", id=1, path="p" * 5000)])
def test_an_adapter_call_with_a_bad_name_id_or_path_is_refused(call, hostile):
    _, d = pair()
    assert rpc(EngineControlServicer(d), call, pb.AdapterRequest(**hostile)) is INVALID
    assert untouched(d)
