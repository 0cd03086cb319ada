"""The planner: the state one engine schedules over, and its round.

    plan = planner.build()           # pure function of the state below
    planner.apply(plan, result)      # land tokens, finish, release

State: `waiting` (requests not yet admitted, in submission order),
`prefilling` (admitted, prompt incomplete), `running` (prompt done:
PrefillDone or Decoding), `retracted` (off the device with a host snapshot),
plus the coordinator's pages and copy tickets. Resident collections keep
submission order, so FIFO is the fairness policy in every phase. The planner
never reads a clock and never draws a random number, so the same
submissions produce the same plans on every machine.

What the cache groups ask of every chunk is derived and checked once, at
start (capacity.group_bounds); what must hold after every step, and at the
end of a lifecycle, is checked by invariants.py (`check_invariants`,
`assert_idle`).
"""

from __future__ import annotations

import bisect
from collections import deque

import pdserve.scheduler.fsm as fsm
import pdserve.scheduler.invariants as invariants
from pdserve.scheduler.lora.slots import AdapterSlots
from pdserve.scheduler.cache.groups import FULL, check_groups, describe
from pdserve.scheduler.capacity import context_bound, group_bounds, group_pages, ingest_error
from pdserve.scheduler.config import EngineConfig
from pdserve.scheduler.cache.coordinator import Coordinator
from pdserve.scheduler.fsm import Prefilling, Retracted, Transferring
from pdserve.scheduler.round.grammar import Role, grammar_for
from pdserve.scheduler.cache.hit import HitCounts
from pdserve.scheduler.cache.group_pools import make_group
from pdserve.scheduler.round.build import PlanBuild
from pdserve.scheduler.plan import Plan, StepResult
from pdserve.scheduler.plan_state import Ending
from pdserve.scheduler.request import Request
from pdserve.scheduler.round.retraction import ensure_progress
from pdserve.scheduler.round.waiting import WaitFacts, WaitReason, wait_reasons


class RejectedRequest(ValueError):
    """A request this deployment can never serve; the message says why and
    what to change."""


