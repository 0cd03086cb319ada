"""What one round asks the executor to do, and what it reports back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefillOp:
    req: object          # the Request
    begin: int           # first token this chunk computes
    tokens: int          # tokens it computes (re-fed replay rows not included)
    completes: bool      # reaches the end of the prefill: samples a token
    replay: int = 0      # rows re-fed ahead of `begin` (bounded replay, §1.3)


@dataclass(slots=True)
class Plan:
    round: int
    # Requests decoding one token each, in batch order. Every one of them has
    # capacity for the token it feeds (num_tokens <= capacity).
    decodes: list = field(default_factory=list)
    # Prefill chunks, in batch order; at most the last one is incomplete (§1.1).
    prefills: list = field(default_factory=list)
    # Pages granted this round; an executor that needs clean pages zeroes them.
    fresh_pages: list = field(default_factory=list)
    # Requests retracted this round (their pages are already granted away).
    retracts: list = field(default_factory=list)
    # Requests readmitted this round from a host snapshot (their loads ride in `loads`).
    readmits: list = field(default_factory=list)
    stores: list = field(default_factory=list)     # StoreOp, stream-ordered ones first
    loads: list = field(default_factory=list)      # LoadOp
    # Disk (L3) reads into host pages, run before `loads` (which copy those
    # host pages to the device) and acked, hit or miss, in this round's result.
    disk_loads: list = field(default_factory=list)  # DiskLoadOp
    # D: a remote admission asking a peer to prefill into reserved pages (at most one).
    remote_prefills: list = field(default_factory=list)
    # P: completed prompts whose KV and first token ship to the peer.
    remote_decodes: list = field(default_factory=list)
    # Speculation: request id -> the candidates its decode feeds after its
    # last token (a verify row of 1 + len positions; speculation.py).
    verify: dict = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (self.decodes or self.prefills or self.retracts or self.readmits
                    or self.stores or self.loads or self.disk_loads or self.remote_prefills
                    or self.remote_decodes)


@dataclass(slots=True)
class StepResult:
    # One sampled token per plan.decodes entry, in the same order.
    decode_tokens: list = field(default_factory=list)
    # One entry per plan.prefills entry: the sampled token of a completing
    # chunk, None for an intermediate chunk (its arrival is the point).
    prefill_tokens: list = field(default_factory=list)
    # Requests whose sampled token met a stop condition (EOS, stop string).
    stopped: set = field(default_factory=set)
    # Ids of the plan's StoreOps and LoadOps that completed. An executor that
    # finishes every copy within the round acks them all here.
    stores_done: list = field(default_factory=list)
    loads_done: list = field(default_factory=list)
    # Ids of the plan's DiskLoadOps, every one in the round's own result:
    # read whole (done), or not (missed: absent, torn, corrupt, foreign, late).
    disk_loads_done: list = field(default_factory=list)
    disk_loads_missed: list = field(default_factory=list)
    # Speculation. A verify decode's tokens after its first (decode_tokens
    # holds the first), by request id: the accepted candidates, then the
    # correction or bonus, cut after a token that stopped it.
    decode_more: dict = field(default_factory=dict)
    # Request id -> candidates proposed for its next step (absent: none).
    drafts: dict = field(default_factory=dict)


@dataclass(slots=True)
class StoreOp:
    """Copy device pages to host pages.

    pinned=True: a publication store (a page entering the prefix index, or
    the finish-time flush). Its device sources stay pinned, so nothing can
    evict or reuse them, until the executor acks; the host copies enter the
    host index at the ack. No forward waits for it.
    pinned=False: a retraction's stream-ordered snapshot. Its sources are
    granted away in the same round, so the executor runs it before anything
    else the plan does to those pages (store -> zero -> load -> forward)."""
    id: int
    req_id: str
    device_pages: list
    host_pages: list
    pinned: bool
    # per page, what names it in the host index: (parent hash, key) for the
    # full history, the chain hash of the prefix it ends for a state checkpoint
    entries: list | None = None
    # Device pages the ticket holds until the ack: the whole chain from the
    # root to the last source, so a pinned page never sits under an idle
    # parent that eviction could not reach.
    pins: list | None = None
    group: int = 0                # the cache group whose pages these are


@dataclass(slots=True)
class LoadOp:
    """Copy host pages into a request's device pages before this round's
    forward (a readmission's snapshot, or a host prefix hit)."""
    id: int
    req_id: str
    host_pages: list
    device_pages: list
    group: int = 0                # the cache group whose pages these are


@dataclass(slots=True)
class DiskLoadOp:
    """Read the pages a disk (L3) probe found, named by the chain hash of
    the prefix each ends, into host pages (a request's prefetch, spec §1):
    a LoadOp of the same plan copies them on to the device. A miss retracts
    the request (§4): its forward this round computed on pages nobody
    filled, so nothing of it is published and its token is dropped."""
    id: int
    req_id: str
    chains: list
    host_pages: list
    first_page: int               # the prompt page the first chain ends
    group: int = 0


@dataclass(slots=True)
class RetractOp:
    req: object
    stored: bool          # True: a host snapshot was taken; False: re-prefill from scratch


@dataclass(slots=True)
class RemotePrefillOp:
    """D asks a peer to prefill `req` and write, per cache group, the
    prompt's slots D lacks into `landing[g]` (D's page ids): the full
    history from `first_page`, each sliding group's last window."""
    req: object
    first_page: int
    landing: list

    @property
    def landing_pages(self) -> list:
        return self.landing[0]


@dataclass(slots=True)
class RemoteDecodeOp:
    """P ships a completed prompt: per cache group the pages `src[g]` of the
    slots the peer's landing asked for, and the first sampled token. The
    pages stay pinned on P until the peer acks. `drafts`: speculative
    candidates proposed after the first token, for D's first decode to
    verify (speculation.py)."""
    req: object
    src: list
    first_token: int
    drafts: list = field(default_factory=list)

    @property
    def src_pages(self) -> list:
        return self.src[0]
