"""The OpenAI wire format of a request: the bodies pdserve accepts, as
pydantic models, and their translation to SamplingParams (what goes back is
openai_answers.py's). Unknown fields are ignored
(clients send many; http_api.py refuses one that is a near miss of a field
here); fields pdserve does not implement are refused when set to anything
but their no-op value, naming the field, rather than silently ignored."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt,
                      field_validator, model_validator)

from pdserve.router.engines.pairing import ROUTES
from pdserve.router.structured import Unsupported, checked, request_constraint
from pdserve.text.constraint import Constraint
from pdserve.text.tools import ToolError, ToolUse
from pdserve.text.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 16
MAX_STOP = 16


def _null_is_default(model: type[BaseModel], data):
    """A field sent as null takes its default, as OpenAI and vLLM read it
    (the openai client sends `n: null` when a caller passes n=None)."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items()
                if not (v is None and k in model.model_fields
                        and model.model_fields[k].default is not None)}
    return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        return _null_is_default(cls, data)


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=-1)
    seed: StrictInt | None = Field(None, ge=-(1 << 63), lt=1 << 64)   # any 64-bit integer
    stop: Union[str, list[str], None] = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, StrictFloat] | None = None        # token id (as a string) -> bias
    best_of: StrictInt | None = None
    # vLLM's extensions
    repetition_penalty: StrictFloat | None = Field(None, ge=0.01, le=10.0, allow_inf_nan=False)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # vLLM's extensions that change the answer: refused unless at their no-op value
    prompt_logprobs: StrictInt | None = None
    guided_json: object = None          # vLLM's before 0.12: refused, naming structured_outputs
    guided_regex: object = None
    guided_choice: object = None
    guided_grammar: object = None
    # structured outputs: vLLM's extension, or OpenAI's response_format (text,
    # json_object, json_schema); at most one of them (structured.py reads them)
    structured_outputs: object = None
    response_format: dict | None = None
    user: str | None = None
    route: str = ""                     # pdserve's routing hint: "", fused, disaggregated

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        return _null_is_default(cls, data)

    @field_validator("route")
    @classmethod
    def _route(cls, v):
        if v not in ROUTES:
            raise ValueError(f"route {v!r} is unknown: use '', 'fused' or 'disaggregated'")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if not v:
            return v
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"logit_bias key {key!r} is not a token id (a string of "
                                 "digits, as OpenAI's API sends them)")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias of token {key} is {bias}: give a number in "
                                 "[-100, 100]")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only for streamed answers: set stream: true, "
                             "or leave stream_options out")
        return self

    def check_unsupported(self) -> None:
        if self.best_of not in (None, self.n):
            raise Unsupported("best_of", "best_of is not supported by pdserve apart from "
                              "best_of == n; use n")
        if self.prompt_logprobs is not None:
            raise Unsupported("prompt_logprobs", "prompt_logprobs is not supported by pdserve; "
                              "logprobs covers the generated tokens")
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                key = name.removeprefix("guided_")
                raise Unsupported(name, f"{name} was replaced by structured_outputs (as in "
                                  f"vLLM 0.12): send structured_outputs: {{{key}: ...}}")

    def constraint(self) -> Constraint | None:
        """What the output must match, checked (a 400 names what is wrong)."""
        return request_constraint(self.structured_outputs, self.response_format)

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams for the request's choices (`max_tokens`: the limit
        in force, the endpoint's default or max_completion_tokens included).
        A seed is taken as 64 bits (-1 and 2**64 - 1 are one seed)."""
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise Unsupported("min_tokens", f"min_tokens={self.min_tokens} exceeds the "
                              f"{max_tokens} tokens this request may generate; lower min_tokens "
                              "or raise max_tokens")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0), stop=tuple(self.stop or ()),
            seed=self.seed % (1 << 64) if self.seed is not None else None,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0, min_p=self.min_p or 0.0,
            logit_bias={int(k): b for k, b in (self.logit_bias or {}).items()},
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, constraint=self.constraint())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: object
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        def ids(x):
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in x)
        if isinstance(v, str) or (isinstance(v, list) and (
                all(isinstance(x, str) for x in v) or ids(v) or all(ids(x) for x in v))):
            return v
        raise ValueError("give a string, a list of strings, a list of token ids or a list of "
                         "token-id lists (one kind, not mixed)")

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo and self.logprobs is not None:
            raise Unsupported("echo", "echo with logprobs would need the prompt's logprobs, "
                              "which pdserve does not compute; drop one of them")
        if self.suffix:
            raise Unsupported("suffix", "suffix is not supported by pdserve; leave it unset")

    def prompts(self) -> list:
        """The prompts: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        assert isinstance(p, list)     # `_prompt` let only a string or a list in
        if not p:
            raise Unsupported("prompt", "prompt is an empty list; send a string, a list of "
                              "strings or token ids")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        bad = next((p.type for p in self.content if p.type != "text"), None)
        if bad is not None:
            raise Unsupported("messages", f"content part of type {bad!r} is not supported; "
                              "pdserve serves text models: send text parts")
        return "\n".join(p.text or "" for p in self.content)     # as vLLM joins them


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    functions: list | None = None
    function_call: Union[str, dict, None] = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None    # vLLM's: more variables for the template

    @model_validator(mode="after")
    def _continues(self):
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message continues the last assistant "
                                 "message, add_generation_prompt starts a new one: set "
                                 "add_generation_prompt: false")
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message needs the last message to be the "
                                 f"assistant's, not {self.messages[-1].role!r}")
        return self

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.functions or self.function_call not in (None, "none", "auto"):
            raise Unsupported("functions" if self.functions else "function_call",
                              "functions and function_call were replaced by tools and "
                              "tool_choice in OpenAI's API; send those")
        self.tool_use()
        if self.top_logprobs is not None and not self.logprobs:
            raise Unsupported("top_logprobs", "top_logprobs needs logprobs: true")

    def tool_use(self) -> ToolUse | None:
        """The request's tools and tool_choice (None: no tools), checked."""
        try:
            return ToolUse.parse(self.tools, self.tool_choice)
        except ToolError as e:
            raise Unsupported(e.param, str(e)) from None

    def constraint(self) -> Constraint | None:
        """tool_choice required or named constrains the output to calls; a
        response format beside it is refused."""
        use = self.tool_use()
        forced = use.constraint() if use is not None else None
        if forced is None:
            return super().constraint()
        if self.response_format not in (None, {"type": "text"}) or self.structured_outputs:
            raise Unsupported("tool_choice", "tool_choice required or a named function "
                              "constrains the output itself: leave response_format and "
                              "structured_outputs out")
        return checked(forced, "tools")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt, or messages rendered with the chat
    template as /v1/chat/completions renders them."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool | None = None   # default: true for a prompt, false for messages
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self

    def check_unsupported(self) -> None:
        return None


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize: token ids to text."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]

    def check_unsupported(self) -> None:
        return None


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter (and, without a path, unload)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    lora_name: str
    lora_path: str | None = None
    pinned: bool = False            # never evicted from host memory or its device slot

    def check_unsupported(self) -> None:
        return None
