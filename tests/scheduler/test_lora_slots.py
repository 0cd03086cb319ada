"""LoRA adapter slots: `lora_slots` (lora.max_loras) adapters on the device,
a slot reused only when quiescent (no resident, retracted, landing or
transferring request references it), so a round never mixes more adapters
than there are slots, a request waiting for a slot says so, and an abort
lets its slot go."""

from support.pd import PDPair
from pdserve.scheduler import Planner, Request, SamplingLimits
from pdserve.scheduler.lora.slots import AdapterSlots
from pdserve.scheduler.fsm import Retracted
from support.planner import config, result_for
from support.lora import drive, under


def test_one_slot_four_adapters_under_load_never_reuses_a_slot_in_use():
    p = Planner(config(max_batch_size=8), lora_slots=1)
    for i in range(16):
        p.submit(under(f"r{i}", i % 5))               # adapters 1..4 and the base, interleaved
    seen = drive(p, p.lora)
    assert seen["rotations"] >= 4
    p.assert_idle()
    assert p.lora.refs == [0]


def test_a_request_waiting_for_a_slot_says_so_and_holds_the_line():
    p = Planner(config(), lora_slots=1)
    p.submit(under("a", 1, max_new=20))
    plan = p.build()
    p.apply(plan, result_for(plan))
    p.submit(under("b", 2))
    p.submit(under("base", 0))
    plan = p.build()
    assert [op.req.id for op in plan.prefills] == [] and [r.id for r in plan.decodes] == ["a"]
    why = {w.req_id: w for w in p.waiting_reasons()}
    assert why["b"].reason == "adapter_slot" and "all 1 (lora.max_loras)" in why["b"].detail
    assert why["base"].reason == "adapter_slot" and why["base"].blocked_by == "b"
    p.apply(plan, result_for(plan))


def test_an_abort_releases_the_slot_for_the_next_adapter():
    p = Planner(config(), lora_slots=1)
    p.submit(under("a", 1, max_new=50))
    plan = p.build()
    p.apply(plan, result_for(plan))
    p.submit(under("b", 2))
    plan = p.build()
    p.apply(plan, result_for(plan))
    assert "b" not in {op.req.id for op in plan.prefills}
    p.abort("a")
    assert p.lora.refs == [0]
    plan = p.build()
    assert [op.req.id for op in plan.prefills] == ["b"] and p.lora.holder == [2]
    p.apply(plan, result_for(plan))
    drive(p, p.lora)
    p.assert_idle()


def test_a_retracted_request_keeps_its_slot_until_it_finishes():
    """A tight pool retracts with host snapshots: victims keep their slot
    (they resume under it), and the slot accounts still close at zero."""
    p = Planner(config(page_size=4, total_pages=16, max_scheduled_tokens=64, safe_steps=4,
                       host_pages=128), lora_slots=2)
    for i in range(8):
        p.submit(under(f"r{i}", 1 + i % 2, n=8, max_new=24))
    seen = drive(p, p.lora)
    assert seen["retracted_holding"]
    p.assert_idle()
    assert p.lora.refs == [0, 0]


def test_p_and_d_each_hold_the_slot_until_the_handoff_ends():
    """D's landing and P's twin reference their slot until the ack; one
    slot each, so D admits B only after A's handoff, and both end at zero."""
    pair = PDPair(lora_slots=1)
    pair.submit(under("a", 1, max_new=3))
    pair.submit(under("b", 2, max_new=3))
    dplan, _ = pair.tick()
    assert [op.req.id for op in dplan.remote_prefills] == ["a"]
    assert pair.P.lora.holder == [1] and pair.D.lora.refs == [1]
    pair.run()
    pair.D.assert_idle()
    pair.P.assert_idle()
    assert pair.D.lora.refs == pair.P.lora.refs == [0]
    assert pair.D.lora.holder == pair.P.lora.holder == [2]


def test_a_base_only_engine_refuses_an_adapter_request():
    import pytest

    from pdserve.scheduler.planner import RejectedRequest
    with pytest.raises(RejectedRequest, match="no adapter slots; configure lora"):
        Planner(config()).submit(under("a", 1))
