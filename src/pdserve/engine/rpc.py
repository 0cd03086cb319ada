"""The EngineControl gRPC service of an engine: each handler hands its work
to the engine's loop thread (`EngineServer.call`) and never touches the
planner itself; GetInfo alone answers on its own thread (what it says is
fixed at start, or the watchdog's clocks), so that a stuck loop is reported,
not waited for. Each message is checked first (engine/control_checks.py):
one that fails is refused with INVALID_ARGUMENT before anything changes.
Work a draining engine will not take is refused with FAILED_PRECONDITION
(engine/drain.py): the caller sends it elsewhere. Who may call at all is the
port's business (mutual TLS, proto/control_tls.py)."""

from __future__ import annotations

import queue
import threading

import grpc

from pdserve.proto import control_pb2 as pb
from pdserve.proto import control_pb2_grpc as pbg
from pdserve.engine import control_checks as checks
from pdserve.engine.lora.host import fingerprint
from pdserve.engine.drain import STOP_GRACE_S, EngineDraining, EngineStopped
from pdserve.scheduler.planner import RejectedRequest


# how long a handler waits for the loop thread when its caller names no deadline
CALL_TIMEOUT_S = 30.0


class StaleView(Exception):
    """A Submit made on a view of this engine the router must update first
    (a subscription that ended, a prefill peer not introduced yet): the
    request itself is fine; the router tries again (gRPC ABORTED)."""


