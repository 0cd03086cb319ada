"""LoRA adapters served: `/v1/models` lists them under the base, a
request's `model` selects one through the official openai client and the
gRPC client, fused and disaggregated alike (P computes the prompt's KV
under the adapter D decodes with), and an engine that does not hold a
request's adapter load refuses it."""

import grpc
import openai
import pytest

from support.deployed import deployed
from support.lora import tiny_adapter, tiny_llama
from pdserve import LLM, SamplingParams
from pdserve.client import Client
from pdserve.config import ServeConfig
from pdserve.proto import control_pb2 as cpb
from pdserve.engine.lora.adapters import AdapterMissing

ENGINE = {"page_size": 4, "total_pages": 256, "max_scheduled_tokens": 32, "max_batch_size": 16}
PROMPT = [5, 17, 42, 9, 3, 77, 12, 8, 30, 2, 61]
MODELS = ("", "A", "B")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-serving")
    tiny_llama(d / "base")
    tiny_adapter(d / "c", seed=3)                  # loaded at runtime
    return {"model": {"path": str(d / "base"), "name": "base"}, "engine": ENGINE,
            "lora": {"adapters": {"A": str(tiny_adapter(d / "a", seed=1)),
                                  "B": str(tiny_adapter(d / "b", seed=2, rank=8))},
                     "max_loras": 2, "max_lora_rank": 8, "runtime_updates": True}}


@pytest.fixture(scope="module")
def want(cfg):
    """Each model's greedy answer from the offline API (one fused engine)."""
    llm = LLM(cfg)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = {m: llm.generate([PROMPT], sp, use_tqdm=False, adapter=m or None)[0].text
           for m in MODELS}
    c = dict(cfg, lora={**cfg["lora"], "adapters": {"C": cfg["lora"]["adapters"]["A"][:-1] + "c"}})
    out["C"] = LLM(c).generate([PROMPT], sp, use_tqdm=False, adapter="C")[0].text
    return out


@pytest.fixture(scope="module")
def dep(cfg):
    with deployed({**cfg, "cluster": {"prefill": 1, "decode": 1}},
                  engine_options={"transfer_timeout_s": 30.0}, http_port=0) as d:
        yield d


@pytest.fixture(scope="module")
def oai(dep):
    return openai.OpenAI(base_url=dep.http_address + "/v1", api_key="none", timeout=120,
                         max_retries=0)


def test_models_lists_each_adapter_with_the_base_as_its_parent(oai):
    cards = {m.id: m.model_extra for m in oai.models.list().data}
    assert list(cards) == ["base", "A", "B"]
    assert cards["base"]["parent"] is None
    assert cards["A"]["parent"] == cards["B"]["parent"] == "base"
    assert oai.models.retrieve("B").model_extra["parent"] == "base"


