"""End to end on one local Ray cluster (shared by the module): a fused
engine, a prefill engine and a decode engine behind the router."""

import asyncio
import threading
import time

import grpc
import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.client import AsyncClient, Client
from pdserve.cluster.cpu_threads import served_threads
from pdserve.cluster.deploy import niceness_warnings
from pdserve.config import ServeConfig

from support.deployed import deployed

ENGINE = {"page_size": 16, "total_pages": 512, "max_scheduled_tokens": 64,
          "max_batch_size": 64}
PROMPTS = ["The quick brown fox", "The quick brown fox jumps over the lazy dog",
           "Disaggregated prefill", "The quick brown cat" * 8, "x"]
# A generation the tiny model cannot finish within ABORT_BOUND_S: 4,000 tokens
# take a lone request 9 s or more on a 2-core machine (3,000 took 7 s idle;
# 4,000 took 21-26 s under load), so only an abort brings its engine back to
# idle within the bound.
LONG = 4000
ABORT_BOUND_S = 3.0


@pytest.fixture(scope="module")
def deployment():
    cfg = {"engine": ENGINE,
           "cluster": {"prefill": 1, "decode": 1, "fused": 1}}
    with deployed(cfg, engine_options={"transfer_timeout_s": 20.0}) as dep:
        yield dep


@pytest.fixture
def client(deployment):
    c = Client(deployment.address, timeout=120)
    yield c
    wait_idle(c)
    c.close()


def wait_idle(c: Client, seconds: float = 30.0) -> None:
    """Every engine back to no page held or pinned and nothing running (the
    P side lets go when D's ack arrives, which may trail the stream)."""
    deadline = time.monotonic() + seconds
    while True:
        stats = c.stats()
        busy = [s for s in stats if s["used_pages"] or s["pinned_pages"] or s["running"]
                or s["waiting"]]
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engines not idle: {busy}")


def counters(c: Client) -> dict[str, dict]:
    """Each engine's stats by name: its counters (finished, aborted,
    transfers, ...) since it started."""
    return {s["name"]: s for s in c.stats()}


