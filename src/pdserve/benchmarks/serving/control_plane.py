"""`pdserve bench control-plane`: what mutual TLS costs a control call.

One process serves the EngineControl service twice, on a mutual-TLS port
(a leaf of a fresh `DeploymentCA`, proto/control_tls.py) and a plaintext
one, behind a servicer that answers at once, so what is timed is the
channel, not an engine. Three figures, each taken on both ports in the
same rounds, their order alternating (so a busy host's swings hit both):

  submit    a unary Submit the size the router sends (a 512-token prompt,
            sampling options): per-call latency, p50 and p99
  events    a Subscribe stream of one message a round holding 64 requests'
            events (a token and its text each): messages a second
  connect   a fresh channel's first call (TCP, and for TLS the handshake
            and both certificates checked): p50

A served request makes a Submit, a RemotePrefill and a TransferAck, and its
tokens travel on the event stream; `pdserve bench serve --control-plane
secure insecure` measures the whole deployment, where on a loaded host the
noise is far larger than these costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve.benchmarks.common.tables import nearest_rank

EVENTS_A_ROUND = 64


def _echo(stream_messages: int):
    """A servicer that answers at once: the channel is all that is timed.
    (gRPC is imported when the command runs, not for its --help.)"""
    from pdserve.proto import control_pb2 as pb
    from pdserve.proto import control_pb2_grpc as pbg

    class Echo(pbg.EngineControlServicer):
        def __init__(self):
            self.round = pb.EngineEvents(events=[
                pb.RequestEvent(request_id=f"req-{i:04d}", token_ids=[1234], text=" token")
                for i in range(EVENTS_A_ROUND)])

        def Submit(self, request, context):
            return pb.Ack(ok=True)

        def GetInfo(self, request, context):
            return pb.InfoResponse(engine="bench")

        def Subscribe(self, request, context):
            for _ in range(stream_messages):
                yield self.round
    return Echo()


def main(rounds: int = 20, calls: int = 200, stream_messages: int = 500,
         connects: int = 20) -> dict:
    import concurrent.futures as cf

    import grpc

    from pdserve.proto import control_pb2_grpc as pbg
    from pdserve.proto.control_tls import DeploymentCA, add_port, channel

    ca = DeploymentCA.create()
    server_tls, client_tls = ca.issue("engine"), ca.issue("router")
    server = grpc.server(cf.ThreadPoolExecutor(8))
    pbg.add_EngineControlServicer_to_server(_echo(stream_messages), server)
    ports = {"mTLS": add_port(server, "127.0.0.1:0", server_tls),
             "plaintext": add_port(server, "127.0.0.1:0", None)}
    server.start()
    creds = {"mTLS": client_tls, "plaintext": None}
    chans = {k: channel(f"127.0.0.1:{p}", creds[k]) for k, p in ports.items()}
    lat, rate, conn = _timed_rounds(chans, ports, creds, rounds, calls, connects)
    for c in chans.values():
        c.close()
    server.stop(0)
    out: dict[str, dict[str, float]] = {
        k: {"submit_p50_us": nearest_rank(lat[k], 0.5) * 1e6,
            "submit_p99_us": nearest_rank(lat[k], 0.99) * 1e6,
            "events_msgs_per_s": statistics.median(rate[k]),
            "events_msgs_per_s_min": min(rate[k]), "events_msgs_per_s_max": max(rate[k]),
            "connect_p50_ms": nearest_rank(conn[k], 0.5) * 1e3} for k in chans}
    _print_table(out, rounds, calls, stream_messages, connects)
    return out


def _timed_rounds(chans: dict, ports: dict, creds: dict, rounds: int, calls: int,
                  connects: int) -> tuple[dict, dict, dict]:
    """Each round, on every port in turn (the order alternating): `calls`
    Submits, one event stream, and fresh connections. (port -> each
    Submit's seconds, port -> each stream's messages a second, port ->
    each connection's seconds to its first answer.)"""
    from pdserve.proto import control_pb2 as pb
    from pdserve.proto import control_pb2_grpc as pbg
    from pdserve.proto import router_pb2 as rpb
    from pdserve.proto.control_tls import channel

    stubs = {k: pbg.EngineControlStub(c) for k, c in chans.items()}
    submit = pb.SubmitRequest(request_id="bench-0001", token_ids=list(range(512)),
                              subscriber="router-1",
                              sampling=rpb.SamplingOptions(max_tokens=64, temperature=0.7))
    for stub in stubs.values():                 # connected and warm
        for _ in range(20):
            stub.Submit(submit, timeout=10)
    lat: dict[str, list[float]] = {k: [] for k in stubs}
    rate: dict[str, list[float]] = {k: [] for k in stubs}
    conn: dict[str, list[float]] = {k: [] for k in stubs}
    for r in range(rounds):
        order = list(stubs) if r % 2 == 0 else list(reversed(stubs))
        for k in order:
            for _ in range(calls):
                t0 = time.perf_counter()
                stubs[k].Submit(submit, timeout=10)
                lat[k].append(time.perf_counter() - t0)
        for k in order:
            t0 = time.perf_counter()
            n = sum(1 for _ in stubs[k].Subscribe(pb.SubscribeRequest(subscriber="b"),
                                                  timeout=60))
            rate[k].append(n / (time.perf_counter() - t0))
        for k in order:
            for _ in range(max(1, connects // rounds)):
                t0 = time.perf_counter()
                with channel(f"127.0.0.1:{ports[k]}", creds[k]) as ch:
                    pbg.EngineControlStub(ch).GetInfo(pb.InfoRequest(), timeout=10)
                conn[k].append(time.perf_counter() - t0)
    return lat, rate, conn


def _print_table(out: dict, rounds: int, calls: int, stream_messages: int,
                 connects: int) -> None:
    print(f"{rounds} rounds: {calls} Submits, a {stream_messages}-message event stream "
          f"({EVENTS_A_ROUND} requests a message) and {max(1, connects // rounds)} fresh "
          "connections on each port per round, the ports' order alternating")
    print(f"{'port':<10} {'Submit p50':>11} {'Submit p99':>11} {'events msg/s':>13} "
          f"{'(range)':>17} {'connect p50':>12}")
    for k, v in out.items():
        lo, hi = v["events_msgs_per_s_min"], v["events_msgs_per_s_max"]
        print(f"{k:<10} {v['submit_p50_us']:>9.0f}us {v['submit_p99_us']:>9.0f}us "
              f"{v['events_msgs_per_s']:>13.0f} {f'({lo:.0f}-{hi:.0f})':>17} "
              f"{v['connect_p50_ms']:>10.2f}ms")
    s, p = out["mTLS"], out["plaintext"]
    print(f"mTLS/plaintext: Submit p50 {s['submit_p50_us'] / p['submit_p50_us']:.2f}x, "
          f"event stream {s['events_msgs_per_s'] / p['events_msgs_per_s']:.2f}x")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=20, help="rounds on both ports (20)")
    p.add_argument("--calls", type=int, default=200, help="Submits per port a round (200)")


def run(args) -> int:
    main(rounds=args.rounds, calls=args.calls)
    return 0
