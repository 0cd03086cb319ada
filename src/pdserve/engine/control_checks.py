"""What every control message must be before an engine acts on it: one
check per message, run at the RPC edge (engine/rpc.py) before the
call reaches the loop thread. A message that fails its check is refused
with INVALID_ARGUMENT and changes nothing: no request created, no page
held, no peer known.

These are the checks a message can be held to on its own (ids well formed,
counts and lengths bounded, token ids inside the vocabulary, page numbers
inside the pool). What depends on the engine's state (a peer registered,
a page inside that peer's pool, a request id not live) is checked where
that state lives, on the loop thread, before the first change: the peer
protocol and `EngineServer.submit` raise RejectedRequest there.

The mutual TLS of the control plane (proto/control_tls.py) keeps strangers
out; these checks keep a member's bug, or a stolen leaf, from corrupting an
engine.
"""

from __future__ import annotations

import dataclasses
import math
import unicodedata

from pdserve.proto import control_pb2 as pb

MAX_ID_CHARS = 256            # a request, engine or subscriber id
MAX_REASON_CHARS = 4096       # an abort's or a failure's text
MAX_HEARTBEAT_IDS = 1 << 16   # request ids one heartbeat renews
MAX_METADATA_BYTES = 16 << 20  # a peer's NIXL agent metadata
MAX_DRAIN_S = 7 * 24 * 3600.0
MAX_PRIOR_TEXT_CHARS = 1 << 26
MAX_PATH_CHARS = 4096          # an adapter directory's path


