"""The OpenAI-compatible HTTP API, through the official `openai` client,
against one live local deployment (shared by the module) of the real
SmolLM2-135M-Instruct: a fused engine and a P+D pair behind one router,
reached by the `route` extension, with an API key."""

import asyncio
import json
import threading
import time

import grpc
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.client import AsyncClient, Client, RequestFailed
from pdserve.router.router import Security

from support.deployed import deployed

KEY = "sk-test-key"
ENGINE = {"page_size": 16, "total_pages": 256, "max_scheduled_tokens": 256,
          "max_batch_size": 32}
ROUTES = ("fused", "disaggregated")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def dep():
    cfg = {"model": {"preset": "smollm2-135m"}, "engine": ENGINE,
           "cluster": {"prefill": 1, "decode": 1, "fused": 1}}
    with deployed(cfg, security=Security(api_key=KEY),
                  engine_options={"transfer_timeout_s": 30.0}, http_port=0) as d:
        yield d


@pytest.fixture(scope="module")
def oai(dep):
    return openai.OpenAI(base_url=dep.http_address + "/v1", api_key=KEY, timeout=120,
                         max_retries=0)


@pytest.fixture(scope="module")
def grpc_client(dep):
    c = Client(dep.address, timeout=120, api_key=KEY)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def wait_idle(c: Client, seconds: float = 15.0) -> list[dict]:
    deadline = time.monotonic() + seconds
    while True:
        stats = c.stats()
        if not any(s["used_pages"] or s["running"] or s["waiting"] for s in stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engines not idle after {seconds} s: {stats}")
        time.sleep(0.05)


def test_models_lists_the_served_model(oai):
    assert [m.id for m in oai.models.list().data] == ["smollm2-135m"]


@pytest.mark.parametrize("route", ROUTES)
def test_chat_answers_a_real_question_with_usage(oai, model, route, grpc_client):
    r = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=24,
                                    temperature=0, extra_body={"route": route})
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_both_routes_give_the_same_greedy_answer_streamed_or_not(oai, model):
    answers = []
    for route in ROUTES:
        whole = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=16,
                                            temperature=0, extra_body={"route": route})
        chunks = list(oai.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"route": route}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
            whole.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
            whole.choices[0].finish_reason
        answers.append(whole.choices[0].message.content)
    assert answers[0] == answers[1]


@pytest.mark.parametrize("route", ROUTES)
def test_completions_take_a_string_a_list_and_token_ids(oai, model, route):
    one = oai.completions.create(model=model, prompt="The capital of France is",
                                 max_tokens=8, temperature=0, extra_body={"route": route})
    assert one.object == "text_completion" and one.choices[0].text
    many = oai.completions.create(model=model, prompt=["The capital of France is", "1, 2, 3,"],
                                  max_tokens=8, temperature=0, extra_body={"route": route})
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == one.choices[0].text
    ids = oai.completions.create(model=model, prompt=[504, 3575, 282, 4649, 314], max_tokens=4,
                                 temperature=0, extra_body={"route": route})
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 4


def test_a_stop_string_ends_the_text_before_it_streamed_and_not(oai, model):
    free = oai.completions.create(model=model, prompt="Count: 1, 2, 3, 4,", max_tokens=16,
                                  temperature=0).choices[0].text
    stop = free.strip().split()[2]              # a word a few tokens in
    want = free[:free.index(stop)]
    r = oai.completions.create(model=model, prompt="Count: 1, 2, 3, 4,", max_tokens=16,
                               temperature=0, stop=[stop, "never appears"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(oai.completions.create(model=model, prompt="Count: 1, 2, 3, 4,",
                                         max_tokens=16, temperature=0, stop=stop, stream=True,
                                         extra_body={"route": "disaggregated"}))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_seed_reproduces_a_sampled_answer_and_n_gives_distinct_choices(oai, model):
    def ask(seed, n=1):
        return oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=12,
                                           temperature=1.0, seed=seed, n=n)
    a, b, c = ask(7), ask(7), ask(8)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content
    two = ask(7, n=2)
    assert [ch.index for ch in two.choices] == [0, 1]
    assert two.choices[0].message.content == a.choices[0].message.content   # choice i: seed+i
    assert two.choices[1].message.content == c.choices[0].message.content
    assert two.usage.completion_tokens == a.usage.completion_tokens + c.usage.completion_tokens


@pytest.mark.parametrize("route", ROUTES)
def test_logprobs_give_the_chosen_token_and_the_top_ones(oai, model, route):
    r = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0,
                                    logprobs=True, top_logprobs=3, extra_body={"route": route})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= \
            e.top_logprobs[2].logprob
        assert e.logprob <= 0
    assert "".join(e.token for e in content) == r.choices[0].message.content
    c = oai.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                               temperature=0, logprobs=2, extra_body={"route": route})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == c.choices[0].text
    # the sampled token is always in its top_logprobs (OpenAI: up to logprobs + 1 entries)
    c = oai.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                               temperature=1.0, seed=3, logprobs=0, extra_body={"route": route})
    lp = c.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert [top[t] for t, top in zip(lp.tokens, lp.top_logprobs)] == lp.token_logprobs


