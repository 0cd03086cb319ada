"""The EngineControl gRPC service of an engine: each handler hands its work
to the engine's loop thread (`EngineServer.call`) and never touches the
planner itself."""

from __future__ import annotations

import queue
import time

import grpc

from pdserve.proto import control_pb2 as pb
from pdserve.proto import control_pb2_grpc as pbg
from pdserve.scheduler.planner import RejectedRequest


class EngineControlServicer(pbg.EngineControlServicer):
    def __init__(self, server):
        self.s = server

    def _ack(self, fn, context):
        try:
            self.s.call(fn)
            return pb.Ack(ok=True)
        except RejectedRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def Subscribe(self, request, context):
        """A router's event stream: an empty message once live, then each
        round's events for its requests (rounds that queued up while the
        last message was being sent travel together)."""
        sub = request.subscriber
        q = self.s.outputs.subscribe(sub)

        def gone():
            if self.s.outputs.unsubscribe(sub, q):
                self.s.subscriber_gone(sub)
        context.add_callback(gone)
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
        try:
            self.s.call(lambda: self.s.submit(request))
        except (RejectedRequest, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.s.name} did not take the "
                          "request in time")
        return pb.Ack(ok=True)

    def Abort(self, request, context):
        found = self.s.call(lambda: self.s.abort(request.request_id,
                                                 request.reason or "aborted by client"))
        return pb.Ack(ok=found, error="" if found else "unknown request")

    def RemotePrefill(self, request, context):
        return self._ack(lambda: self.s.remote_prefill(request), context)

    def TransferAck(self, request, context):
        return self._ack(lambda: self.s.transfer_ack(request), context)

    def TransferFailed(self, request, context):
        return self._ack(lambda: self.s.transfer_failed_from_peer(request), context)

    def LeaseHeartbeat(self, request, context):
        self.s.call(lambda: self.s.leases.renew(request.engine, request.request_ids,
                                                time.monotonic()))
        return pb.Ack(ok=True)

    def GetInfo(self, request, context):
        md = self.s.call(lambda: self.s.transport.metadata() if self.s.transport else b"")
        i = self.s.info()
        return pb.InfoResponse(engine=i["engine"], role=i["role"],
                               incarnation=i["incarnation"], nixl_metadata=md,
                               address=i["address"], kv_capacity_tokens=i["kv_capacity_tokens"])

    def AddPeer(self, request, context):
        return self._ack(lambda: self.s.add_peer(request), context)

    def Stats(self, request, context):
        return self.s.call(self.s.stats)
