"""The event loop the router and the benchmark's load run on: uvloop's
(libuv, the loop uvicorn and vLLM's server pick) when it is installed, else
asyncio's own. grpc.aio, uvicorn and aiohttp run on either. On two cores the
router's per-token cost fell from 73 to 65 µs on uvloop (`pdserve bench tokens`, measured
when uvloop was adopted)."""

from __future__ import annotations

import asyncio


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(coro):
    """`asyncio.run(coro)` on `new_event_loop()`."""
    loop = new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