def test_usage_counts_each_prompt_once_whatever_n(oai, model):
    one = oai.completions.create(model=model, prompt=["Hello there", "The sky is"],
                                 max_tokens=2, temperature=0)
    three = oai.completions.create(model=model, prompt=["Hello there", "The sky is"],
                                   max_tokens=2, temperature=0, n=3)
    assert len(three.choices) == 6
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    chat = [oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, n=n)
            for n in (1, 2)]
    assert chat[1].usage.prompt_tokens == chat[0].usage.prompt_tokens


def test_continue_final_message_carries_the_assistant_message_on(oai, model):
    """vLLM's extension: the template's text stops after the last (assistant)
    message, so the model continues it rather than closing the turn."""
    started = "The capital of France is"
    r = oai.chat.completions.create(
        model=model, max_tokens=8, temperature=0,
        messages=[*QUESTION, {"role": "assistant", "content": started}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = r.choices[0].message.content
    assert "Paris" in text and not text.lstrip().startswith(started), text
    closed = oai.chat.completions.create(
        model=model, max_tokens=8, temperature=0,
        messages=[*QUESTION, {"role": "assistant", "content": started}],
        extra_body={"add_generation_prompt": False})
    assert closed.usage.prompt_tokens > r.usage.prompt_tokens     # the turn's end is left out


def test_ignore_eos_and_min_tokens_hold_the_answer_open(oai, model):
    short = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=64,
                                        temperature=0)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    longer = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=n + 6,
                                         temperature=0, extra_body={"min_tokens": n + 3})
    assert longer.usage.completion_tokens >= n + 3
    full = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=n + 4,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == n + 4 and full.choices[0].finish_reason == "length"


