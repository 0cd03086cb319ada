"""A router over stand-in engines, for tests that need no cluster."""

from pdserve.cluster.config import ServeConfig
from pdserve.cluster.router import Router
from pdserve.kernels.tokenizer import PrintableTokenizer


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
    from pdserve.cluster.engine_link import EngineLink

    link = r.links[name] = EngineLink(r.engines[name], r.id)
    link.ready.set()
    return link
