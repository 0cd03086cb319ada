"""The EngineControl gRPC service of an engine: each handler hands its work
to the engine's loop thread (`EngineServer.call`) and never touches the
planner itself."""

from __future__ import annotations

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

    def Submit(self, request, context):
        rid = request.request_id
        # registered first: however the stream ends, the engine lets the request go
        # (after a normal finish the abort finds nothing and does nothing)
        context.add_callback(lambda: self.s._inbox.put(
            lambda: self.s.abort(rid, "client went away")))
        try:
            q = self.s.call(lambda: self.s.submit(request))
        except (RejectedRequest, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.s.name} did not take the "
                          "request in time")
        while True:
            ev = q.get()
            if ev is None:
                return
            yield ev

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
                               address=i["address"])

    def AddPeer(self, request, context):
        return self._ack(lambda: self.s.add_peer(request), context)

    def Stats(self, request, context):
        return self.s.call(self.s.stats)
