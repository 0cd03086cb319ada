"""The OpenAI request bodies pdserve accepts, as pydantic models, and their
translation to SamplingParams. Unknown fields are ignored (clients send many);
fields pdserve does not implement are refused when set to anything but their
no-op value, naming the field, rather than silently ignored."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from pdserve.cluster.pairing import ROUTES
from pdserve.kernels.sampling import MAX_LOGPROBS, SamplingParams

MAX_N = 16
MAX_STOP = 16


class Unsupported(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=-1)
    seed: StrictInt | None = Field(None, ge=0, lt=1 << 63)
    stop: Union[str, list[str], None] = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict | None = None
    best_of: StrictInt | None = None
    user: str | None = None
    route: str = ""                     # pdserve's routing hint: "", fused, disaggregated

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
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise Unsupported(name, f"{name} is not supported by pdserve; leave it unset "
                                  "or 0")
        if self.repetition_penalty not in (None, 1, 1.0):
            raise Unsupported("repetition_penalty", "repetition_penalty is not supported by "
                              "pdserve; leave it unset or 1")
        if self.logit_bias:
            raise Unsupported("logit_bias", "logit_bias is not supported by pdserve; leave it "
                              "unset")
        if self.best_of not in (None, self.n):
            raise Unsupported("best_of", "best_of is not supported by pdserve apart from "
                              "best_of == n; use n")

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams for one choice (seed i of n is seed + i, so the n
        choices differ and each is reproducible)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0), seed=self.seed, stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens) if max_tokens else self.min_tokens,
            logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise Unsupported("echo", "echo is not supported by pdserve; leave it false")
        if self.suffix:
            raise Unsupported("suffix", "suffix is not supported by pdserve; leave it unset")

    def prompts(self) -> list:
        """The prompts: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
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
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    response_format: dict | None = None
    add_generation_prompt: StrictBool = True

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise Unsupported("tools", "tool calling is not supported by pdserve; send no tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise Unsupported("tool_choice", "tool calling is not supported by pdserve")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise Unsupported("response_format", "only response_format {type: text} is "
                              "supported by pdserve")
        if self.top_logprobs is not None and not self.logprobs:
            raise Unsupported("top_logprobs", "top_logprobs needs logprobs: true")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
