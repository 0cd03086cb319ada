"""`RequestError`: a request the router will not or cannot carry out, and
its `ErrorKind`. Each front turns the kind into its own status
(http_api/openai_answers: an HTTP status; grpc_api: a gRPC code); the
router itself never names a wire status."""

from __future__ import annotations

import enum


class ErrorKind(enum.StrEnum):
    """Why a request failed. A StrEnum: its value is the `reason` label of
    the router's request_errors metric."""

    INVALID = "invalid"                # 400 / INVALID_ARGUMENT: the request must change
    EXISTS = "exists"                  # 409 / ALREADY_EXISTS: its id or engine is taken
    OVERLOADED = "overloaded"          # 429 / RESOURCE_EXHAUSTED: retry later
    UNAVAILABLE = "unavailable"        # 503 / UNAVAILABLE: no engine can serve it now
    ABORTED = "aborted"                # 499 / ABORTED: aborted on its engine
    INTERNAL = "internal"              # 500 / INTERNAL: the engine failed it
    NOT_FOUND = "not_found"            # 404 / NOT_FOUND: no such engine
    PRECONDITION = "precondition"      # 409 / FAILED_PRECONDITION: not in that state


class RequestError(Exception):
    """A request the router will not or cannot carry out: `kind` maps to a
    status on each front; `param` names the request field at fault, where
    there is one."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None):
        super().__init__(message)
        # a value is taken as its member: stream._error_kind still names the
        # kind of an engine's error event by value, until that event says it
        self.kind = ErrorKind(kind)
        self.message = message
        self.param = param