def concurrently(fn, items):
    out = [None] * len(items)
    errs = []

    def run(i, x):
        try:
            out[i] = fn(x)
        except Exception as e:            # surfaced below
            errs.append(e)
    ts = [threading.Thread(target=run, args=(i, x)) for i, x in enumerate(items)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    return out


def test_disaggregated_equals_fused_equals_offline(client):
    want = [o.token_ids for o in LLM(**ENGINE).generate(
        PROMPTS, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)]
    for route, engine in (("fused", "fused-0"), ("disaggregated", "decode-0")):
        got = concurrently(lambda p: client.generate(p, max_tokens=20, route=route,
                                                     ignore_eos=True), PROMPTS)
        assert [g.token_ids for g in got] == want, route
        assert {g.engine for g in got} == {engine}


def test_a_local_ray_runs_the_engines_at_nice_0(deployment):
    """Not Ray's worker default of 15: an engine's loop thread must not wait
    for a core behind the router and the clients on its host."""
    infos = ray.get([a.info.remote() for _, _, a in deployment.engines])
    assert [i["niceness"] for i in infos] == [0, 0, 0]
    assert niceness_warnings(infos) == []
    lines = niceness_warnings([{**infos[0], "niceness": 15}, infos[1]])
    assert len(lines) == 1 and infos[0]["engine"] in lines[0] and "nice 15" in lines[0] \
        and "RAY_worker_niceness=0" in lines[0]


def test_cpu_engines_run_the_torch_threads_their_config_gives(deployment):
    """Not Ray's OMP_NUM_THREADS=1 for an actor without CPUs: engine.cpu_threads
    (auto here: one thread each)."""
    cfg = ServeConfig.from_dict({"engine": ENGINE,
                                 "cluster": {"prefill": 1, "decode": 1, "fused": 1}})
    infos = ray.get([a.info.remote() for _, _, a in deployment.engines])
    assert [i["torch_threads"] for i in infos] == \
        [served_threads(cfg, role) for _, role, _ in deployment.engines]


def test_tokens_stream_in_order_and_only_the_last_chunk_finishes(client):
    chunks = list(client.generate_stream(PROMPTS[1], max_tokens=12, ignore_eos=True,
                                         route="disaggregated"))
    assert [c.finish_reason for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == "length"
    whole = client.generate(PROMPTS[1], max_tokens=12, ignore_eos=True, route="fused")
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    assert len(chunks) >= 2                      # it streamed, it did not arrive at once


@pytest.mark.parametrize("route,engine", [("fused", "pdserve:fused-0"),
                                          ("disaggregated", "pdserve:decode-0")])
def test_abort_mid_stream_ends_the_stream_and_frees_everything(client, route, engine):
    before = counters(client)[engine]
    stream = client.generate_stream(PROMPTS[0], request_id=f"long-{route}", max_tokens=LONG,
                                    ignore_eos=True, route=route)
    got, aborted = 0, False
    with pytest.raises(grpc.RpcError) as e:
        for chunk in stream:
            got += len(chunk.token_ids)
            if got >= 3 and not aborted:
                aborted = client.abort(f"long-{route}")
    assert e.value.code() == grpc.StatusCode.ABORTED
    assert 3 <= got < LONG
    wait_idle(client, ABORT_BOUND_S)              # far sooner than the generation could end
    after = counters(client)[engine]
    assert after["aborted"] == before["aborted"] + 1
    assert after["finished"] == before["finished"]


def test_a_client_that_disconnects_is_aborted_on_the_engine(client, deployment):
    from pdserve.proto import router_pb2 as pb
    from pdserve.proto import router_pb2_grpc as pbg

    before = counters(client)["pdserve:decode-0"]
    ch = grpc.insecure_channel(deployment.address)
    call = pbg.RouterStub(ch).Generate(pb.GenerateRequest(
        text="bye", sampling=pb.SamplingOptions(max_tokens=LONG, ignore_eos=True),
        route="disaggregated"))
    next(call)
    call.cancel()
    ch.close()
    wait_idle(client, ABORT_BOUND_S)
    after = counters(client)["pdserve:decode-0"]
    assert after["aborted"] == before["aborted"] + 1
    assert after["finished"] == before["finished"]


def test_a_stranger_on_the_host_cannot_drive_the_engines(client):
    """The issue's stranger: a plaintext gRPC client with no credentials at
    each engine's port calls GetInfo, Stats and an empty Drain. Every call
    is refused (the TLS handshake fails: UNAVAILABLE), and the deployment
    serves on, disaggregated and fused."""
    from pdserve.proto import control_pb2 as cpb
    from pdserve.proto import control_pb2_grpc as cpbg

    for s in client.stats():
        with grpc.insecure_channel(s["address"]) as ch:
            stub = cpbg.EngineControlStub(ch)
            for call, msg in ((stub.GetInfo, cpb.InfoRequest()), (stub.Stats, cpb.InfoRequest()),
                              (stub.Drain, cpb.DrainEngineRequest())):
                with pytest.raises(grpc.RpcError) as e:
                    call(msg, timeout=10)
                assert e.value.code() is grpc.StatusCode.UNAVAILABLE, e.value
    for route in ("disaggregated", "fused"):
        assert len(client.generate(PROMPTS[0], max_tokens=3, ignore_eos=True,
                                   route=route).token_ids) == 3
    assert not any(e["draining"] for e in client.server_info()["engines"])


def test_stats_and_server_info_describe_every_engine(client):
    info = client.server_info()
    assert {e["name"] for e in info["engines"]} == {"pdserve:fused-0", "pdserve:prefill-0",
                                                   "pdserve:decode-0"}
    assert all(e["alive"] for e in info["engines"])
    # where engines listen is for the cluster's own: stats (behind the API key) say
    assert all(e["address"] == "" for e in info["engines"])
    assert all(s["address"].startswith("127.0.0.1:") for s in client.stats())
    assert info["max_prompt_tokens"] == 4095           # the tiny model's context, less the decode slot
    before = counters(client)
    assert before["pdserve:prefill-0"]["total_pages"] == 512
    client.generate(PROMPTS[2], max_tokens=2, route="disaggregated")
    after = counters(client)
    for name in ("pdserve:prefill-0", "pdserve:decode-0"):   # P shipped it, D landed it
        assert after[name]["transfers"] == before[name]["transfers"] + 1, name
    p_bytes = [s["pdserve:prefill-0"]["transfer_bytes"] for s in (before, after)]
    assert p_bytes[1] > p_bytes[0]


def test_each_engine_counts_its_rounds_their_tokens_and_time(client, deployment, capsys):
    """A fused request of a 9-token prompt and 5 tokens out: one round
    prefills (its first token comes from it), four decode; the counters
    grow by at least that, and the loop thread's CPU in them is positive
    and no more than their wall time. `pdserve stats` says it."""
    from pdserve.cli.main import main

    before = counters(client)["pdserve:fused-0"]
    client.generate([7, 3, 9, 4, 11, 5, 8, 6, 12], max_tokens=5, ignore_eos=True, route="fused")
    after = counters(client)["pdserve:fused-0"]
    rounds = after["rounds"] - before["rounds"]
    tokens = after["round_tokens"] - before["round_tokens"]
    wall = after["round_seconds"] - before["round_seconds"]
    cpu = after["round_cpu_seconds"] - before["round_cpu_seconds"]
    assert rounds >= 5 and tokens >= 9 + 4
    assert 0 < cpu <= wall * 1.05 + 0.001
    assert main(["stats", "--address", deployment.address]) == 0
    assert "pdserve:fused-0 ran" in capsys.readouterr().out


def test_health_checking_and_reflection_are_served(deployment):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    ch = grpc.insecure_channel(deployment.address)
    resp = health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service="pdserve.v1.Router"), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    out = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")])))
    assert "pdserve.v1.Router" in [s.name for s in out.list_services_response.service]
    ch.close()


def test_the_async_client_generates_and_reads_stats(deployment):
    async def go():
        c = AsyncClient(deployment.address, timeout=60)
        r = await c.generate("async", max_tokens=5, ignore_eos=True)
        s = await c.stats()
        await c.close()
        return r, s
    r, s = asyncio.run(go())
    assert len(r.token_ids) == 5 and r.finish_reason == "length" and len(s) == 3


@pytest.mark.parametrize("kw,code,words", [
    ({"prompt": ""}, "INVALID_ARGUMENT", "prompt is empty"),
    ({"prompt": "a" * 9000}, "INVALID_ARGUMENT", "exceeds this deployment's bound"),
    ({"max_tokens": 0}, "INVALID_ARGUMENT", "max_tokens must be at least 1"),
    ({"max_tokens": 10_000_000}, "INVALID_ARGUMENT", "lower max_tokens to at most"),
    ({"temperature": -0.5}, "INVALID_ARGUMENT", "temperature"),
    ({"top_p": 1.5}, "INVALID_ARGUMENT", "top_p"),
    ({"prompt": [1, 2, 99999]}, "INVALID_ARGUMENT", "outside the vocabulary"),
    ({"route": "sideways"}, "INVALID_ARGUMENT", "route 'sideways' is unknown"),
])
def test_bad_client_input_is_refused_with_what_to_change(client, kw, code, words):
    prompt = kw.pop("prompt", "hello")
    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompt, **kw)
    assert e.value.code().name == code and words in e.value.details()


