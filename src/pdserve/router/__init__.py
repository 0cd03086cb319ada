"""The router: a request's way from a client to its engines and back.

The fronts (`http_api.py` with the OpenAI wire format in `openai_protocol.py`,
`grpc_api.py`) check a request and hand it to `router.Router`, which picks
its engines (`pairing.py`) and opens a `stream.Stream`. The stream submits
to the engine over its `engine_link.EngineLink` (one Subscribe stream per
engine, events delivered through a `mailbox.Mailbox` per request), turns the
engine's events into deltas, and resubmits when an engine dies.
`membership.py` follows engines' liveness and introduces P to D;
`metrics.py` counts for Prometheus. Nothing here imports the engine: the
router speaks to engines only through the control-plane protocol (`proto/`).
"""
