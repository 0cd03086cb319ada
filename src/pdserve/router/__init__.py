"""The router: a request's way from a client to its engines and back.

The fronts (`http_api.py`, with the OpenAI wire format of requests in
`openai_protocol.py` and of answers in `openai_answers.py`; `grpc_api.py`)
check a request (the API key: `auth.py`) and hand it to `router.Router`,
which picks its engines (`pairing.py`) and opens a `stream.Stream` per
choice (`merge.py` joins several into one answer). The stream submits to the
engine over its `engine_link.EngineLink` (one Subscribe stream per engine,
events delivered through a `mailbox.Mailbox` per request), turns the
engine's events into deltas, and resubmits when an engine dies; what fails
is a `errors.RequestError` of an `ErrorKind` each front maps to its status.
`membership.py` follows engines' liveness and introduces P to D;
`metrics.py` counts for Prometheus.

Imports run one way: the fronts import the router, and the router imports
neither; `serve.py` opens both fronts on the router's loop for whoever hosts
it. Nothing here imports the engine: the router speaks to engines only
through the control-plane protocol (`proto/`).
"""
