"""The request lifecycle: states, the resource bundle, and every transition.

    Waiting --admit--> Prefilling --last chunk--> PrefillDone --> Decoding
       ^                   |                          |              |
       +---- retract ------+--------------------------+--------------+
    any live state --finish--> Finished      any live state --abort--> Aborted

States are small objects; only the functions in this module assign
`request.state`, and a transition that the diagram does not draw raises
`FsmError`. Page-holding states carry one `Resources` bundle which a
transition moves whole: the pages, the count of forwards in flight against
them, and the publication progress of the prefix chain travel together, so
none of them can be dropped on the way from one state to the next.
"""

from __future__ import annotations


class FsmError(RuntimeError):
    """A transition the lifecycle does not allow (a planner bug)."""


class Resources:
    __slots__ = ("tables", "forwards_out", "published", "chain_tail", "publishing",
                 "secured_tokens", "budget_at_admission")

    def __init__(self, num_groups: int):
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.forwards_out = 0      # forwards scheduled against these pages, not yet landed
        self.published = 0         # leading pages of group 0 already in the prefix index
        self.chain_tail = -1       # page of the last published chain node (-1: root)
        self.publishing = True     # False once another request's page owns our next key
        self.secured_tokens = 0    # prompt + headroom the first admission reserved (§4)
        self.budget_at_admission = 0  # remaining new tokens when that admission ran


class State:
    __slots__ = ()
    holds_pages = False


class Waiting(State):
    __slots__ = ()


class Prefilling(State):
    """Computing the prompt: `window_end` tokens are scheduled (the computed
    frontier, §5); `target` is where the prefill ends."""

    __slots__ = ("res", "window_end", "target")
    holds_pages = True

    def __init__(self, res: Resources, window_end: int, target: int):
        self.res, self.window_end, self.target = res, window_end, target


class PrefillDone(State):
    __slots__ = ("res",)
    holds_pages = True

    def __init__(self, res: Resources):
        self.res = res


class Decoding(State):
    __slots__ = ("res",)
    holds_pages = True

    def __init__(self, res: Resources):
        self.res = res


class Finished(State):
    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class Aborted(State):
    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


LIVE = (Waiting, Prefilling, PrefillDone, Decoding)


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
    if window_end == st.target:
        req.state = PrefillDone(st.res)
    else:
        st.window_end = window_end


def begin_decoding(req) -> None:
    _expect(req, PrefillDone)
    req.state = Decoding(req.state.res)


def requeue(req) -> Resources:
    """A live page-holding request gives up its pages and waits again (a
    retraction without a host snapshot re-prefills through admission)."""
    _expect(req, Prefilling, PrefillDone, Decoding)
    res = req.state.res
    req.state = Waiting()
    return res


def finish(req, reason: str) -> Resources | None:
    _expect(req, *LIVE)
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
    if isinstance(st, (PrefillDone, Decoding)):
        return req.num_tokens - 1
    return 0
