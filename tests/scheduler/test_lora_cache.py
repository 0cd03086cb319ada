"""No KV computed under one adapter serves another: the adapter's load id
salts every cache key (the device prefix index, the host tier, what a D
tells its P it holds), and a reload under the same name is a new id."""

import re

import pytest

from support.pd import PDPair
from pdserve.scheduler import Planner, Request, SamplingLimits
from pdserve.scheduler.config import ConfigError
from pdserve.scheduler.lora.adapters import BASE, AdapterNameError, AdapterRegistry
from support.planner import config, req, result_for, run_to_completion

PROMPT = list(range(1, 17))          # four full pages of 4


def under(rid: str, adapter: int, prompt=PROMPT, max_new: int = 2) -> Request:
    return Request(rid, prompt, SamplingLimits(max_new_tokens=max_new), adapter=adapter)


def cached_pages(p: Planner, adapter: int) -> int:
    """Device pages a fresh request of PROMPT + one token under `adapter` would hit."""
    return p.coord.match(under("probe", adapter, PROMPT + [99]), 4).device_end


def test_registry_gives_every_load_a_new_id_even_under_the_same_name():
    reg = AdapterRegistry.from_config({"a": "/x/a", "b": "/x/b"}, base_name="base")
    a1 = reg.resolve("a")
    assert (a1, reg.resolve("b"), reg.resolve("base"), reg.resolve("")) == (1, 2, BASE, BASE)
    reg.unload("a")
    with pytest.raises(KeyError, match="'a' is not served here.*'base', 'b'"):
        reg.resolve("a")
    again = reg.load("a", "/x/a").id
    reload = reg.load("a", "/x/a2").id          # in place: the old id stops resolving
    assert len({a1, again, reload}) == 3 and reg.resolve("a") == reload
    assert reg.by_id(again) is None
    with pytest.raises(AdapterNameError, match="never reused"):
        reg.load("c", "/x/c", id=reload)
    with pytest.raises(AdapterNameError, match="base model's name"):
        reg.load("base", "/x/c")


def test_base_a_b_and_a_reloaded_never_share_a_cached_prefix():
    """The same prompt under base, A, B and A reloaded (a new id): each
    computes its prefix itself, and each hits only its own afterwards."""
    reg = AdapterRegistry.from_config({"A": "/a", "B": "/b"})
    a_old = reg.resolve("A")
    a_new = reg.load("A", "/a").id
    p = Planner(config(page_size=4), lora_slots=4)
    for i, adapter in enumerate([BASE, a_old, reg.resolve("B"), a_new]):
        assert cached_pages(p, adapter) == 0, f"adapter id {adapter} hit another's prefix"
        p.submit(under(f"r{i}", adapter))
        plan = p.build()
        assert [(op.begin, op.tokens) for op in plan.prefills] == [(0, 16)]
        p.apply(plan, result_for(plan))
        run_to_completion(p)
        assert cached_pages(p, adapter) == 4
    p.assert_idle()


def test_same_adapter_hits_its_own_prefix():
    p = Planner(config(page_size=4), lora_slots=4)
    p.submit(under("a", 7))
    run_to_completion(p)
    p.submit(under("b", 7, PROMPT + [99, 98]))
    plan = p.build()
    assert [(op.begin, op.tokens) for op in plan.prefills] == [(16, 2)]


def test_a_host_copy_serves_only_its_own_adapter():
    """A's prefix evicted to host: B's identical prompt loads nothing from
    it and computes all; A's loads it back."""
    p = Planner(config(page_size=4, total_pages=8, host_pages=64, max_scheduled_tokens=64),
                lora_slots=4)
    p.submit(under("a", 1))
    run_to_completion(p)
    p.submit(req("flush", list(range(100, 128)), max_new=4))    # evicts A's pages to host
    run_to_completion(p)
    p.submit(under("b", 2, PROMPT + [99]))
    plan = p.build()
    assert not plan.loads and [(op.begin, op.tokens) for op in plan.prefills] == [(0, 17)]
    p.apply(plan, result_for(plan))
    run_to_completion(p)
    p.submit(under("a2", 1, PROMPT + [99]))
    plan = p.build()
    assert sum(len(ld.host_pages) for ld in plan.loads) == 4
    assert [(op.begin, op.tokens) for op in plan.prefills] == [(16, 1)]
    p.apply(plan, result_for(plan))
    run_to_completion(p)
    p.assert_idle()


