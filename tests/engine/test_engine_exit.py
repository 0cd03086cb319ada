"""An engine's process exits when its interpreter does, even with a
router's event stream open on it. Ray ends a killed actor's worker with a
normal interpreter exit, which joins the gRPC server's worker threads; a
Subscribe stream blocked on its queue held such an engine (its loop thread
still polling) for as long as the machine ran. The stream's reader is this
test's process, as a router's is its own."""

import subprocess
import sys
import textwrap

import grpc

from pdserve.proto import control_pb2 as pb
from pdserve.proto import control_pb2_grpc as pbg

START_BOUND_S = 180.0      # torch and the engine on a loaded 2-core machine
EXIT_BOUND_S = 60.0        # from "exit now" to the process gone

ENGINE = textwrap.dedent("""
    import sys
    from pdserve.config import ServeConfig
    from pdserve.cluster.actors import build_engine_server

    engine = build_engine_server(ServeConfig.from_dict({"cluster": {"fused": 1}}), "fused", 0)
    print(engine.address, flush=True)
    sys.stdin.readline()            # until the test's stream is open; then exit
""")


def test_an_engine_with_an_open_event_stream_exits_with_its_interpreter(tmp_path):
    err = tmp_path / "stderr"
    with open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-c", ENGINE], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=e, text=True)
    channel = None
    try:
        address = proc.stdout.readline().strip()
        assert address, err.read_text()[-2000:]
        channel = grpc.insecure_channel(address)
        events = pbg.EngineControlStub(channel).Subscribe(
            pb.SubscribeRequest(subscriber="router/1"), timeout=START_BOUND_S)
        next(events)                    # live: its handler now waits on its queue
        proc.stdin.close()              # the engine's interpreter exits, the stream open
        assert proc.wait(timeout=EXIT_BOUND_S) == 0, err.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if channel is not None:
            channel.close()
