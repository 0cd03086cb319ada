"""A request of several choices (prompts x n) is several Streams; a front
answers it as one. `merged` interleaves their deltas as they come, tagged
with the choice's index; `collect` joins each choice's deltas into its whole
answer, for a front that does not stream."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses


@dataclasses.dataclass
class Collected:
    """One choice's deltas joined."""

    text: str = ""
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list | None = None          # None unless the choice asked for logprobs
    finish_reason: str | None = None
    cached_tokens: int = 0                # prompt tokens the engine found cached


async def merged(streams):
    """(choice index, Delta) from every stream as they come; an error from
    any stream (a RequestError, or a bug) ends the whole answer, as it does
    with one stream, and every stream is closed however the iteration ends
    (the engines abort what is left)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0].events()) as deltas:
            async for d in deltas:
                yield 0, d
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async with contextlib.aclosing(s.events()) as deltas:
                async for d in deltas:
                    q.put_nowait((i, d, None))
        except Exception as e:                # raised where the answer is read
            q.put_nowait((i, None, e))
            return
        q.put_nowait((i, None, None))
    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, d, err = await q.get()
            if err is not None:
                raise err
            if d is None:
                left -= 1
                continue
            yield i, d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(streams) -> list[Collected]:
    """Each stream's whole answer, in the streams' order."""
    out = [Collected() for _ in streams]
    async for i, d in merged(streams):
        o = out[i]
        o.text += d.text
        o.token_ids += d.token_ids
        if streams[i].sp.logprobs is not None:
            o.logprobs = (o.logprobs or []) + d.logprobs
        o.finish_reason = d.finish_reason or o.finish_reason
        o.cached_tokens = d.cached_tokens or o.cached_tokens
    return out