class Planner:
    def __init__(self, cfg: EngineConfig, role: Role = Role.FUSED, groups=(FULL,),
                 lora_slots: int = 0):
        """`groups`: the model's cache groups (cache_groups.py); one
        full-history group by default. `lora_slots`: the device's LoRA
        adapter slots (lora.max_loras; 0: the base model only)."""
        groups = list(groups)
        check_groups(groups, cfg.page_size)
        self.cfg = cfg
        self.role = role
        self.groups = groups
        self.page_size = cfg.page_size
        self.decodes_locally = role is not Role.PREFILL
        self.decodes_use_budget = role is Role.FUSED   # D decodes spend no token budget
        self.requeues_victims = role is Role.FUSED     # D recovers through readmission only
        bounds = group_bounds(cfg, groups)             # or a ConfigError (capacity.py)
        self.replay_tokens = bounds.replay_tokens
        self.prefix_tokens = bounds.prefix_tokens
        self.state_reserve = bounds.state_reserve
        self.min_prefill_tokens = bounds.min_prefill_tokens
        ps = cfg.page_size
        pages = group_pages(cfg, groups)
        self.coord = Coordinator([make_group(g, n, ps) for g, n in zip(groups, pages)],
                                 host_pages=cfg.host_pages, host_slots=cfg.host_state_slots)
        self.coord.window_disk = cfg.disk_cache is not None     # the tier stores window tails
        self._grammar = grammar_for(role, cfg.enable_mixed_prefill_decode)
        self.lora = AdapterSlots(lora_slots)
        self.waiting: deque[Request] = deque()
        self.prefilling: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.retracted: dict[str, Request] = {}
        self.landing: dict[str, Request] = {}       # D: RemotePrefilling
        self.transferring: dict[str, Request] = {}  # P: Transferring, awaiting the ack
        self.requests: dict[str, Request] = {}     # every live request, by id
        # engine.overlap: ended while a forward of its own is out; released
        # when the last lands (overlap.py)
        self.ending: dict[str, Ending] = {}
        self.round = 0
        self.stalls: list[str] = []                # rounds the liveness last resort ran
        self.hits = HitCounts()                    # prompt tokens found cached, by tier
        # engine.speculative with its gate on (the engine's to set before a
        # build): decodes may carry candidates, and none runs ahead (overlap.py)
        self.speculating = cfg.speculative is not None
        self._seq = 0
        self._epoch = 0
        self._free_slots: list[int] = []
        self._next_slot = 0
        # what the last build noted about who waits, and why (waiting.wait_reasons)
        self._last_waits: tuple[WaitFacts, Plan, int, int] | None = None

    # ---- ingest ----------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue a request, or raise RejectedRequest if no state of this
        engine could ever serve it (§1.4)."""
        if req.id in self.requests:
            raise RejectedRequest(f"request id {req.id!r} is already live; use a fresh id")
        if not isinstance(req.state, fsm.Waiting) or req.output:
            raise RejectedRequest(f"request {req.id!r} was already scheduled elsewhere")
        max_new = req.limits.max_new_tokens if self.decodes_locally else None
        full = self.coord.full is not None
        err = ingest_error(self.cfg, req.prompt_len, max_new, full)
        if err:
            raise RejectedRequest(err)
        if req.adapter and not self.lora.slots:
            raise RejectedRequest(f"request {req.id!r} names LoRA adapter load {req.adapter}, "
                                  "and this engine has no adapter slots; configure lora")
        mnt = req.limits.max_new_tokens
        req.max_new_tokens = mnt if mnt is not None else \
            context_bound(self.cfg, full) - req.prompt_len
        req.seq = self._seq
        self._seq += 1
        self.requests[req.id] = req
        self.waiting.append(req)

    def abort(self, req_id: str, reason: str = "aborted by client") -> Request:
        """End a live request now. Its pages and snapshot go back, except
        those an unacked copy still reads or writes: the copy's ticket holds
        them until its ack (host_tier.py), so for those the abort takes
        effect then."""
        req = self.requests.get(req_id)
        if req is None:
            raise KeyError(f"no live request {req_id!r}")
        st = req.state
        if isinstance(st, fsm.Holding) and st.res.forwards_out:
            raise fsm.FsmError(f"{req_id}: abort with a forward in flight; abort after it "
                               "lands (or fail its round with fail_plan)")
        if isinstance(st, fsm.Waiting):
            self.waiting.remove(req)
        elif isinstance(st, Retracted):
            del self.retracted[req.id]
            if st.snapshot:
                self.coord.release_snapshot(st.snapshot)
        res = fsm.abort(req, reason)
        self._drop(req, res)
        return req

    # ---- one round -------------------------------------------------------
    def build(self) -> Plan:
        self.round += 1
        self.coord.host_cache.new_round()
        cfg = self.cfg
        # D never runs a prefill chunk beside its decodes (§3.2); P has no decodes
        mixed = cfg.enable_mixed_prefill_decode if self.role is Role.FUSED \
            else self.role is Role.PREFILL
        b = PlanBuild(Plan(self.round), cfg.max_scheduled_tokens, cfg.max_batch_size,
                      decodes_use_budget=self.decodes_use_budget, mixed=mixed)
        self._grammar(self, b)
        ensure_progress(self, b)
        b.plan.stores.extend(self.coord.take_pending_stores())
        self._last_waits = (b.waits, b.plan, self._seq, self._epoch)
        return b.plan

    def apply(self, plan: Plan, result: StepResult) -> list[Request]:
        """Land a round's results; returns the requests that finished."""
        done = []
        stopped = result.stopped
        if len(result.decode_tokens) != len(plan.decodes) or \
                len(result.prefill_tokens) != len(plan.prefills):
            raise ValueError("step result does not match its plan")
        for op_id in result.stores_done:
            self.coord.store_done(op_id)
        missed = self._disk_reads(plan, result)
        for op_id in result.loads_done:
            self.coord.load_done(op_id)
        local = self.decodes_locally
        for op, tok in zip(plan.prefills, result.prefill_tokens):
            req = op.req
            req.state.res.forwards_out -= 1
            if req.id in missed:
                continue                 # computed on pages the disk never filled
            if op.completes:
                req.output.append(tok)
                req.num_tokens += 1
                # P ships every completed prompt; the peer decides when it ends
                if local and (len(req.output) >= req.max_new_tokens or req in stopped):
                    done.append(req)
        for req in plan.decodes:
            req.state.res.forwards_out -= 1
        more = result.decode_more
        for req, tok in zip(plan.decodes, result.decode_tokens):
            out = req.output
            out.append(tok)
            req.num_tokens += 1
            if more and req.id in more:     # a verify's accepted tokens (speculation.py)
                extra = more[req.id][:req.max_new_tokens - len(out)]
                out.extend(extra)
                req.num_tokens += len(extra)
            if len(out) >= req.max_new_tokens:
                done.append(req)
        if plan.verify or result.drafts:
            self._take_drafts(plan, result)
        for rid in missed:
            self._disk_missed(self.requests[rid])
        if stopped:
            done.extend(r for r in plan.decodes if r in stopped and r not in done)
        for req in done:
            # a stop on the last allowed token is still a stop (OpenAI's finish_reason)
            reason = "stop" if req in stopped else "length"
            self._finish(req, reason)
        return done

    def _take_drafts(self, plan: Plan, result: StepResult) -> None:
        """Each request that computed a token this round holds the
        candidates proposed after it, or none; one with another forward
        out (engine.overlap) none: they follow a token it is past."""
        drafts = result.drafts
        for req in [op.req for op in plan.prefills if op.completes] + plan.decodes:
            st = req.state
            req.drafts = drafts.get(req.id, []) if not (
                st.holds_pages and st.res.forwards_out) else []

    def _disk_reads(self, plan: Plan, result: StepResult) -> set[str]:
        """Land the round's disk reads: each ticket lets go; a read that
        hit lifts its request's publication hold; the requests of those
        that missed are returned (they retract once their forward lands)."""
        done, missed = result.disk_loads_done, result.disk_loads_missed
        if len(done) + len(missed) != len(plan.disk_loads):
            raise ValueError("every disk read of a plan is acked, hit or miss, in its "
                             "own round's result")
        out = set()
        for op_id in done:
            op = self.coord.host_cache.disk_load_done(op_id)
            req = self.requests.get(op.req_id)
            if req is not None and isinstance(req.state, fsm.Holding):
                req.state.res.disk_hold = -1
        for op_id in missed:
            op = self.coord.host_cache.disk_load_done(op_id)
            # one ending (engine.overlap: aborted while this round ran) is
            # released as it ends; its hold stays, so nothing is published
            if op.req_id in self.requests and op.req_id not in self.ending:
                out.add(op.req_id)
        return out

    def _disk_missed(self, req: Request) -> None:
        """A disk read missed after admission (§4): the request gives its
        pages back, nothing past its confirmed hit published, and
        re-prefills through ordinary admission without the disk; its
        client is not failed. D's remote admission has not asked its peer
        yet (asks leave after the round): the ask is withheld, so no
        suffix lands on prefix pages the disk never filled."""
        counted = not req.retractions               # its admission counted its hit
        if isinstance(req.state, fsm.RemotePrefilling):
            res = fsm.withhold_remote_prefill(req)
            del self.landing[req.id]
        else:
            res = fsm.requeue(req)
        self.coord.release(res, req.id)
        req.disk_pages = 0
        req.disk_wait = False
        if counted:
            self.hits.disk_tokens -= req.cached[2]  # it will compute them after all
        req.cached = (0, 0, 0)
        self.hits.disk_missed += 1
        self.retracted_from_device(req)

    def fail_plan(self, plan: Plan, reason: str) -> list[Request]:
        """The executor could not carry `plan` out. Its forwards will never
        land and its copies hold nothing trustworthy: give the tickets back
        without publishing, and abort every request whose pages or KV the
        plan touched. Returns those requests; the rest carry on."""
        touched = [op.req for op in plan.prefills] + list(plan.decodes)
        for req in touched:
            if req.state.holds_pages:
                req.state.res.forwards_out -= 1
        for s in plan.stores:
            self.coord.store_failed(s.id)
        for dl in plan.disk_loads:
            self.coord.host_cache.disk_load_done(dl.id)
        for ld in plan.loads:
            self.coord.load_done(ld.id)
        touched += list(plan.readmits) + [r.req for r in plan.retracts if r.stored]
        failed = []
        for req in touched:
            if req.id in self.requests and req not in failed:
                self.abort(req.id, reason)
                failed.append(req)
        return failed

    # ---- events from the peer (disaggregation) ----------------------------
    def transfer_landed(self, req_id: str, first_token: int, stopped: bool = False,
                        drafts=()) -> list:
        """D: the peer's KV and first token arrived (with `drafts`, the
        speculative candidates P proposed after it, for the first decode to
        verify). Returns the requests that finished (a one-token generation
        ends here)."""
        req = self.requests[req_id]
        fsm.remote_landed(req)
        del self.landing[req_id]
        req.output.append(first_token)
        req.num_tokens += 1
        req.drafts = list(drafts) if self.speculating else []
        self._enter(self.running, req)
        if len(req.output) >= req.max_new_tokens or stopped:
            self._finish(req, "stop" if stopped else "length")
            return [req]
        return []

    def transfer_failed(self, req_id: str, reason: str, fence_key=None) -> None:
        """D: the peer's prefill will not arrive (transfer error, timeout,
        peer lost). The request recovers by prefilling locally through the
        readmission path. Its landing pages go back, unless a posted write
        may still reach them: then `fence_key` holds them until
        `release_fence(fence_key)` (the write drained, or P's lease ran out)."""
        req = self.requests[req_id]
        res = fsm.remote_failed(req, self.next_epoch())
        del self.landing[req_id]
        if fence_key is not None:
            self.coord.fence(fence_key, res)
        else:
            self.coord.release(res)
        self._free_slot(req)
        self.retracted[req_id] = req
        req.error = reason

    def release_fence(self, fence_key) -> None:
        self.coord.release_fence(fence_key)

    def peer_ack(self, req_id: str) -> None:
        """P: the peer has the KV (Transferring -> Finished) or no longer
        wants it (any earlier state -> Aborted). Either way the pages go."""
        req = self.requests[req_id]
        if isinstance(req.state, Transferring):
            self.transferring.pop(req_id)
            res = fsm.finish(req, "transferred")
            self._drop(req, res)
        else:
            self.abort(req_id, "the peer released the request")

    # ---- transitions the phases ask for ----------------------------------
    def prefill_completed(self, req: Request) -> None:
        self.prefilling.pop(req.id, None)
        self._enter(self.running, req)

    def readmitted(self, req: Request) -> None:
        del self.retracted[req.id]
        self.take_slot(req)
        if isinstance(req.state, Prefilling):
            self._enter(self.prefilling, req)
        else:
            self._enter(self.running, req)

    def retracted_from_device(self, req: Request) -> None:
        self.prefilling.pop(req.id, None)
        self.running.pop(req.id, None)
        self._free_slot(req)
        if isinstance(req.state, Retracted):
            self.retracted[req.id] = req
        else:
            # back in line at its submission position: it competes like a newcomer
            # (its adapter slot too: nothing of it reads the slot any more)
            self.lora.release(req)
            keys = [r.seq for r in self.waiting]
            self.waiting.insert(bisect.bisect(keys, req.seq), req)

    def next_readmission(self) -> Request | None:
        """Derived, not stored (§4): generations a client is reading first,
        then the oldest retraction. One whose snapshot store is not acked
        yet is no candidate: its load would read host pages before they
        are written."""
        best, best_key = None, None
        in_flight = self.coord.host_cache.snapshot_in_flight if self.coord.stores else None
        for req in self.retracted.values():
            st = req.state
            assert isinstance(st, Retracted)        # `retracted` holds Retracted requests only
            if in_flight is not None and st.snapshot and in_flight(req.id):
                continue
            key = (not st.resumes_generation, st.epoch)
            if best_key is None or key < best_key:
                best, best_key = req, key
        return best

    def next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def record_stall(self, victim) -> None:
        self.stalls.append(
            f"round {self.round}: built nothing with {len(self.requests)} live requests "
            f"(waiting {len(self.waiting)}, prefilling {len(self.prefilling)}, running "
            f"{len(self.running)}, retracted {len(self.retracted)}), {self.free_pages()} of "
            f"{self.cfg.total_pages} pages free; last-resort victim: "
            f"{victim.id if victim is not None else 'none'}")

    @staticmethod
    def _enter(coll: dict, req: Request) -> None:
        """Insert keeping submission order (a readmitted request is older
        than most residents; this is rare, so a rebuild is fine)."""
        if coll and next(reversed(coll.values())).seq > req.seq:
            items = sorted([*coll.values(), req], key=lambda r: r.seq)
            coll.clear()
            coll.update((r.id, r) for r in items)
        else:
            coll[req.id] = req

    def take_slot(self, req: Request) -> None:
        if self._free_slots:
            req.slot = self._free_slots.pop()
        else:
            req.slot = self._next_slot
            self._next_slot += 1

    def _finish(self, req: Request, reason: str) -> None:
        st = req.state
        assert isinstance(st, fsm.Holding)          # only a request holding pages finishes here
        if st.res.forwards_out:
            raise fsm.FsmError(f"{req.id}: finished with a forward in flight")
        # publish every computed full page before letting go (finish-time flush)
        self.coord.publish(req, st.res, (req.num_tokens - 1) // self.page_size)
        res = fsm.finish(req, reason)
        self._drop(req, res)

    def _drop(self, req: Request, res) -> None:
        if res is not None:
            if res.forwards_out:
                raise fsm.FsmError(f"{req.id} released with a forward in flight")
            self.coord.release(res, req.id)
        self.prefilling.pop(req.id, None)
        self.running.pop(req.id, None)
        self.landing.pop(req.id, None)
        self.transferring.pop(req.id, None)
        self.ending.pop(req.id, None)
        self.requests.pop(req.id, None)
        self._free_slot(req)
        self.lora.release(req)

    def _free_slot(self, req: Request) -> None:
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1

    # ---- queries ---------------------------------------------------------
    def waiting_reasons(self) -> list[WaitReason]:
        """Why each request that is not running waits, by the rule that held
        it in the last build(): one entry per request in `waiting` (FIFO),
        `retracted` (readmission order) and, on D, `landing`. Computed on
        demand from a few facts the build noted (waiting.py); cheap to
        leave uncalled."""
        return wait_reasons(self, self._last_waits)

    def cached_pages(self, req: Request) -> int:
        """Prompt pages of `req` device and host hold now (what a disk
        probe need not ask for). Pure."""
        return self.coord.match(req, (req.num_tokens - 1) // self.page_size).pages

    def waiting_on_peer(self) -> bool:
        """Requests whose next step is the peer's (a landing, an ack)."""
        return bool(self.landing or self.transferring)

    def has_work(self) -> bool:
        """Live requests, or copies whose tickets still hold pages."""
        c = self.coord
        return bool(self.requests or c.stores or c.loads or c.pending_stores
                    or c.host_cache.disk_loads)

    def held_by_fences(self) -> int:
        return self.coord.fenced_pages()

    def free_pages(self) -> int:
        return self.coord.free_pages()

    @property
    def total_pages(self) -> int:
        return self.cfg.total_pages

    def check_invariants(self) -> None:
        """Pool and index consistency, and that every live request is in
        exactly the collection its state says (invariants.py)."""
        invariants.check_invariants(self)

    def describe_groups(self) -> str:
        return describe(self.groups)

    def assert_idle(self) -> None:
        """Nothing live and no page held: what every lifecycle ends with."""
        invariants.assert_idle(self)