def test_the_model_field_selects_the_adapter_prefilled_on_p_and_decoded_on_d(oai, want):
    """Each model's answer, prefilled on P and decoded on D, is the offline
    API's (one fused engine) under the same adapter; the answer names its
    model."""
    assert len(set(want.values())) == 4            # each adapter changes the answer
    for m in MODELS:
        out = oai.completions.create(model=m or "base", prompt=PROMPT, max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
        assert (out.model, out.choices[0].text) == (m or "base", want[m])


def test_an_unknown_model_is_a_404_in_openai_shape(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="C", prompt=PROMPT, max_tokens=2)
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "'C' is not served here" in err["message"] and "'A', 'B'" in err["message"]
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("C")


def test_the_grpc_api_takes_the_same_name(dep, want):
    c = Client(dep.address, timeout=120)
    try:
        for m in MODELS:
            got = c.generate(PROMPT, model=m, max_tokens=6, ignore_eos=True)
            assert got.text == want[m]
        with pytest.raises(grpc.RpcError) as e:
            c.generate(PROMPT, model="C", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert c.server_info()["adapters"] == ["A", "B"]
    finally:
        c.close()


def test_an_engine_refuses_an_adapter_load_it_does_not_hold(cfg):
    """D (Submit) and P (RemotePrefill) each refuse a request naming an
    adapter, or an adapter's earlier load, that they do not hold: nothing
    runs under other weights than its id stands for."""
    from pdserve.cluster.actors import build_engine_server
    server = build_engine_server(ServeConfig.from_dict(cfg), "prefill", 0, serve=False)
    try:
        held = server.executor.adapters
        assert [(r.name, r.id) for r in held.refs()] == [("A", 1), ("B", 2)]
        for name, load in (("C", 3), ("A", 7), ("A", 2)):
            with pytest.raises(AdapterMissing, match=f"does not hold LoRA adapter '{name}' "
                                                     f"\\(load {load}\\); it holds 'A'"):
                server.peer.remote_prefill(cpb.RemotePrefillRequest(
                    request_id="x", token_ids=PROMPT, adapter=name, adapter_id=load,
                    target_engine="decode-0"))
        assert not server.planner.requests
    finally:
        server.shutdown()


def test_a_runtime_load_serves_at_once_and_a_reload_never_serves_the_old_kv(dep, oai, cfg,
                                                                             want):
    """Loaded at runtime (pinned), C answers as the offline API does; A
    loaded again under its name from C's directory answers as C, although
    A's old load cached the same prompt's prefix on both engines (a new
    load, a new id)."""
    import httpx
    c_dir = cfg["lora"]["adapters"]["A"][:-1] + "c"
    http = httpx.Client(base_url=dep.http_address, timeout=120)

    def ask(model):
        return oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert ask("A") == want["A"]                   # A's prefix cached on P and D
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "C", "lora_path": c_dir,
                                                 "pinned": True})
    assert r.status_code == 200, r.text
    # a second pin would leave no slot of max_loras 2 for the rest: every engine refuses
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "E", "lora_path": c_dir,
                                                 "pinned": True})
    assert r.status_code == 400 and "one must stay free" in r.json()["error"]["message"]
    assert [m.id for m in oai.models.list().data] == ["base", "A", "B", "C"]
    assert ask("C") == want["C"] != want["A"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "A", "lora_path": c_dir})
    assert r.status_code == 200, r.text
    assert ask("A") == want["C"]
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "D", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert "D" not in [m.id for m in oai.models.list().data]


def test_an_unload_during_a_stream_waits_for_it(dep, oai):
    """The unload answers only after the stream under the adapter has run
    to its end, every token delivered; then the name is a 404."""
    import threading
    import time

    import httpx
    stream = oai.completions.create(model="B", prompt=PROMPT, max_tokens=300, temperature=0,
                                    stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    texts = [next(chunks).choices[0].text]
    # mid-stream, vLLM's lora_requests_info names B as running on the decode engine
    metrics = httpx.get(dep.http_address + "/metrics", timeout=30).text
    info = [line for line in metrics.splitlines()
            if line.startswith("pdserve:lora_requests_info{") and 'role="decode"' in line]
    assert info and 'running_lora_adapters="B"' in info[0] and 'max_lora="' in info[0], info
    answered = {}

    def unload():
        answered["started"] = time.monotonic()
        r = httpx.post(dep.http_address + "/v1/unload_lora_adapter", json={"lora_name": "B"},
                       timeout=300)
        answered["at"], answered["status"] = time.monotonic(), r.status_code
    t = threading.Thread(target=unload)
    t.start()
    finish = None
    for c in chunks:
        texts.append(c.choices[0].text)
        finish = c.choices[0].finish_reason or finish
    ended = time.monotonic()
    t.join(300)
    assert finish == "length" and len("".join(texts).split()) == 300
    # the unload was asked mid-stream and the stream still ran to its end under
    # B; the client may read the last chunk a moment after the engine finished
    # it and the unload answered, so the answer is not timed against `ended`
    assert answered["status"] == 200 and answered["started"] < ended
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="B", prompt=PROMPT, max_tokens=2)
    assert "B" not in [m.id for m in oai.models.list().data]