def test_bad_input_is_a_400_naming_the_field(oai, model, dep):
    with pytest.raises(openai.NotFoundError) as e:       # as OpenAI answers another model
        oai.chat.completions.create(model="gpt-9", messages=QUESTION, max_tokens=4)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    cases = [({"temperature": -1}, "temperature"),
             ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"top_p": 1.5}, "top_p"),
             ({"presence_penalty": 2.5}, "presence_penalty"),
             ({"logit_bias": {"1": 1, "100000": 1}}, "logit_bias"),
             ({"max_tokens": 10 ** 6}, "max_tokens")]
    for extra, param in cases:
        body = {"model": model, "messages": QUESTION, "max_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(**body)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (extra, e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="x " * 9000, max_tokens=4)
    assert "exceeds this deployment's bound" in e.value.message and \
        e.value.body["param"] == "prompt"
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(dep.http_address + "/v1/chat/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(dep.http_address + "/v1/completions", headers=h,
                   content=b"[" + b"1," * (5 << 20) + b"1]")
    assert r.status_code == 413


def test_the_api_key_is_required_on_both_fronts_but_not_for_health(dep, model):
    wrong = openai.OpenAI(base_url=dep.http_address + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.post(dep.http_address + "/v1/completions",
                      json={"prompt": "x"}).status_code == 401
    assert httpx.get(dep.http_address + "/health").status_code == 200
    assert httpx.get(dep.http_address + "/metrics").status_code == 200
    with pytest.raises(grpc.RpcError) as e:
        Client(dep.address, timeout=30).generate("Hello", max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async def many(key):                          # the multiplexed stream is guarded too
        c = AsyncClient(dep.address, timeout=60, api_key=key, multiplex=True)
        try:
            return await c.generate("Hello", max_tokens=2)
        finally:
            await c.close()
    with pytest.raises(RequestFailed) as e:
        asyncio.run(many(None))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
    assert len(asyncio.run(many(KEY)).token_ids) == 2


def test_a_client_that_disconnects_mid_stream_aborts_the_request(dep, model, grpc_client):
    before = {s["name"]: s["aborted"] for s in grpc_client.stats()}
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": model, "messages": QUESTION, "max_tokens": 4000, "stream": True,
            "route": "disaggregated", "ignore_eos": True}
    with httpx.stream("POST", dep.http_address + "/v1/chat/completions", json=body, headers=h,
                      timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]        # a few tokens, then hang up
    assert any(json.loads(x[6:])["choices"][0]["delta"].get("content") for x in got
               if x.startswith("data: {"))
    # 4,000 tokens take minutes here: idle within 15 s means the engines aborted it
    after = wait_idle(grpc_client)
    assert after[[s["name"] for s in after].index("pdserve:decode-0")]["aborted"] == \
        before["pdserve:decode-0"] + 1


def test_metrics_name_what_happened(oai, model, dep):
    oai.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0,
                           extra_body={"route": "disaggregated"})
    text = httpx.get(dep.http_address + "/metrics").text
    for series in ('pdserve:num_requests_running{engine="decode-0",role="decode"}',
                   'pdserve:kv_pages_total{engine="fused-0",role="fused"} 256.0',
                   'pdserve:time_to_first_token_seconds_count{engine="decode-0"}',
                   'pdserve:generation_tokens_total{engine="decode-0"}',
                   'pdserve:request_success_total{engine="decode-0",finished_reason="length"}',
                   'pdserve:kv_transfer_seconds_count{engine="prefill-0",role="prefill"}',
                   'pdserve:prefix_cache_queries_total{engine="prefill-0",role="prefill"}',
                   'pdserve:engine_rounds_total{engine="decode-0",role="decode"}',
                   'pdserve:engine_round_cpu_seconds_total{engine="prefill-0",role="prefill"}'):
        assert series in text, series
    transfers = [ln for ln in text.splitlines()
                 if ln.startswith('pdserve:kv_transfers_total{engine="prefill-0"')]
    assert float(transfers[0].split()[-1]) >= 1


def test_grpc_returns_logprobs_and_min_tokens_too(grpc_client):
    r = grpc_client.generate("The capital of France is", max_tokens=5, logprobs=2,
                             route="disaggregated")
    assert len(r.logprobs) == len(r.token_ids) == 5
    assert all(len(top) == 2 and tok == top[0][0] for tok, _, top in r.logprobs)


def test_tokenize_counts_the_prompt_chat_bills_and_detokenize_reads_it_back(dep, oai, model):
    h = {"Authorization": f"Bearer {KEY}"}
    t = httpx.post(dep.http_address + "/tokenize", headers=h,
                   json={"model": model, "messages": QUESTION}).json()
    r = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=1,
                                    temperature=0)
    assert t["count"] == len(t["tokens"]) == r.usage.prompt_tokens
    back = httpx.post(dep.http_address + "/detokenize", headers=h,
                      json={"tokens": t["tokens"]}).json()["prompt"]
    assert QUESTION[0]["content"] in back
    assert oai.models.retrieve(model).id == model
    assert httpx.post(dep.http_address + "/tokenize", json={"prompt": "x"}).status_code == 401


@pytest.mark.parametrize("route", ROUTES)
def test_the_stop_string_and_special_tokens_can_be_kept_in_the_text(oai, model, route,
                                                                    grpc_client):
    r = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=24,
                                    temperature=0, stop=["Paris"],
                                    extra_body={"route": route,
                                                "include_stop_str_in_output": True})
    text = r.choices[0].message.content
    assert text.endswith("Paris") and text.count("Paris") == 1, text
    assert r.choices[0].finish_reason == "stop"
    forced = {"max_tokens": 3, "temperature": 0, "logit_bias": {"1": 100}}   # <|im_start|>
    shown = oai.completions.create(model=model, prompt="Hi", **forced,
                                   extra_body={"route": route, "skip_special_tokens": False})
    hidden = oai.completions.create(model=model, prompt="Hi", **forced,
                                    extra_body={"route": route})
    assert shown.choices[0].text == "<|im_start|>" * 3 and hidden.choices[0].text == ""
    g = grpc_client.generate("Hi", max_tokens=3, temperature=0, logit_bias={1: 100.0},
                             skip_special_tokens=False, route=route)
    assert g.text == "<|im_start|>" * 3


