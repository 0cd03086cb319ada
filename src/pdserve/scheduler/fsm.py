"""The request lifecycle: states, the resource bundle, and every transition.

    Waiting --admit--> Prefilling --last chunk--> PrefillDone --> Decoding
       ^                   |                          |              |
       +-- retract, no host snapshot (re-prefill) ----+--------------+
                           |                          |              |
                           +-- retract with a host snapshot ---> Retracted
    Retracted --readmit (load the snapshot)--> Prefilling | PrefillDone

  Disaggregated. On D, the peer computes the prompt:
    Waiting --remote admission--> RemotePrefilling --landed--> RemotePrefillDone --> Decoding
    RemotePrefilling --transfer failed--> Retracted (empty snapshot: re-prefill locally)
  On P, every page-holding state is pinned until the peer's ack:
    Waiting --> Prefilling --> PrefillDone --remote_decode--> Transferring --ack--> Finished

    any live state --finish--> Finished      any live state --abort--> Aborted

The PD pin is not a flag: on P it is "holds pages", on D it is
`RemotePrefilling` (`pd_pinned`), so no handler can forget to clear it.

States are small objects; only the functions in this module assign
`request.state`, and a transition that the diagram does not draw raises
`FsmError`. Page-holding states carry one `Resources` bundle which a
transition moves whole: the pages, the count of forwards in flight against
them, and the publication progress of the prefix chain travel together, so
none of them can be dropped on the way from one state to the next.
"""

from __future__ import annotations

from pdserve.scheduler.cache.prefix import ROOT_HASH


class FsmError(RuntimeError):
    """A transition the lifecycle does not allow (a planner bug)."""


class Resources:
    __slots__ = ("tables", "forwards_out", "published", "chain_tail", "content_tail",
                 "publishing", "covers_generation", "marks", "disk_hold")

    def __init__(self, num_groups: int):
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.forwards_out = 0      # forwards scheduled against these pages, not yet landed
        self.published = 0         # leading slots already offered to the prefix index
        self.chain_tail = ROOT_HASH  # full-history group: chain hash of its last published page
        self.content_tail = ROOT_HASH  # chain hash of [0, published) (kept where a sliding group caches)
        self.publishing = True     # full history: False once the chain's parent left the index
        # The admission that made this bundle secured decode room for the whole
        # generation budget open at that admission (§4): never a victim.
        self.covers_generation = False
        # A state group's entries its admitted forwards leave an aligned
        # checkpoint in (§1.2 CacheProgress): publication caches these only.
        self.marks: set[int] = set()
        # Slots from here on were admitted as a disk hit whose read is not
        # yet confirmed: publication stops below them until it is (-1: none).
        self.disk_hold = -1


class State:
    __slots__ = ()
    holds_pages = False


class Waiting(State):
    __slots__ = ()


class Holding(State):
    """A page-holding state: it carries the request's one Resources bundle."""

    __slots__ = ()
    holds_pages = True
    res: Resources                 # a slot of each subclass


class Prefilling(Holding):
    """Computing the prompt: `window_end` tokens are scheduled (the computed
    frontier, §5); `target` is where the prefill ends. `replay`: rows its
    next chunk re-feeds below window_end (a readmission's bounded replay,
    §1.3), spent by that chunk."""

    __slots__ = ("res", "window_end", "target", "replay")

    def __init__(self, res: Resources, window_end: int, target: int, replay: int = 0):
        self.res, self.window_end, self.target, self.replay = res, window_end, target, replay


class PrefillDone(Holding):
    __slots__ = ("res",)

    def __init__(self, res: Resources):
        self.res = res


class Decoding(Holding):
    __slots__ = ("res",)

    def __init__(self, res: Resources):
        self.res = res


class RemotePrefilling(Holding):
    """D: landing pages reserved; the peer is prefilling and will write
    pages [first_page, ...) of the table."""

    __slots__ = ("res", "first_page")

    def __init__(self, res: Resources, first_page: int):
        self.res, self.first_page = res, first_page


class RemotePrefillDone(Holding):
    """D: the peer's KV and first token landed; the first decode is next."""

    __slots__ = ("res",)

    def __init__(self, res: Resources):
        self.res = res


class Transferring(Holding):
    """P: the prompt's KV is on its way to the peer; pinned until the ack."""

    __slots__ = ("res",)

    def __init__(self, res: Resources):
        self.res = res


class Retracted(State):
    """Off the device, its computed KV in a host snapshot: `snapshot` holds
    host pages covering the first `computed` tokens (none: re-prefill from
    scratch). `target` is where its re-prefill ends: the prompt, or for a
    victim past its prompt the whole history."""

    __slots__ = ("epoch", "resumes_generation", "snapshot", "computed", "target")

    def __init__(self, epoch: int, resumes_generation: bool, snapshot: list,
                 computed: int, target: int):
        self.epoch = epoch
        self.resumes_generation = resumes_generation
        self.snapshot = snapshot
        self.computed = computed
        self.target = target