def test_abort_of_an_unknown_request_is_not_found(client):
    with pytest.raises(grpc.RpcError) as e:
        client.abort("never-sent")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "never-sent" in e.value.details()


def test_cli_generate_and_stats_talk_to_a_running_deployment(deployment, capsys):
    from pdserve.cli.main import main

    assert main(["generate", "--address", deployment.address, "--max-tokens", "4",
                 "hello"]) == 0
    assert main(["stats", "--address", deployment.address]) == 0
    out = capsys.readouterr().out
    assert "pdserve:decode-0" in out and "pdserve:prefill-0" in out
    lines = out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("engine "))
    head, *rows = [ln.split() for ln in lines[at:at + 4]]
    assert head[-2:] == ["transfers", "finished"]
    by_name = {r[0]: dict(zip(head[1:], r[1:])) for r in rows}
    # P's work shows as transfers (its requests end at D's ack, not as finished)
    assert int(by_name["pdserve:prefill-0"]["transfers"]) >= 1


def test_cli_generate_sends_the_penalties(deployment, client, capsys):
    from pdserve.cli.main import main

    flags = ["--frequency-penalty", "1.5", "--presence-penalty", "0.5", "--repetition-penalty",
             "1.25", "--min-p", "0.5", "--temperature", "1", "--seed", "3"]
    assert main(["generate", "--address", deployment.address, "--max-tokens", "8", *flags,
                 "hello"]) == 0
    want = client.generate("hello", max_tokens=8, frequency_penalty=1.5, presence_penalty=0.5,
                           repetition_penalty=1.25, min_p=0.5, temperature=1.0, seed=3).text
    plain = client.generate("hello", max_tokens=8, temperature=1.0, seed=3).text
    assert capsys.readouterr().out == want + "\n" and want != plain
    assert main(["generate", "--address", deployment.address, "--repetition-penalty", "20",
                 "hello"]) == 1
    assert "repetition_penalty=20.0 is invalid" in capsys.readouterr().err