class EngineControlServicer(pbg.EngineControlServicer):
    def __init__(self, server):
        self.s = server
        self._streams = 0                       # Subscribe calls not yet terminated
        self._streams_cv = threading.Condition()

    def _on_loop(self, fn, context):
        """fn() on the loop thread, for as long as the caller waits: past its
        deadline the job is dropped unrun (EngineServer.call) and this
        raises TimeoutError."""
        left = context.time_remaining()
        wait = CALL_TIMEOUT_S if left is None else max(0.0, min(CALL_TIMEOUT_S, left))
        return self.s.call(fn, timeout=wait)

    def _call(self, fn, context):
        """_on_loop, a loop that did not get to the call in time answered as
        DEADLINE_EXCEEDED. (Raised out of the handler, the TimeoutError
        reached the caller as UNKNOWN whenever this side's wait ran out
        before gRPC noticed the caller's deadline.)"""
        try:
            return self._on_loop(fn, context)
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"{self.s.name}'s loop did not run the call before its deadline "
                          "(the loop is busy or stuck: GetInfo says which)")

    @staticmethod
    def _checked(check, context, *args) -> None:
        """Run a message's check; INVALID_ARGUMENT (the call ends) if it fails."""
        try:
            check(*args)
        except checks.BadMessage as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _ack(self, fn, context):
        try:
            self._call(fn, context)
            return pb.Ack(ok=True)
        except RejectedRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDraining as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except EngineStopped as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    def Subscribe(self, request, context):
        """A router's event stream: an empty message once live, then each
        round's events for its requests (rounds that queued up while the
        last message was being sent travel together)."""
        self._checked(checks.check_subscribe, context, request)
        if self.s.drain.stopped.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.s.name} has drained and stopped")
        sub = request.subscriber
        q = self.s.outputs.subscribe(sub)
        with self._streams_cv:
            self._streams += 1

        def gone():
            with self._streams_cv:
                self._streams -= 1
                self._streams_cv.notify_all()
            if self.s.outputs.unsubscribe(sub, q):
                self.s.subscriber_gone(sub)
            q.put(None)                         # a handler waiting on q returns its thread
        if not context.add_callback(gone):
            gone()                              # it terminated already
        yield pb.EngineEvents()
        while True:
            events = q.get()
            if events is None:
                return
            while True:
                try:
                    more = q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    yield pb.EngineEvents(events=events)
                    return
                events = events + more
            yield pb.EngineEvents(events=events)

    def Submit(self, request, context):
        self._checked(checks.check_submit, context, request, self.s.bounds)
        try:
            self._on_loop(lambda: self.s.submit(request), context)
        except (RejectedRequest, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except StaleView as e:
            context.abort(grpc.StatusCode.ABORTED, str(e))
        except EngineDraining as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except EngineStopped as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.s.name} did not take the "
                          "request in time")
        return pb.Ack(ok=True)

    def Abort(self, request, context):
        self._checked(checks.check_abort, context, request)
        found = self._call(lambda: self.s.abort(request.request_id,
                                                request.reason or "aborted by client"), context)
        return pb.Ack(ok=found, error="" if found else "unknown request")

    def RemotePrefill(self, request, context):
        self._checked(checks.check_remote_prefill, context, request, self.s.bounds)
        return self._ack(lambda: self.s.peer.remote_prefill(request), context)

    def TransferAck(self, request, context):
        self._checked(checks.check_transfer_ack, context, request)
        return self._ack(lambda: self.s.peer.transfer_ack(request), context)

    def TransferFailed(self, request, context):
        self._checked(checks.check_transfer_failed, context, request)
        return self._ack(lambda: self.s.peer.transfer_failed_from_peer(request), context)

    def LeaseHeartbeat(self, request, context):
        self._checked(checks.check_heartbeat, context, request)
        self._call(lambda: self.s.peer.heartbeat(request), context)
        return pb.Ack(ok=True)

    def TransferEnded(self, request, context):
        self._checked(checks.check_transfer_ended, context, request)
        return self._ack(lambda: self.s.peer.transfer_ended_from_peer(request), context)

    def GetInfo(self, request, context):
        """Answered on this handler thread, never the loop's: a stuck loop
        must not hold up the answer that says it is stuck, with the
        watchdog's readings (engine/watchdog.py)."""
        i, h = self.s.info(), self.s.watchdog.health()
        return pb.InfoResponse(engine=i["engine"], role=i["role"],
                               incarnation=i["incarnation"], nixl_metadata=self.s.metadata,
                               address=i["address"], kv_capacity_tokens=i["kv_capacity_tokens"],
                               draining=i["draining"], adapters=i["adapters"],
                               spec_config=i["spec_config"], loop_quiet_s=h.loop_quiet_s,
                               outputs_busy_s=h.outputs_busy_s, unhealthy=h.unhealthy)

    def AddPeer(self, request, context):
        self._checked(checks.check_add_peer, context, request, self.s.name)
        return self._ack(lambda: self.s.peer.add_peer(request), context)

    def RemovePeer(self, request, context):
        self._checked(checks.check_remove_peer, context, request, self.s.name)
        return self._ack(lambda: self.s.peer.remove_peer(request), context)

    def Drain(self, request, context):
        """Start draining and answer once the engine has stopped (past the
        deadline, after it aborted what was left)."""
        self._checked(checks.check_drain, context, request)
        drain = self.s.drain
        deadline = request.deadline_s                # 0: abort what is left at once
        try:
            self._call(lambda: self.s.begin_drain(deadline), context)
        except EngineStopped:
            pass                                  # drained already: its report stands
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # past the deadline: a round in progress ends, the aborts, the stop
        wait = min(deadline + 6 * STOP_GRACE_S, max(context.time_remaining() - 0.5, 0.0))
        if not drain.stopped.wait(wait):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"{self.s.name} did not stop within {wait:.0f} s of the drain")
        # answer once every router's stream has sent its last events: whoever
        # retires the engine on this answer cannot cut a stream's tail
        with self._streams_cv:
            self._streams_cv.wait_for(lambda: self._streams == 0, STOP_GRACE_S)
        return drain.report

    def LoadAdapter(self, request, context):
        """Read the adapter here (off the loop), then hold it on the loop."""
        self._checked(checks.check_adapter, context, request)
        adapters = self.s.executor.adapters
        if adapters is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.s.name} serves no LoRA "
                          "adapters (no lora section in its config)")
        if adapters.holds(request.name, request.id):
            return pb.Ack(ok=True)              # sent again (the router's replay): held
        try:
            stamp = fingerprint(request.path)
            weights = adapters.read(request.path)
            self._call(lambda: self.s.load_adapter(request.name, request.path, request.id,
                                                   weights, request.pinned, stamp), context)
        except ValueError as e:                 # a bad adapter, name or id
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineStopped as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.Ack(ok=True)

    def UnloadAdapter(self, request, context):
        """Answer once no request under the load is left on this engine."""
        self._checked(checks.check_adapter, context, request)
        try:
            done = self._call(lambda: self.s.unload_adapter(request.name, request.id), context)
        except RejectedRequest as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        left = context.time_remaining()
        if not done.wait(None if left is None else max(left - 0.5, 0.0)):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.s.name}: requests under "
                          f"adapter {request.name!r} still run; it is unloaded once they end")
        return pb.Ack(ok=True)

    def Stats(self, request, context):
        return self._call(self.s.stats, context)
