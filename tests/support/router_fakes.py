"""A router over stand-in engines, for tests that need no cluster."""

from pdserve.config import ServeConfig
from pdserve.router.router import Router
from pdserve.text.tokenizer import PrintableTokenizer


def router(shape):
    cfg = ServeConfig.from_dict({"engine": {"page_size": 4}, "cluster": shape})
    engines = [(f"{role}-{i}", role, f"127.0.0.1:{9000 + n}")
               for n, (role, i) in enumerate((r, i) for r in ("fused", "prefill", "decode")
                                             for i in range(shape.get(r, 0)))]
    return Router(cfg, PrintableTokenizer(), 98, engines)


def linked(r: Router, name: str):
    """`r`'s link to engine `name`, ready as if its Subscribe stream were
    open (the engine is whatever `r.engines[name].stub` is); call it on the
    loop the test runs."""
    from pdserve.router.engines.link import EngineLink

    link = r.links[name] = EngineLink(r.engines[name], r.id)
    link.ready.set()
    return link


async def leave_during_submit(r: Router, name: str = "fused-0"):
    """Open a request on `r` and cancel its client while the engine's Submit
    is in flight (the stub sets `entered` once called and holds the call);
    returns the request's Stream."""
    import asyncio

    engine = r.engines[name].stub
    stream = r.open([1, 2, 3], __import__("pdserve").SamplingParams(max_tokens=4))

    async def client():
        async for _ in stream.events():
            pass
    task = asyncio.ensure_future(client())
    await asyncio.wait_for(engine.entered.wait(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return stream
