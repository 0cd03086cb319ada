"""An engine's process exits when its interpreter does, even with a
router's event stream open on it: Ray ends a killed actor's worker with a
normal interpreter exit, which joins the gRPC server's worker threads, and
a stream blocked on its queue held such an engine (its loop thread still
polling) for as long as the machine ran."""

import subprocess
import sys
import textwrap

EXIT_BOUND_S = 60.0

SCRIPT = textwrap.dedent("""
    import grpc
    from pdserve.cluster.config import ServeConfig
    from pdserve.proto import control_pb2 as pb
    from pdserve.proto import control_pb2_grpc as pbg
    from pdserve.roles.engine_server import EngineServer

    engine = EngineServer(ServeConfig.from_dict({"cluster": {"fused": 1}}), "fused", 0)
    events = pbg.EngineControlStub(grpc.insecure_channel(engine.address)).Subscribe(
        pb.SubscribeRequest(subscriber="router/1"))
    next(events)                      # the stream is live: its handler waits for events
    print("subscribed", flush=True)
""")


def test_an_engine_with_an_open_event_stream_exits_with_its_interpreter():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=EXIT_BOUND_S)
    assert "subscribed" in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]
