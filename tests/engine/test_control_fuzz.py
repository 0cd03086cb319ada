"""Every control call's fields, fuzzed (hypothesis) against a P and a D
engine built from parts (no model, no port): the handlers of
engine/rpc.py are called as gRPC would call them, on sequences of
messages that mix well formed values (known ids, pages in range, the
peer's real NIXL metadata) with hostile ones (empty and overlong ids,
control characters, token ids past the vocabulary, pages past the pool,
NaN deadlines, zero epochs and incarnations, junk metadata).

What must hold: no handler raises anything but its gRPC status; a message
refused as INVALID_ARGUMENT leaves no trace (no request, no page, no peer,
no lease, no stream); the planner's invariants hold after every call and
round; and once every request is aborted and the timers have run out,
not one page is held."""

import time

import grpc
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.proto import control_pb2 as pb
from pdserve.proto import router_pb2 as rpb
from pdserve.engine.rpc import EngineControlServicer

from support.engine_fakes import one_round, rpc, run_jobs, server

VOCAB = 1000
ANSWERS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND}


def engine(role, name, peer):
    """`name`, knowing `peer`, whose transport is on the same fabric (so
    the size of its pool is known, as NIXL metadata tells a real engine)."""
    from pdserve.transfer.loopback import LoopbackFabric

    fabric = LoopbackFabric()
    server("prefill" if role == "decode" else "decode", peer, name, fabric)
    s = server(role, name, peer, fabric, vocab_size=VOCAB)
    s.call = lambda fn, timeout=30.0: fn()        # the loop thread's work, run here
    return s


def trace(s):
    """Everything a refused message must leave as it was."""
    p = s.planner
    return (sorted(p.requests), s.stats().used_pages, len(p.waiting),
        sorted((n, x.incarnation) for n, x in s.peer.peers.items()),
        len(s.peer.leases), sorted(s.peer.remote), sorted(s.peer.epochs),
        sorted(s.owner), len(s.outputs.opened), s.drain.active,
        tuple(s.transport.peers()))


# ---- the fields: a well formed message, then perhaps one field made hostile --------
IDS = ["x", "y", "z"]
hostile_text = st.one_of(st.just(""), st.text(min_size=257, max_size=300),
                         st.sampled_from(["bad\nid", "\x00", "a\x7f", "prefill-9", "decode-9"]),
                         st.text(max_size=6))
hostile_numbers = st.one_of(st.sampled_from([0, 1, 2**32 - 1]), st.integers(0, 2**32 - 1))
hostile_lists = st.one_of(st.just([]), st.lists(st.integers(0, 2**32 - 1), max_size=8),
                          st.lists(st.sampled_from([0, 255, 256, VOCAB, 2**32 - 1]),
                                   min_size=1, max_size=5),
                          st.just([3, 3, 4]), st.just(list(range(1, 1400))))
hostile_floats = st.sampled_from([float("nan"), float("inf"), -1.0, 1e300, -0.0])
tokens = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=40)


@st.composite
def sampling(draw):
    o = rpb.SamplingOptions(max_tokens=draw(st.integers(1, 6)),
                            temperature=draw(st.sampled_from([0.0, 0.7])))
    if draw(st.booleans()):
        o.logprobs = draw(st.integers(0, 3))
    if draw(st.integers(0, 4)) == 0:           # hostile sampling
        o.logit_bias[draw(st.sampled_from([VOCAB, 2**32 - 1, 5]))] = draw(
            st.one_of(hostile_floats, st.just(1.0)))
        o.top_p = draw(st.one_of(hostile_floats, st.just(0.5)))
        o.logprobs = draw(st.sampled_from([0, 21, 2**32 - 1]))
    return o