class Finished(State):
    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class Aborted(State):
    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


LIVE = (Waiting, Prefilling, PrefillDone, Decoding, Retracted, RemotePrefilling,
        RemotePrefillDone, Transferring)
RESIDENT = (Prefilling, PrefillDone, Decoding, RemotePrefillDone)


def pd_pinned(req, role_is_prefill: bool) -> bool:
    """Is a PD transfer pinning this request's pages (spec §3.1)?"""
    if role_is_prefill:
        return req.state.holds_pages
    return isinstance(req.state, RemotePrefilling)


def _expect(req, *kinds) -> None:
    if not isinstance(req.state, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise FsmError(f"{req.id}: expected {names}, found {type(req.state).__name__}")


def start_prefill(req, res: Resources, window_end: int, target: int) -> None:
    """Waiting -> Prefilling, or straight to PrefillDone when the first chunk
    reaches the end of the prefill (§1.1: the state is picked by the window)."""
    _expect(req, Waiting)
    if window_end >= target:
        req.state = PrefillDone(res)
    else:
        req.state = Prefilling(res, window_end, target)


def advance_prefill(req, window_end: int) -> None:
    _expect(req, Prefilling)
    st = req.state
    if window_end <= st.window_end or window_end > st.target:
        raise FsmError(f"{req.id}: window {st.window_end} -> {window_end} of {st.target}")
    st.replay = 0                  # spent by the chunk just scheduled
    if window_end == st.target:
        req.state = PrefillDone(st.res)
    else:
        st.window_end = window_end


def begin_decoding(req) -> None:
    _expect(req, PrefillDone, RemotePrefillDone)
    req.state = Decoding(req.state.res)


def start_remote_prefill(req, res: Resources, first_page: int) -> None:
    _expect(req, Waiting)
    req.state = RemotePrefilling(res, first_page)


def remote_landed(req) -> None:
    _expect(req, RemotePrefilling)
    req.state = RemotePrefillDone(req.state.res)


def remote_failed(req, epoch: int) -> Resources:
    """D: the peer's prefill will not arrive. The landing pages go back and
    the request recovers by prefilling locally (an empty snapshot)."""
    _expect(req, RemotePrefilling)
    res = req.state.res
    req.state = Retracted(epoch, False, [], 0, req.num_tokens)
    return res


def withhold_remote_prefill(req) -> Resources:
    """D: a disk read under a remote admission missed before the peer was
    asked. The landing pages go back and the request waits again; the peer
    is never asked for this admission (§4)."""
    _expect(req, RemotePrefilling)
    res = req.state.res
    req.state = Waiting()
    req.retractions += 1
    return res


def start_transfer(req) -> None:
    _expect(req, PrefillDone)
    req.state = Transferring(req.state.res)


def requeue(req) -> Resources:
    """A resident request gives up its pages and waits again (a retraction
    without a host snapshot re-prefills through ordinary admission)."""
    _expect(req, *RESIDENT)
    res = req.state.res
    req.state = Waiting()
    req.retractions += 1
    return res


def retract_to_host(req, epoch: int, snapshot: list, computed: int) -> Resources:
    """A resident request leaves the device with its KV in a host snapshot."""
    _expect(req, Prefilling, PrefillDone, Decoding, RemotePrefillDone)
    st = req.state
    # a prompt-done victim re-prefills its whole history, the sampled token
    # it had not fed yet included, so the completing chunk samples the next
    target = st.target if isinstance(st, Prefilling) else req.num_tokens
    req.state = Retracted(epoch, bool(req.output), snapshot, computed, target)
    req.retractions += 1
    return st.res


def readmit(req, res: Resources, window_end: int, replay: int = 0) -> None:
    """Retracted -> back on the device with `window_end` tokens of KV:
    mid-prompt (Prefilling, its next chunk re-feeding `replay` rows), or
    with its prompt done and a sampled token to feed (PrefillDone)."""
    _expect(req, Retracted)
    st = req.state
    if window_end < st.target:
        req.state = Prefilling(res, window_end, st.target, replay)
    else:
        req.state = PrefillDone(res)


def finish(req, reason: str) -> Resources | None:
    _expect(req, *RESIDENT, Transferring)
    res = getattr(req.state, "res", None)
    req.state = Finished(reason)
    req.finish_reason = reason
    return res


def abort(req, reason: str) -> Resources | None:
    _expect(req, *LIVE)
    res = getattr(req.state, "res", None)
    req.state = Aborted(reason)
    req.finish_reason = "abort"
    req.error = reason
    return res


def computed_tokens(req) -> int:
    """The one frontier for prefix publication (§5): the scheduled window end
    while prefilling, every token but the last once the prompt is done."""
    st = req.state
    if isinstance(st, Prefilling):
        return st.window_end
    if isinstance(st, (PrefillDone, Decoding, RemotePrefillDone, Transferring)):
        return req.num_tokens - 1
    return 0
