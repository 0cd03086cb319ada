"""The OpenAI HTTP front's refusals before any engine is asked (a router
with no live link): each one names the field and what to change."""

from pdserve.config import ServeConfig
from pdserve.router.router import Router
from pdserve.text.tokenizer import PrintableTokenizer


def test_the_http_front_refuses_what_it_cannot_do_by_name_before_any_engine_is_asked():
    """Each body is refused with a 400 (or a 404 for another model) whose
    param and message say what to change; none reaches an engine (this
    router has no live link), and a request that could never run is not
    counted as an arrival."""
    from starlette.testclient import TestClient

    from pdserve.router.http_api import build_app

    cfg = ServeConfig.from_dict({"cluster": {"fused": 1}, "router": {"max_requests": 8},
                                 "engine": {"total_pages": 64, "page_size": 4,
                                            "max_context_tokens": 64}})
    r = Router(cfg, PrintableTokenizer(), 98, [("fused-0", "fused", "127.0.0.1:9")])
    http = TestClient(build_app(r))
    cases = [
        ({"prompt": ["ab", "cd", "ef"], "n": 3}, 400, "n", "9 choices (prompts x n) exceed"),
        ({"prompt": "ab", "route": "disaggregated"}, 400, "route", "needs decode and prefill"),
        ({"prompt": "ab", "model": "gpt-9"}, 404, "model", "is not served here"),
        ({"prompt": ["ab", 1]}, 400, "prompt", "one kind, not mixed"),
        ({"prompt": ["ab", ""]}, 400, "prompt[1]", "the prompt is empty"),
        ({"prompt": "ab", "stop": ["x"] * 17}, 400, "stop", "at most 16 stop strings, got 17"),
        ({"prompt": "ab", "stream_options": {"include_usage": True}}, 400, None,
         "stream_options is only for streamed answers"),
        ({"prompt": "ab", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens",
         "min_tokens=5 exceeds the 2 tokens this request may generate"),
        ({"prompt": "ab", "min_tokens": 17}, 400, "min_tokens",    # completions' default: 16
         "min_tokens=17 exceeds the 16 tokens"),
        ({"prompt": "ab", "min_p": 1.5}, 400, "min_p", "less than or equal to 1"),
        ({"prompt": "ab", "repetition_penalty": 0}, 400, "repetition_penalty",
         "greater than or equal to 0.01"),
        ({"prompt": "ab", "logit_bias": {"²": 1}}, 400, "logit_bias", "'²' is not a token id"),
        ({"prompt": "ab", "presence_penalty": -2.5}, 400, "presence_penalty",
         "greater than or equal to -2"),
        ({"prompt": "ab", "logit_bias": {"x": 1}}, 400, "logit_bias", "'x' is not a token id"),
        ({"prompt": "ab", "logit_bias": {"5": 200}}, 400, "logit_bias",
         "give a number in [-100, 100]"),
        ({"prompt": "ab", "logit_bias": {"98": 1}}, 400, "logit_bias",
         "token id 98, outside the vocabulary [0, 98)"),
        ({"prompt": "ab", "guided_choice": ["yes", "no"]}, 400, "guided_choice",
         "send structured_outputs: {choice: ...}"),
        ({"prompt": "ab", "response_format": {"type": "xml"}}, 400, "response_format",
         "type 'xml' is not supported: use text, json_object or json_schema"),
        ({"prompt": "ab", "structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
         400, "structured_outputs", '["uniqueItems"], which pdserve\'s structured outputs do '
         "not support"),
        ({"prompt": "ab", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
         400, "response_format", "invalid JSON schema"),
        ({"prompt": "ab", "structured_outputs": {"regex": "a(b"}}, 400, "structured_outputs",
         "unclosed group"),
        ({"prompt": "ab", "structured_outputs": {"grammar": "start: nothing_here"}}, 400,
         "structured_outputs", "nothing_here"),
        ({"prompt": "ab", "structured_outputs": {"choice": []}}, 400, "structured_outputs.choice",
         "non-empty list"),
        ({"prompt": "ab", "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
         "structured_outputs", "exactly one of"),
        ({"prompt": "ab", "structured_outputs": {"structural_tag": "{}"}}, 400,
         "structured_outputs", "structured_outputs.structural_tag is not supported"),
        ({"prompt": "ab", "structured_outputs": {"regex": "a"},
          "response_format": {"type": "json_object"}}, 400, "structured_outputs",
         "not both"),
        ({"prompt": "ab", "include_stop_str_in_output": 1}, 400,
         "include_stop_str_in_output", "valid boolean"),
        ({"prompt": "ab", "temperature": True}, 400, "temperature", "valid number"),
        ({"prompt": "x" * 64, "max_tokens": 1}, 400, "prompt", "exceeds this deployment's bound"),
        ({"prompt": "ab", "max_token": 4}, 400, "max_token", "did you mean 'max_tokens'?"),
    ]
    for body, status, param, words in cases:
        resp = http.post("/v1/completions", json=body)
        err = resp.json()["error"]
        assert resp.status_code == status and err["param"] == param, (body, err)
        assert words in err["message"] and not err["message"].startswith("Value error"), \
            (body, err)
    assert r.metrics.arrivals._value.get() == 0
    assert not r.active
    chat = [({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
              "add_generation_prompt": False}, "the last message to be the assistant's"),
            ({"messages": [{"role": "assistant", "content": "hi"}],
              "continue_final_message": True}, "set add_generation_prompt: false"),
            ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]},
             "replaced by tools and tool_choice")]
    for body, words in chat:
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400 and words in resp.json()["error"]["message"], resp.json()


def test_any_64_bit_seed_is_taken_and_stays_reproducible():
    from pdserve.router.openai_protocol import CompletionRequest

    seeds = (-1, -(1 << 63), (1 << 63) - 1, (1 << 63) + 1, (1 << 64) - 2, 0, 7)
    taken = [CompletionRequest(prompt="ab", seed=s).sampling(4, None).seed for s in seeds]
    assert all(0 <= t < 1 << 64 for t in taken) and len(set(taken)) == len(seeds)
    assert taken[-1] == 7 and taken[0] == (1 << 64) - 1          # -1 as 64 bits


def test_only_near_misses_of_known_fields_are_refused_other_unknown_fields_are_ignored():
    from pdserve.router.http_api import _misspelt
    from pdserve.router.openai_protocol import ChatCompletionRequest, CompletionRequest

    fields = CompletionRequest.model_fields
    assert _misspelt({"prompt": "a", "temprature": 1}, fields) == ("temprature", "temperature")
    assert _misspelt({"prompt": "a", "stop_tokens_ids": [1]}, fields) == \
        ("stop_tokens_ids", "stop_token_ids")
    sent_by_clients = {"metadata": {}, "store": False, "parallel_tool_calls": True,
                       "service_tier": "auto", "reasoning_effort": "low", "modalities": [],
                       "prediction": None, "audio": None, "max_completion_tokens": 4,
                       "top_logprobs": 2, "priority": 0, "request_id": "x"}
    assert _misspelt(sent_by_clients, fields) is None
    assert _misspelt(sent_by_clients, ChatCompletionRequest.model_fields) is None


def test_tokenize_detokenize_version_and_one_model_answer_without_an_engine():
    """vLLM's /tokenize and /detokenize and OpenAI's GET /v1/models/{id},
    on a router with no live engine: they need only the tokenizer."""
    from starlette.testclient import TestClient

    import pdserve
    from pdserve.router.http_api import build_app

    cfg = ServeConfig.from_dict({"cluster": {"fused": 1}, "model": {"name": "toy"},
                                 "engine": {"total_pages": 64, "page_size": 4,
                                            "max_context_tokens": 64}})
    tok = PrintableTokenizer()
    http = TestClient(build_app(Router(cfg, tok, 98, [("fused-0", "fused", "127.0.0.1:9")])))
    r = http.post("/tokenize", json={"model": "toy", "prompt": "ab c"})
    assert r.json() == {"count": 4, "max_model_len": 64, "tokens": tok.encode("ab c")}
    assert http.post("/detokenize", json={"tokens": tok.encode("ab c")}).json() == \
        {"prompt": "ab c"}
    assert http.get("/version").json() == {"version": pdserve.__version__}
    card = http.get("/v1/models/toy").json()
    assert card["id"] == "toy" and card["max_model_len"] == 64
    refused = [
        (http.get("/v1/models/gpt-9"), 404, "model", "'gpt-9' is not served here"),
        (http.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user",
                                                                    "content": "a"}]}),
         400, None, "send either prompt or messages"),
        (http.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}]}),
         400, "messages", "has no chat template"),
        (http.post("/tokenize", json={"model": "gpt-9", "prompt": "a"}), 404, "model",
         "is not served here"),
        (http.post("/detokenize", json={"tokens": [1, 98]}), 400, "tokens",
         "token id 98 is outside the vocabulary [0, 98)"),
        (http.post("/detokenize", json={"tokens": ["a"]}), 400, "tokens.0",
         "valid integer"),
    ]
    for resp, status, param, words in refused:
        err = resp.json()["error"]
        assert resp.status_code == status and err["param"] == param, err
        assert words in err["message"], err