@st.composite
def well_formed(draw, role):
    """(handler name, a message its sender could well send)."""
    peer = "prefill-0" if role == "decode" else "decode-0"
    kind = draw(st.sampled_from(["Subscribe", "Submit", "Submit", "Submit", "Abort",
                                 "RemotePrefill", "RemotePrefill", "RemotePrefill",
                                 "TransferAck", "TransferAck", "TransferFailed",
                                 "LeaseHeartbeat", "TransferEnded", "GetInfo", "AddPeer", "Stats", "Drain",
                                 "LoadAdapter", "UnloadAdapter"]))
    rid = draw(st.sampled_from(IDS))
    if kind == "Subscribe":
        return kind, pb.SubscribeRequest(subscriber=draw(st.sampled_from(["router", "r2"])))
    if kind == "Submit":
        ids = draw(tokens)
        return kind, pb.SubmitRequest(
            request_id=rid, token_ids=ids, subscriber="router", sampling=draw(sampling()),
            prefill_peer=draw(st.sampled_from(["", peer])) if role == "decode" else "",
            prior_output=draw(st.integers(0, len(ids))))
    if kind == "Abort":
        return kind, pb.AbortEngineRequest(request_id=rid, reason="client left")
    if kind == "RemotePrefill":
        ids = draw(tokens)
        spans = -(-len(ids) // 4)
        first = draw(st.integers(0, spans))
        landing = draw(st.lists(st.integers(0, 255), min_size=spans - first,
                                max_size=spans - first, unique=True))
        return kind, pb.RemotePrefillRequest(
            request_id=rid, token_ids=ids, first_page=first, landing_pages=landing,
            epoch=draw(st.integers(1, 4)), target_engine=peer, target_incarnation=1,
            sampling=draw(sampling()), prior_output=draw(st.integers(0, len(ids))),
            prefill_incarnation=1)
    if kind == "TransferAck":
        return kind, pb.TransferAckRequest(request_id=rid, release_only=draw(st.booleans()),
                                           engine=peer, epoch=draw(st.integers(0, 4)),
                                           incarnation=1)
    if kind == "TransferFailed":
        return kind, pb.TransferFailedRequest(request_id=rid, epoch=draw(st.integers(1, 4)),
                                              reason="write failed", engine=peer, incarnation=1)
    if kind == "TransferEnded":
        return kind, pb.TransferEndedRequest(request_id=rid, epoch=draw(st.integers(1, 4)),
                                             engine=peer, incarnation=1)
    if kind == "LeaseHeartbeat":
        return kind, pb.HeartbeatRequest(
            engine=peer, incarnation=1, request_ids=draw(st.lists(st.sampled_from(IDS))),
            fenced=[pb.LandingRef(request_id=r, epoch=e) for r, e in
                    draw(st.lists(st.tuples(st.sampled_from(IDS), st.integers(1, 4)),
                                  max_size=2))])
    if kind == "AddPeer":
        name = draw(st.sampled_from([peer, peer.replace("0", "1")]))
        inc = draw(st.integers(1, 3))
        return kind, pb.AddPeerRequest(engine=name, incarnation=inc, address="127.0.0.1:9",
                                       nixl_metadata=f"{name}@{inc}".encode())
    if kind == "Drain":
        return kind, pb.DrainEngineRequest(deadline_s=draw(st.sampled_from([0.0, 5.0])))
    if kind in ("LoadAdapter", "UnloadAdapter"):
        # an engine without a lora section: a load is refused, an unload finds nothing
        return kind, pb.AdapterRequest(name=draw(st.sampled_from(["sql", "chat"])),
                                       path="/nonexistent/adapter", id=draw(st.integers(1, 3)))
    return kind, pb.InfoRequest()


_F = FieldDescriptor
HOSTILE = {
    _F.TYPE_STRING: hostile_text, _F.TYPE_UINT32: hostile_numbers,
    _F.TYPE_UINT64: st.one_of(st.sampled_from([0, 2**64 - 1]), st.integers(0, 2**64 - 1)),
    _F.TYPE_DOUBLE: hostile_floats, _F.TYPE_BOOL: st.booleans(),
    _F.TYPE_BYTES: st.one_of(st.binary(max_size=24), st.just(b"{}"), st.just(b"x@0")),
}


@st.composite
def message(draw, role):
    """A well formed call, or (half the time) one with a field made hostile:
    any of the message's fields, by its wire type."""
    kind, msg = draw(well_formed(role))
    fields = [f for f in msg.DESCRIPTOR.fields if f.message_type is None]
    if fields and draw(st.booleans()):
        f = draw(st.sampled_from(fields))
        if f.is_repeated:
            value = draw(hostile_lists) if f.type != _F.TYPE_STRING else \
                draw(st.lists(hostile_text, max_size=3))
            del getattr(msg, f.name)[:]
            getattr(msg, f.name).extend(value)
        else:
            setattr(msg, f.name, draw(HOSTILE[f.type]))
    return kind, msg


def settle(s):
    """Abort what is live, let the timers run out (leases, landings),
    declare the peer gone (its quarantined landings come back), run the
    rounds left: then nothing may be held."""
    run_jobs(s)
    for rid in list(s.planner.requests):
        s.abort(rid, "fuzz over")
    for rid in list(s.peer.remote):
        s.peer.release_twin(rid)
    s.peer.timers(time.monotonic() + 10_000)
    for _ in range(200):
        run_jobs(s)
        if one_round(s) is None and not s.planner.requests:
            break
    s.peer.timers(time.monotonic() + 20_000)
    for peer in list(s.peer.peers):
        s.peer.peer_gone(peer)
    s.planner.check_invariants()
    assert not s.planner.requests
    assert s.stats().used_pages == 0, s.check()


def fuzz(role, calls):
    me, peer = ("decode-0", "prefill-0") if role == "decode" else ("prefill-0", "decode-0")
    s = engine(role, me, peer)
    servicer = EngineControlServicer(s)
    for kind, msg in calls:
        before = trace(s)
        code = rpc(servicer, kind, msg)
        assert code is None or code in ANSWERS, (kind, code)
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            assert trace(s) == before, (kind, msg)
        s.planner.check_invariants()
        run_jobs(s)
        one_round(s)
        s.planner.check_invariants()
    settle(s)


@settings(max_examples=150)
@given(st.lists(message("decode"), min_size=1, max_size=12))
def test_hostile_control_messages_to_a_decode_engine_crash_nothing_and_leak_nothing(calls):
    fuzz("decode", calls)


@settings(max_examples=150)
@given(st.lists(message("prefill"), min_size=1, max_size=12))
def test_hostile_control_messages_to_a_prefill_engine_crash_nothing_and_leak_nothing(calls):
    fuzz("prefill", calls)
