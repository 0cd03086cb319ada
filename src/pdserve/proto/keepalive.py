"""gRPC keepalive for a deployment's own connections: the one place their
channel and server options are built.

Without it a connection whose peer froze (SIGSTOP, a long GC or swap
pause, a VM migration) or whose path went silent (a partition that sends
no RST) looks healthy for as long as the kernel keeps the TCP connection:
a Subscribe stream read nothing and never ended, about 15 minutes. With
it, the end that dials pings the other every KEEPALIVE_TIME_MS once the
connection has carried nothing that long, and closes it when a ping goes
unanswered for KEEPALIVE_TIMEOUT_MS: every call on it fails UNAVAILABLE
(the router's link reads that as a lost engine and moves its requests).
A frozen peer is found within about KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS
(5 s); an answer needs only the peer's gRPC core, not its Python threads,
so a busy engine still answers.

Who sets what:

- `channel_options`: every channel to an engine (the router's, a peer
  engine's; proto/control_tls.channel and aio_channel add them).
- `server_options`: every server a channel of ours dials (an engine's
  control port) and the router's client front. It accepts a ping every
  MIN_PING_INTERVAL_MS without data (gRPC's default takes one ping in 5
  minutes as enough and answers more with GOAWAY "too_many_pings"), and
  pings a caller it has heard nothing from for SERVER_KEEPALIVE_TIME_MS: a
  caller gone for good without a FIN (a router whose host died) loses its
  calls after about 2 minutes, and the engine aborts what it had submitted
  there. A router frozen for less (a long pause, SIGSTOP) keeps its
  requests on the engines and carries on where it stopped.

gRPC 1.85's transport times a keepalive ping out by `grpc.http2.ping_timeout_ms`
(a minute by default), not by `grpc.keepalive_timeout_ms` alone: both are
set, or a stalled stream stays open for that minute (tests/engine/test_liveness.py).

Clients of the router's API (client.py) set no keepalive: a router that
freezes for a while must not end its clients' streams (it carries on
where it stopped when it wakes).
"""

from __future__ import annotations

from collections.abc import Iterable

KEEPALIVE_TIME_MS = 2_000          # a dialling end pings after this long without reading anything
KEEPALIVE_TIMEOUT_MS = 3_000       # ... and closes the connection if the ping is not answered
MIN_PING_INTERVAL_MS = 1_000       # a server takes pings this often (below KEEPALIVE_TIME_MS)
RECONNECT_BACKOFF_MS = 1_000       # a channel whose connection closed tries again this often
SERVER_KEEPALIVE_TIME_MS = 60_000  # a server pings a caller it has heard nothing from this long ...
SERVER_KEEPALIVE_TIMEOUT_MS = 60_000   # ... and drops one that does not answer in this long

Options = list[tuple[str, int | str]]


def channel_options(extra: Iterable[tuple[str, int | str]] = ()) -> Options:
    """A channel to one of the deployment's servers: keepalive on, also
    while no call is open (a link between Subscribe streams, a peer with
    nothing in flight), with no cap on pings between data frames (gRPC's
    default of 2 stops pinging a stalled stream after two); and once a
    connection is closed, a new one tried every second (gRPC's backoff
    grows to 2 minutes: a link that keepalive cut during a partition stayed
    down for half a minute after it healed)."""
    return [("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            *extra]


def server_options(extra: Iterable[tuple[str, int | str]] = ()) -> Options:
    """A server the deployment's channels dial: their pings accepted, with
    or without calls open, never struck as abuse; its own pings to callers
    slow enough that a caller frozen for under two minutes keeps its
    calls."""
    return [("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", SERVER_KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.ping_timeout_ms", SERVER_KEEPALIVE_TIMEOUT_MS),
            *extra]
