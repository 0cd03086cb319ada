"""What the commands that call a running deployment's router share (drain,
stats, generate --address): a gRPC error is said in one line, exit status 1."""

from __future__ import annotations

import sys
from collections.abc import Callable


def said(call: Callable[[], int]) -> int:
    import grpc

    try:
        return call()
    except grpc.RpcError as e:
        print(f"pdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