def test_echo_puts_each_prompt_before_its_completion_streamed_or_not(oai, model):
    prompts = ["The sky is", "Two plus two is"]
    plain = oai.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0)
    tails = [c.text for c in sorted(plain.choices, key=lambda c: c.index)]
    echoed = oai.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0,
                                    echo=True, n=2)
    assert [c.text for c in sorted(echoed.choices, key=lambda c: c.index)] == \
        [p + t for p, t in zip(prompts, tails) for _ in range(2)]
    assert echoed.usage.completion_tokens == 2 * plain.usage.completion_tokens
    chunks = oai.completions.create(model=model, prompt=prompts[0], max_tokens=4,
                                    temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompts[0] + tails[0]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="x", max_tokens=2, echo=True, logprobs=1)
    assert e.value.body["param"] == "echo" and "prompt's logprobs" in e.value.message


@pytest.fixture(scope="module")
def offline():
    from pdserve import LLM
    return LLM({"model": {"preset": "smollm2-135m"}}, **ENGINE)


def test_penalties_and_a_logit_bias_give_the_offline_engine_s_tokens(grpc_client, offline):
    """On P/D the first token is P's: it takes the penalties too."""
    from pdserve import SamplingParams

    ids = offline.tokenizer.encode("Write a list of the colors of the rainbow, one per line:")
    plain = offline.generate(ids, SamplingParams(temperature=0, max_tokens=20),
                             use_tqdm=False)[0].token_ids
    kw = {"max_tokens": 20, "frequency_penalty": 0.5, "presence_penalty": 0.25,
          "repetition_penalty": 1.25, "logit_bias": {plain[0]: -100.0, 28: 3.5}}
    want = offline.generate(ids, SamplingParams(temperature=0, **kw),
                            use_tqdm=False)[0].token_ids
    assert want[0] != plain[0]                  # the first token is P's on P/D
    for route in ROUTES:
        assert grpc_client.generate(ids, route=route, **kw).token_ids == want, route


@pytest.mark.parametrize("route", ROUTES)
def test_min_tokens_holds_off_a_biased_eos_on_every_engine_that_samples(oai, model, offline,
                                                                      route, grpc_client):
    """EOS biased to certainty: the answer is exactly min_tokens long, over
    HTTP and gRPC, and on P/D P's first token does not end it."""
    bias = {str(t): 100 for t in offline.executor.eos}
    r = oai.completions.create(model=model, prompt="Once upon a time", max_tokens=8,
                               temperature=0, logit_bias=bias,
                               extra_body={"min_tokens": 3, "route": route})
    # three tokens, then the EOS, which usage counts (as vLLM's does)
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"
    g = grpc_client.generate("Once upon a time", max_tokens=8, min_tokens=3, route=route,
                             logit_bias={int(t): 100.0 for t in bias})
    assert len(g.token_ids) == 4 and g.token_ids[3] in offline.executor.eos
    assert not set(g.token_ids[:3]) & offline.executor.eos and g.finish_reason == "stop"


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) |
                    st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) |
                    st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n",
          "stop", "seed", "logprobs", "top_logprobs", "stream", "stream_options", "min_tokens",
          "ignore_eos", "route", "max_completion_tokens", "echo", "logit_bias"]