def test_a_restarted_engine_gets_the_runtime_loads_and_unloads_again(dep, oai, want):
    """Ray restarts a killed P with the configured adapters only (A's first
    load and B); the router replays on it what changed at runtime (C loaded,
    A reloaded, B unloaded) and sends it C's requests once it holds C."""
    import time

    import ray

    from support.deployed import engine_channel
    from pdserve.proto import control_pb2_grpc as cpbg
    router = dep.router
    loads = {r.name: r.id for r in router.adapters.refs()}
    assert set(loads) == {"A", "C"} and loads["A"] > 2          # A reloaded, B unloaded
    ref = router.engines["prefill-0"]
    before = ref.incarnation
    ray.kill(dep.actor("prefill-0"), no_restart=False)
    deadline = time.monotonic() + 120
    while not (ref.incarnation != before and ref.alive and set(loads.values()) <= ref.adapters):
        assert time.monotonic() < deadline, (ref.incarnation, ref.alive, ref.adapters)
        time.sleep(0.1)                          # polling the router's view, not timing a race
    router.run_sync(router.adapter_sync.settle())
    with engine_channel(dep, "prefill-0") as ch:
        info = cpbg.EngineControlStub(ch).GetInfo(cpb.InfoRequest(), timeout=10)
    assert list(info.adapters) == [f"C:{loads['C']}", f"A:{loads['A']}"]
    for model, answer in (("C", want["C"]), ("A", want["C"]), ("", want[""])):
        out = oai.completions.create(model=model or "base", prompt=PROMPT, max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == answer


def test_runtime_updates_are_off_unless_enabled():
    from starlette.testclient import TestClient

    from pdserve.text.tokenizer import PrintableTokenizer
    from pdserve.router.http_api import build_app
    from pdserve.router.router import Router
    r = Router(ServeConfig.from_dict({"cluster": {"fused": 1}}), PrintableTokenizer(), 98,
               [("fused-0", "fused", "127.0.0.1:9")])
    http = TestClient(build_app(r))
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        got = http.post(path, json={"lora_name": "x", "lora_path": "/x"})
        assert got.status_code == 400 and "lora.runtime_updates: true" in \
            got.json()["error"]["message"]


def test_the_router_sends_a_request_only_to_engines_holding_its_adapter():
    """A D is picked only with a P that holds the adapter too; with none,
    the refusal says to load it."""
    from pdserve.router.engines.pairing import EngineRef, Pairing
    engines = {n: EngineRef(n, role, "", adapters=held) for n, role, held in [
        ("decode-0", "decode", {1, 2}), ("decode-1", "decode", {2}),
        ("prefill-0", "prefill", {1}), ("prefill-1", "prefill", {2}),
        ("fused-0", "fused", {3})]}
    pairing = Pairing(engines, 4)
    for _ in range(3):
        d, p = pairing.pick("disaggregated", [1, 2, 3], adapter=1)
        assert (d.name, p.name) == ("decode-0", "prefill-0")
        assert {pairing.pick("", [5], adapter=2)[0].name} <= {"decode-0", "decode-1"}
        assert pairing.pick("", [5], adapter=3) == (engines["fused-0"], None)
    with pytest.raises(LookupError, match="holds LoRA adapter load 4; load it there"):
        pairing.pick("", [1], adapter=4)
    engines["prefill-0"].adapters = set()
    with pytest.raises(LookupError, match="load 1"):
        pairing.pick("disaggregated", [1], adapter=1)     # decode-0 has it, no serving P does
    engines["prefill-0"].alive = engines["prefill-1"].alive = False   # no P at all: D prefills
    assert pairing.pick("disaggregated", [1], adapter=1) == (engines["decode-0"], None)