def test_cpu_engines_keep_freed_memory_in_the_heap(deployment):
    import os

    import ray

    from pdserve.cluster.actors import CPU_MALLOC_ENV

    want = {k: os.environ.get(k, v) for k, v in CPU_MALLOC_ENV.items()}
    for _, _, actor in deployment.engines:
        got = ray.get(actor.__ray_call__.remote(
            lambda self: {k: os.environ.get(k) for k in CPU_MALLOC_ENV}))
        assert got == want


def test_engines_time_their_rounds_as_calibrate_does(deployment, client):
    """Each engine keeps its rounds' features and times (what bench
    sim-accuracy holds a cost profile against); taking them empties them.
    Only rounds that ran a forward are kept: P ships a finished prompt in a
    round of its own, which the simulator charges nothing."""
    import ray

    actors = {name: a for name, _, a in deployment.engines}
    for a in actors.values():
        ray.get(a.take_rounds.remote())                  # what earlier tests left
    client.generate(PROMPTS[1], max_tokens=5, route="fused")
    client.generate(PROMPTS[1], max_tokens=5, route="disaggregated")
    rounds = {n: ray.get(a.take_rounds.remote()) for n, a in actors.items()}
    for name, rs in rounds.items():
        assert rs and all(r.seconds > 0 and r.computed for r in rs), name
    assert [r.kind for r in rounds["prefill-0"]] == ["prefill"]     # one prompt, one round
    prompt = sum(n for r in rounds["fused-0"] for _, n in r.prefills)
    assert prompt >= 9 and sum(r.num_decodes for r in rounds["fused-0"]) == 4
    assert not any(r.num_decodes for r in rounds["prefill-0"])   # P never decodes
    assert sum(r.num_decodes for r in rounds["decode-0"]) == 4
    assert all(ray.get(a.take_rounds.remote()) == [] for a in actors.values())


# ---- GenerateMany: many requests over one stream -------------------------------------

def many_call(address: str):
    """A raw GenerateMany call fed from a queue (None closes our side)."""
    import queue

    from pdserve.proto import router_pb2_grpc as pbg

    sends: queue.Queue = queue.Queue()
    ch = grpc.insecure_channel(address)
    call = pbg.RouterStub(ch).GenerateMany(iter(sends.get, None))
    return ch, sends, call


def tagged(tag: int, prompt: str, max_tokens: int, route: str = "fused", **kw):
    from pdserve.proto import router_pb2 as pb

    return pb.GenerateCall(tag=tag, request=pb.GenerateRequest(
        text=prompt, route=route, sampling=pb.SamplingOptions(max_tokens=max_tokens, **kw)))


def test_multiplexed_requests_answer_as_their_own_streams_do(client, deployment):
    """Over one GenerateMany stream, concurrent requests on both routes get
    the tokens a Generate stream each gets; a bad one fails alone, with the
    status and words Generate gives it."""
    from pdserve.client import RequestFailed

    want = {(p, r): client.generate(p, max_tokens=12, route=r, ignore_eos=True)
            for p in PROMPTS for r in ("fused", "disaggregated")}

    async def go():
        c = AsyncClient(deployment.address, timeout=60, multiplex=True)
        got = await asyncio.gather(
            *(c.generate(p, max_tokens=12, route=r, ignore_eos=True) for p, r in want),
            c.generate("hello", max_tokens=0), return_exceptions=True)
        await c.close()
        return got
    *got, bad = asyncio.run(go())
    for (key, w), g in zip(want.items(), got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, "length"), key
        assert g.engine == w.engine
    assert isinstance(bad, RequestFailed) and isinstance(bad, grpc.RpcError)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens must be at least 1" in bad.details()