def short(body: dict) -> dict:
    """A fuzzed body that is well formed may run: cap what it generates."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)
    for key in ("max_tokens", "max_completion_tokens", "n"):
        if is_int(body.get(key)) and body[key] > 2:
            body[key] = 2
    if not is_int(body.get("max_completion_tokens")) and body.get("max_tokens") is None:
        body["max_tokens"] = 2          # unset or null: until the context limit
    return body


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       junk=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4),
       raw=st.one_of(st.none(), st.binary(max_size=40)))
def test_fuzzed_bodies_never_get_a_500_and_the_server_stays_up(dep, model, path, junk, raw):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = short({"model": model, "prompt": "Hi", "messages": QUESTION, **junk})
    content = raw if raw is not None else json.dumps(body).encode()
    r = httpx.post(dep.http_address + path, content=content, headers=h, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"]


EIGHT_QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
                   "How many legs does a spider have?", "Write a haiku about rain.",
                   "What is 12 times 12?", "Who wrote Hamlet?",
                   "Give me a synonym for happy.", "Why is the sky blue?"]


@pytest.mark.invariance
def test_eight_chat_prompts_get_the_same_greedy_text_one_at_a_time_and_all_at_once(oai, model):
    """A request's tokens do not depend on what shares its rounds: on the
    fused engine, eight different chat prompts answered one after another
    and then all at once (their prompts' rows and decodes in shared rounds)
    give the same greedy text, and the same bits in every token's logprob,
    every row's product in pdserve's order."""
    def ask(question: str) -> tuple:
        choice = oai.chat.completions.create(
            model=model, max_tokens=24, temperature=0, logprobs=True,
            extra_body={"route": "fused"},
            messages=[{"role": "user", "content": question}]).choices[0]
        return choice.message.content, [t.logprob for t in choice.logprobs.content]
    alone = [ask(q) for q in EIGHT_QUESTIONS]
    together: list = [None] * len(EIGHT_QUESTIONS)

    def run(i: int) -> None:
        together[i] = ask(EIGHT_QUESTIONS[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(EIGHT_QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    texts = [text for text, _ in alone]
    assert len(set(texts)) == len(texts) and "Paris" in texts[0]


def test_the_deployment_is_idle_after_everything(grpc_client):
    wait_idle(grpc_client)


def test_many_concurrent_streams_finish_in_order(oai, model):
    outs = [None] * 6

    def ask(i):
        chunks = oai.completions.create(model=model, prompt=f"{i} apples and", max_tokens=8,
                                        temperature=0, stream=True,
                                        extra_body={"route": ROUTES[i % 2]})
        outs[i] = "".join(c.choices[0].text for c in chunks)
    ts = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for i in range(6):
        want = oai.completions.create(model=model, prompt=f"{i} apples and", max_tokens=8,
                                      temperature=0).choices[0].text
        assert outs[i] == want


def test_tls_serves_both_fronts_with_the_key(dep, tmp_path):
    """A second router over the same engines, with TLS and the key: the gRPC
    client and an HTTPS client both get answers, a plaintext one does not."""
    import shutil
    import ssl
    import subprocess

    from pdserve.router.router import Router
    from pdserve.router.serve import serve

    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    old = dep.router
    r = Router(old.cfg, old.tokenizer, old.vocab_size,
               [(e.name, e.role, e.address) for e in old.engines.values()], old.resolver,
               Security(KEY, str(cert), str(key), old.security.control_tls))
    serve(r, "localhost", 0, http_port=0)
    try:
        c = Client(r.address, timeout=60, api_key=KEY, tls_ca=str(cert))
        assert c.generate("The capital of France is", max_tokens=3).token_ids
        oai = openai.OpenAI(base_url=r.http_address + "/v1", api_key=KEY, max_retries=0,
                            http_client=openai.DefaultHttpxClient(
                                verify=ssl.create_default_context(cafile=str(cert))))
        assert oai.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2).usage
        with pytest.raises(httpx.HTTPError):
            httpx.get(r.http_address.replace("https", "http") + "/health", timeout=5)
    finally:
        r.stop()


@settings(max_examples=200, deadline=None)
@given(text=st.text(), index=st.integers(0, 99), chat=st.booleans(), usage=st.booleans())
def test_spliced_text_events_equal_the_dumped_chunk(text, index, chat, usage):
    """The per-token event spliced around the escaped text is the same JSON
    as the whole chunk object dumped, for any text (quotes, control
    characters, surrogates' neighbours, non-ASCII)."""
    from pdserve.router.openai_answers import SseEvents

    ev = SseEvents({"id": "cmpl-1", "object": "o", "created": 7, "model": 'm"x'}, chat, usage)
    if chat:
        choice = {"index": index, "delta": {"content": text} if text else {},
                  "logprobs": None, "finish_reason": None}
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
    spliced, dumped = ev.text(index, text), ev.choice(choice)
    assert spliced.startswith(b"data: ") and spliced.endswith(b"\n\n")
    assert json.loads(spliced[6:]) == json.loads(dumped[6:])


def test_the_command_line_clients_send_the_api_key(dep, capsys, monkeypatch):
    from pdserve.cli.main import main

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert main(["stats", "--address", dep.address]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["stats", "--address", dep.address, "--api-key", KEY]) == 0
    assert "decode-0" in capsys.readouterr().out
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    assert main(["generate", "--address", dep.address, "--max-tokens", "3", "Hello"]) == 0
    assert capsys.readouterr().out.strip()
    # both loads of bench serve; an HTTP address given without its scheme
    bare = dep.http_address.removeprefix("http://")
    assert main(["bench", "serve", "--address", dep.address, "--http-address", bare,
                 "--api", "grpc", "http", "--requests", "2", "--concurrency", "1",
                 "--prompt-len", "4", "--max-tokens", "2"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if "[grpc]" in ln or "[http]" in ln]
    assert len(rows) == 2 and all(ln.split()[2] == "2" for ln in rows), rows     # 2 ok each


# ---- structured outputs and tool calls (issue 55) ---------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"query": {"type": "string", "maxLength": 30},
                                  "top_k": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["query", "top_k"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]


@pytest.mark.parametrize("route", ROUTES)
def test_the_openai_parse_helper_gets_a_valid_pydantic_object(oai, model, route):
    import pydantic

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)
        population_millions: int = pydantic.Field(ge=0, le=50)
        capital: bool

    r = oai.beta.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=120, temperature=0, extra_body={"route": route})
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop", r
    assert city == City.model_validate_json(r.choices[0].message.content)


def test_max_tokens_one_through_p_and_d_is_the_grammars_first_token(oai, model):
    """P samples the only token under the grammar; D takes it as its
    matcher's first and ends the request at its limit."""
    for route in ROUTES:
        r = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=1,
                                        temperature=0, response_format={"type": "json_object"},
                                        extra_body={"route": route})
        assert r.choices[0].message.content == "{" and r.choices[0].finish_reason == "length"