def test_d_tells_p_it_holds_only_pages_of_the_same_adapter():
    """D's prefix hit decides the first page P ships; under another
    adapter D holds nothing of the prompt, so P computes and ships it all."""
    pair = PDPair(lora_slots=4)
    prompt = list(range(1, 41))
    pair.submit(under("a", 1, prompt))
    pair.run()
    pair.submit(under("b", 2, prompt + [7, 7, 7]))
    dplan, _ = pair.tick()
    assert [op.first_page for op in dplan.remote_prefills] == [0]
    pair.run()
    pair.submit(under("c", 1, prompt + [7, 7, 7]))
    dplan, _ = pair.tick()
    assert [op.first_page for op in dplan.remote_prefills] == [10]
    pair.run()
    pair.D.assert_idle()
    pair.P.assert_idle()


def test_up_takes_lora_modules_and_refuses_a_bad_adapter_before_starting_ray(tmp_path, capsys,
                                                                           monkeypatch):
    """--lora-modules adds to the config's adapters, --max-loras overrides
    its slots, and every adapter is checked before Ray starts."""
    from support.lora import tiny_adapter
    from pdserve.cli.main import main
    from pdserve.cluster import deploy
    from pdserve.config import Flags, LoraConfig, ServeConfig, with_flags

    def flagged(data: dict, *modules: str, max_loras=None) -> LoraConfig:
        return ServeConfig.from_dict(with_flags(data, Flags(lora_modules=modules,
                                                            max_loras=max_loras))).lora

    lora = LoraConfig.from_dict({"adapters": {"a": "rel/a"}, "max_loras": 2}, tmp_path)
    assert lora.adapters == (("a", str(tmp_path / "rel/a")),)
    file = {"lora": {"adapters": {"a": "/x/a"}, "max_loras": 2}}
    more = flagged(file, "b=/x/b", "a=/x/a2", max_loras=3)
    assert (more.adapters, more.max_loras) == ((("a", "/x/a2"), ("b", "/x/b")), 3)
    # vLLM's JSON form, which can also pin; a later name=path of the same name unpins it
    pin = flagged(file, '{"name": "c", "path": "/x/c", "pinned": true}', max_loras=3)
    assert (dict(pin.adapters)["c"], pin.pinned) == ("/x/c", ("c",))
    pinned = {"lora": {"adapters": {"c": {"path": "/x/c", "pinned": True}}, "max_loras": 3}}
    assert flagged(pinned, "c=/x/c2").pinned == ()
    for bad, says in (('{"name": "c"', "is not valid JSON"),
                      ('{"name": "c", "path": "/p", "pin": true}', "unknown keys ['pin']"),
                      ('{"name": "c", "path": "/p", "pinned": "yes"}', "pinned true or false")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            flagged(file, bad)
    monkeypatch.setattr(deploy, "Deployment", None)      # never reached
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cluster: {fused: 1}\n")
    good = tiny_adapter(tmp_path / "good", seed=1)       # the tiny preset's shapes differ
    assert main(["up", "--config", str(cfg), "--lora-modules", f"x={good}"]) == 2
    assert "it was trained for another base model" in capsys.readouterr().err
    assert main(["up", "--config", str(cfg), "--lora-modules", "x"]) == 2
    assert "--lora-modules 'x': give name=path" in capsys.readouterr().err
    # more adapters than host memory keeps is fine (evicted, re-read); each is still read
    assert main(["up", "--config", str(cfg), "--lora-modules", "x=/a", "y=/b"]) == 2
    assert "LoRA adapter '/a' has no adapter_config.json" in capsys.readouterr().err