def test_fields_sent_as_null_take_their_defaults():
    """The openai client sends `n: null` when a caller passes n=None, as
    wrappers that forward their own defaults do; OpenAI and vLLM read null
    as the default, so we do too (it was a 400)."""
    from pdserve.router.openai_protocol import ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "a"}], "n": None, "stream": None,
         "logprobs": None, "max_tokens": None, "ignore_eos": None})
    assert (chat.n, chat.stream, chat.logprobs, chat.max_tokens) == (1, False, False, None)
    done = CompletionRequest.model_validate(
        {"prompt": "a", "echo": None, "stream": True,
         "stream_options": {"include_usage": None}})
    assert done.echo is False and done.include_usage is False
    import pydantic
    import pytest

    with pytest.raises(pydantic.ValidationError, match="messages"):
        ChatCompletionRequest.model_validate({"messages": None})   # required stays required


def test_chat_text_parts_join_by_lines_and_template_kwargs_reach_the_template():
    """A message's text parts are joined with newlines, as vLLM joins them
    (the same request gets the same prompt); chat_template_kwargs are the
    template's variables (Qwen3's enable_thinking), and one that would set
    what the request sets itself is refused by name."""
    from starlette.testclient import TestClient

    from pdserve.router.http_api import build_app

    class Templated(PrintableTokenizer):
        chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}"
                         "/no_think{% endif %}")
    cfg = ServeConfig.from_dict({"cluster": {"fused": 1}, "model": {"name": "toy"},
                                 "engine": {"total_pages": 64, "page_size": 4,
                                            "max_context_tokens": 64}})
    tok = Templated()
    http = TestClient(build_app(Router(cfg, tok, 98, [("fused-0", "fused", "127.0.0.1:9")])))
    parts = [{"role": "user", "content": [{"type": "text", "text": "Q:"},
                                          {"type": "text", "text": "2+2?"}]}]
    got = http.post("/tokenize", json={"messages": parts}).json()
    assert tok.decode(got["tokens"]) == "<user>Q:\n2+2?\n"
    got = http.post("/tokenize", json={"messages": parts,
                                       "chat_template_kwargs": {"enable_thinking": False}})
    assert tok.decode(got.json()["tokens"]) == "<user>Q:\n2+2?\n/no_think"
    refused = http.post("/tokenize", json={"messages": parts,
                                           "chat_template_kwargs": {"messages": []}})
    err = refused.json()["error"]
    assert refused.status_code == 400 and err["param"] == "chat_template_kwargs"
    assert "messages" in err["message"]


def test_a_logprob_names_a_special_token_by_its_text():
    """An end of turn scored in logprobs is '<|im_end|>', not '' (decoding
    it as answer text drops it, and two special tokens then shared one key
    in a completion's top_logprobs)."""
    from pdserve.kernels.models.loader import load_tokenizer

    from pdserve.router.http_api import HttpFront

    tok = load_tokenizer(None, "smollm2-135m")
    end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(end) == 1
    assert tok.decode(end) == ""                                  # answer text
    cfg = ServeConfig.from_dict({"cluster": {"fused": 1}})
    front = HttpFront(Router(cfg, tok, 49152, [("fused-0", "fused", "127.0.0.1:9")])).answers
    assert front._tok_str(end[0]) == "<|im_end|>"