def test_a_named_tool_call_streams_arguments_that_parse_to_its_parameters(oai, model):
    import jsonschema

    chunks = list(oai.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, SEARCH], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id and deltas[0].index == 0
    args = json.loads("".join(d.function.arguments or "" for d in deltas))
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    whole = oai.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, SEARCH], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = whole.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == args and call.function.name == "get_weather"
    assert whole.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_gives_calls_of_the_offered_tools(oai, model, stream):
    import jsonschema

    kw = dict(model=model, messages=ASK, tools=[WEATHER, SEARCH], tool_choice="required",
              max_tokens=150, temperature=0)
    if stream:
        chunks = list(oai.chat.completions.create(stream=True, **kw))
        by_index: dict = {}
        for c in chunks:
            for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                entry = by_index.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
        calls = [by_index[i] for i in sorted(by_index)]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = oai.chat.completions.create(**kw)
        calls = [{"name": t.function.name, "arguments": t.function.arguments}
                 for t in r.choices[0].message.tool_calls]
        finish = r.choices[0].finish_reason
    assert calls and finish == "tool_calls"
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), tools[c["name"]])


def test_a_tool_conversation_renders_calls_and_results_and_auto_may_answer(oai, model):
    """role: tool with its tool_call_id, after the assistant's call, renders
    in a template that knows no tools (SmolLM2's) and the answer comes back."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = oai.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                    max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    none = oai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER],
                                       tool_choice="none", max_tokens=8, temperature=0)
    plain = oai.chat.completions.create(model=model, messages=ASK, max_tokens=8,
                                        temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_structured_outputs_and_bad_schemas_over_http_and_grpc(oai, model, grpc_client):
    r = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                    temperature=0, extra_body={"structured_outputs": {
                                        "choice": ["Paris", "London", "Rome"]}})
    assert r.choices[0].message.content in ("Paris", "London", "Rome")
    r = oai.completions.create(model=model, prompt="Phone: ", max_tokens=20, temperature=0,
                               extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert len(r.choices[0].text) == 8 and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "x", "schema": {"type": "array",
                                                                "uniqueItems": True}}})
    from pdserve.text.constraint import Constraint

    out = grpc_client.generate("Is Paris in France? Answer:", max_tokens=8,
                               structured=Constraint.choice(["yes", "no"]))
    assert out.text in ("yes", "no")
    with pytest.raises(grpc.RpcError) as e:
        grpc_client.generate("x", max_tokens=8, structured=Constraint.json_schema('{"type": 3}'))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.structured: invalid JSON schema" in e.value.details()
