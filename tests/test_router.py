"""Router pairing without a cluster: least outstanding tokens, prefix
affinity within a slack, and no engine that is down."""

from pdserve.cluster.config import ServeConfig
from pdserve.cluster.router import AFFINITY_SLACK_TOKENS, Router
from pdserve.kernels.tokenizer import PrintableTokenizer


def router(shape):
    cfg = ServeConfig.from_dict({"engine": {"page_size": 4}, "cluster": shape})
    engines = [(f"{role}-{i}", role, f"127.0.0.1:{9000 + n}")
               for n, (role, i) in enumerate((r, i) for r in ("fused", "prefill", "decode")
                                             for i in range(shape.get(r, 0)))]
    return Router(cfg, PrintableTokenizer(), 98, engines)


def test_the_least_loaded_decode_and_prefill_engines_are_paired():
    r = router({"prefill": 2, "decode": 2, "fused": 0})
    r.engines["decode-0"].load = 100
    r.engines["prefill-1"].load = 100
    d, p = r.pick("", [1, 2, 3, 4, 5])
    assert (d.name, p.name) == ("decode-1", "prefill-0")


def test_a_warm_prefix_wins_within_the_slack_and_loses_beyond_it():
    r = router({"fused": 2, "prefill": 0, "decode": 0})
    first, _ = r.pick("", [1, 2, 3, 4, 9])
    first.load += AFFINITY_SLACK_TOKENS            # busier, but within the slack
    again, _ = r.pick("", [1, 2, 3, 4, 7, 7])     # same first page
    assert again is first
    first.load += 1
    other, _ = r.pick("", [1, 2, 3, 4])
    assert other is not first


def test_a_dead_engine_is_never_picked_and_no_engine_is_a_clear_error():
    r = router({"fused": 1, "prefill": 1, "decode": 1})
    r.engines["fused-0"].alive = False
    d, p = r.pick("")
    assert d.name == "decode-0" and p.name == "prefill-0"
    r.engines["prefill-0"].alive = False
    import pytest

    with pytest.raises(LookupError, match="no live engine can serve route 'disaggregated'"):
        r.pick("disaggregated")