def test_one_message_carries_a_rounds_tokens_of_every_request(deployment):
    """The router writes what piled up since its last write: requests
    decoded in the same rounds share messages. The call ends once our side
    is closed and every request has finished."""
    ch, sends, call = many_call(deployment.address)
    for tag in range(1, 9):
        sends.put(tagged(tag, PROMPTS[tag % len(PROMPTS)], 16, ignore_eos=True))
    sends.put(None)
    batches = list(call)
    ch.close()
    responses = [r for b in batches for r in b.responses]
    by_tag: dict[int, list] = {}
    for r in responses:
        assert not r.error_code, r.error
        by_tag.setdefault(r.tag, []).extend(r.response.token_ids)
    assert {t: len(ids) for t, ids in by_tag.items()} == {t: 16 for t in range(1, 9)}
    assert sum(1 for r in responses if r.response.finish_reason) == 8
    assert max(len(b.responses) for b in batches) > 1
    assert len(batches) < len(responses)


def test_a_cancelled_tag_is_aborted_and_a_reused_live_tag_refused(client, deployment):
    before = counters(client)["pdserve:fused-0"]
    ch, sends, call = many_call(deployment.address)
    from pdserve.proto import router_pb2 as pb

    sends.put(tagged(1, "long", LONG, ignore_eos=True))
    first = next(call).responses[0]
    assert first.tag == 1 and not first.error_code
    sends.put(tagged(1, "again", 4))
    refused = next(r for b in call for r in b.responses if r.error_code)
    assert refused.tag == 1 and refused.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "tag 1 is in use" in refused.error
    sends.put(pb.GenerateCall(tag=1, cancel=True))
    sends.put(tagged(2, "after", 4, ignore_eos=True))
    sends.put(None)
    rest = [r for b in call for r in b.responses if r.tag == 2]
    ch.close()
    assert sum(len(r.response.token_ids) for r in rest) == 4
    assert rest[-1].response.finish_reason == "length"
    wait_idle(client, ABORT_BOUND_S)
    after = counters(client)["pdserve:fused-0"]
    assert after["aborted"] == before["aborted"] + 1


def test_a_client_that_leaves_a_multiplexed_stream_aborts_all_of_it(client, deployment):
    before = counters(client)
    ch, sends, call = many_call(deployment.address)
    sends.put(tagged(1, "one", LONG, ignore_eos=True))
    sends.put(tagged(2, "two", LONG, ignore_eos=True))
    seen = set()
    for batch in call:
        seen |= {r.tag for r in batch.responses}
        if seen == {1, 2}:
            break
    call.cancel()
    ch.close()
    wait_idle(client, ABORT_BOUND_S)
    after = counters(client)
    assert sum(s["aborted"] for s in after.values()) == \
        sum(s["aborted"] for s in before.values()) + 2
    assert sum(s["finished"] for s in after.values()) == \
        sum(s["finished"] for s in before.values())


def test_the_async_clients_timeout_ends_a_multiplexed_request(client, deployment):
    from pdserve.client import RequestFailed

    async def go():
        c = AsyncClient(deployment.address, timeout=0.5, multiplex=True)
        try:
            with pytest.raises(RequestFailed) as e:
                await c.generate("slow", max_tokens=LONG, ignore_eos=True)
            return e.value
        finally:
            await c.close()
    err = asyncio.run(go())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "0.5 s" in err.details()
    wait_idle(client, ABORT_BOUND_S)


def test_the_resolver_reports_an_engine_gone_only_on_rays_word(deployment):
    """`engine_address` (the router's resolver): a live actor's address; an
    actor Ray reports dead (killed, no restart left) or that it no longer
    knows is EngineGone, which tells the D peers at once (membership)."""
    import ray

    from pdserve.cluster.actors import engine_address
    from pdserve.router.engines.membership import EngineGone

    @ray.remote(num_cpus=0)
    class Stand:
        def info(self):
            return {"address": "stand:1"}

    stand = Stand.remote()
    assert engine_address("prefill-9", lambda: stand) == "stand:1"
    ray.kill(stand, no_restart=True)
    # the kill is asynchronous: until the GCS's table says DEAD, a call may
    # still answer (sent before the kill took) or fail as the actor's
    deadline = time.monotonic() + 30
    while True:
        try:
            engine_address("prefill-9", lambda: stand)
        except EngineGone as gone:
            assert "prefill-9's actor DEAD" in str(gone)
            break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "Ray never reported the killed actor DEAD"
        time.sleep(0.05)

    def nobody():
        raise ValueError("Failed to look up actor with name 'pdserve:prefill-9'")

    with pytest.raises(EngineGone, match="no actor for prefill-9"):
        engine_address("prefill-9", nobody)
    name = deployment.engines[0][0]
    assert engine_address(name, lambda: deployment.actor(name)) == deployment.infos[0]["address"]