class BadMessage(ValueError):
    """A control message that fails its checks (INVALID_ARGUMENT): what was
    wrong, and what the sender must change."""


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What an engine holds its messages to."""
    vocab_size: int | None        # token ids below it (None: unknown, a test's fake model)
    max_prompt_tokens: int        # a prompt longer can never be served here
    pages: int                    # pages of this engine's pool (its transport's ids)
    page_size: int


def check_id(value: str, field: str) -> None:
    """A request, engine or subscriber id: 1 to MAX_ID_CHARS characters,
    none of them a control character."""
    if not value:
        raise BadMessage(f"{field} is empty: give an id")
    if len(value) > MAX_ID_CHARS:
        raise BadMessage(f"{field} has {len(value)} characters; ids have at most {MAX_ID_CHARS}")
    if any(unicodedata.category(c) == "Cc" for c in value):
        raise BadMessage(f"{field} {value[:40]!r} holds a control character; send printable ids")


def _text(value: str, field: str, limit: int = MAX_REASON_CHARS) -> None:
    if len(value) > limit:
        raise BadMessage(f"{field} has {len(value)} characters; at most {limit}")


def _tokens(ids, field: str, b: Bounds) -> None:
    if not ids:
        raise BadMessage(f"{field} is empty: a prompt has at least one token")
    if len(ids) > b.max_prompt_tokens:
        raise BadMessage(f"{field} has {len(ids)} tokens; this engine serves at most "
                         f"{b.max_prompt_tokens}")
    if b.vocab_size is not None:
        top = max(ids)
        if top >= b.vocab_size:
            raise BadMessage(f"{field} holds token id {top}, outside the vocabulary "
                             f"[0, {b.vocab_size})")


def _sampling(s, b: Bounds) -> None:
    """What the engine's sampler indexes by token id (the rest of the
    options `proto/sampling.from_options` checks where they are read)."""
    if b.vocab_size is None:
        return
    bad = [t for t in s.logit_bias if t >= b.vocab_size]
    if bad:
        raise BadMessage(f"sampling.logit_bias names token id {max(bad)}, outside the "
                         f"vocabulary [0, {b.vocab_size})")


def check_subscribe(r: pb.SubscribeRequest) -> None:
    check_id(r.subscriber, "subscriber")


def check_submit(r: pb.SubmitRequest, b: Bounds) -> None:
    check_id(r.request_id, "request_id")
    check_id(r.subscriber, "subscriber")
    if r.prefill_peer:
        check_id(r.prefill_peer, "prefill_peer")
    _tokens(r.token_ids, "token_ids", b)
    _sampling(r.sampling, b)
    if r.prior_output > len(r.token_ids):
        raise BadMessage(f"prior_output={r.prior_output} exceeds the request's "
                         f"{len(r.token_ids)} tokens")
    if r.prior_text_chars > MAX_PRIOR_TEXT_CHARS:
        raise BadMessage(f"prior_text_chars={r.prior_text_chars} is more text than any "
                         f"stream holds (at most {MAX_PRIOR_TEXT_CHARS})")
    _adapter_ref(r)


def check_abort(r: pb.AbortEngineRequest) -> None:
    check_id(r.request_id, "request_id")
    _text(r.reason, "reason")


def check_remote_prefill(r: pb.RemotePrefillRequest, b: Bounds) -> None:
    """The pages named are D's (its landing): bounded here by count, order
    and distinctness; the peer protocol holds them to D's pool size."""
    check_id(r.request_id, "request_id")
    check_id(r.target_engine, "target_engine")
    _tokens(r.token_ids, "token_ids", b)
    _sampling(r.sampling, b)
    spans = -(-len(r.token_ids) // b.page_size)
    if r.first_page > spans:
        raise BadMessage(f"first_page={r.first_page} is past the prompt's {spans} pages")
    if len(r.landing_pages) > b.pages:
        raise BadMessage(f"{len(r.landing_pages)} landing pages, more than this engine's "
                         f"{b.pages} could ever ship")
    if len(set(r.landing_pages)) != len(r.landing_pages):
        raise BadMessage("landing_pages names a page twice: each page lands once")
    if r.epoch == 0:
        raise BadMessage("epoch is 0: a landing's epoch starts at 1")
    if r.target_incarnation == 0:
        raise BadMessage("target_incarnation is 0: name the decode engine's incarnation")
    if r.prefill_incarnation == 0:
        raise BadMessage("prefill_incarnation is 0: name the prefill engine's incarnation asked")
    if r.prior_output > len(r.token_ids):
        raise BadMessage(f"prior_output={r.prior_output} exceeds the request's "
                         f"{len(r.token_ids)} tokens")
    _adapter_ref(r)


def _sender(r) -> None:
    """A peer message names the engine that sends it and its incarnation."""
    check_id(r.engine, "engine")
    if r.incarnation == 0:
        raise BadMessage("incarnation is 0: name the sending engine's incarnation")


def check_transfer_ack(r: pb.TransferAckRequest) -> None:
    check_id(r.request_id, "request_id")
    _sender(r)


def check_transfer_failed(r: pb.TransferFailedRequest) -> None:
    check_id(r.request_id, "request_id")
    _text(r.reason, "reason")
    _sender(r)


def check_transfer_ended(r: pb.TransferEndedRequest) -> None:
    if not r.stopped:
        check_id(r.request_id, "request_id")
    _sender(r)


def check_heartbeat(r: pb.HeartbeatRequest) -> None:
    _sender(r)
    if len(r.request_ids) + len(r.fenced) > MAX_HEARTBEAT_IDS:
        raise BadMessage(f"{len(r.request_ids) + len(r.fenced)} requests and landings in one "
                         f"heartbeat; at most {MAX_HEARTBEAT_IDS}")
    for rid in r.request_ids:
        check_id(rid, "request_ids")
    for ref in r.fenced:
        check_id(ref.request_id, "fenced.request_id")


def check_remove_peer(r: pb.RemovePeerRequest, own_name: str) -> None:
    check_id(r.engine, "engine")
    if r.engine == own_name:
        raise BadMessage(f"RemovePeer names {own_name} itself: an engine is not its own peer")
    if r.incarnation == 0:
        raise BadMessage("incarnation is 0: name the gone peer's incarnation")


def check_add_peer(r: pb.AddPeerRequest, own_name: str) -> None:
    check_id(r.engine, "engine")
    if r.engine == own_name:
        raise BadMessage(f"AddPeer names {own_name} itself: an engine is not its own peer")
    if r.incarnation == 0:
        raise BadMessage("incarnation is 0: name the peer's incarnation")
    host, _, port = r.address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadMessage(f"address {r.address[:80]!r} is not HOST:PORT")
    if len(r.nixl_metadata) > MAX_METADATA_BYTES:
        raise BadMessage(f"nixl_metadata has {len(r.nixl_metadata)} bytes; at most "
                         f"{MAX_METADATA_BYTES}")


def check_drain(r: pb.DrainEngineRequest) -> None:
    d = r.deadline_s
    if not math.isfinite(d) or not 0 <= d <= MAX_DRAIN_S:
        raise BadMessage(f"deadline_s={d} must be a number of seconds in [0, {MAX_DRAIN_S:g}]")


def _adapter_ref(r) -> None:
    """A request's LoRA adapter: none (the base model, id 0), or a
    well-formed name with the id of the load it runs under."""
    if r.adapter:
        check_id(r.adapter, "adapter")
        if r.adapter_id == 0:
            raise BadMessage(f"adapter {r.adapter!r} comes with adapter_id 0: name the load "
                             "the request runs under")
    elif r.adapter_id:
        raise BadMessage(f"adapter_id={r.adapter_id} without an adapter name")


def check_adapter(r: pb.AdapterRequest) -> None:
    """LoadAdapter and UnloadAdapter: a name, the load's id (never 0), a
    bounded path (the engine reads it only on LoadAdapter)."""
    check_id(r.name, "name")
    if r.id == 0:
        raise BadMessage("id is 0: an adapter load's id starts at 1")
    _text(r.path, "path", MAX_PATH_CHARS)
