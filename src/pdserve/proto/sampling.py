"""SamplingParams on the wire, in one place: `pdserve.v1.SamplingOptions`
is the client API's message, and the router hands the same message to an
engine (Submit) and D to P (RemotePrefill). Proto3 scalars cannot be
unset, so 0 means the default where the default is not 0: top_p and
repetition_penalty 0 are 1.0."""

from __future__ import annotations

from pdserve.text.sampling_params import SamplingParams
from pdserve.proto import router_pb2 as pb


def to_options(sp: SamplingParams, **override) -> pb.SamplingOptions:
    """`sp` as a message; `override` replaces fields (max_tokens=None unsets it)."""
    fields = {"max_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
              "top_k": sp.top_k, "seed": sp.seed, "stop": list(sp.stop),
              "stop_token_ids": list(sp.stop_token_ids), "ignore_eos": sp.ignore_eos,
              "min_tokens": sp.min_tokens, "logprobs": sp.logprobs,
              "presence_penalty": sp.presence_penalty, "frequency_penalty": sp.frequency_penalty,
              "repetition_penalty": sp.repetition_penalty, "min_p": sp.min_p,
              "logit_bias": dict(sp.logit_bias),
              "include_stop_str_in_output": sp.include_stop_str_in_output,
              "keep_special_tokens": not sp.skip_special_tokens}
    fields.update(override)
    return pb.SamplingOptions(**{k: v for k, v in fields.items() if v is not None})


def from_options(s: pb.SamplingOptions, **override) -> SamplingParams:
    """The message as SamplingParams (ValueError names a field out of range);
    `override` replaces fields."""
    fields = {"max_tokens": s.max_tokens if s.HasField("max_tokens") else None,
              "temperature": s.temperature, "top_p": s.top_p or 1.0, "top_k": s.top_k,
              "seed": s.seed if s.HasField("seed") else None, "stop": tuple(s.stop),
              "stop_token_ids": tuple(s.stop_token_ids), "ignore_eos": s.ignore_eos,
              "min_tokens": s.min_tokens,
              "logprobs": s.logprobs if s.HasField("logprobs") else None,
              "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
              "repetition_penalty": s.repetition_penalty or 1.0, "min_p": s.min_p,
              "logit_bias": dict(s.logit_bias),
              "include_stop_str_in_output": s.include_stop_str_in_output,
              "skip_special_tokens": not s.keep_special_tokens}
    fields.update(override)
    return SamplingParams(**fields)
