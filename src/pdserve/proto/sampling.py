"""SamplingParams on the wire, in one place: `pdserve.v1.SamplingOptions`
is the client API's message, and the router hands the same message to an
engine (Submit) and D to P (RemotePrefill). Proto3 scalars cannot be
unset, so 0 means the default where the default is not 0: top_p and
repetition_penalty 0 are 1.0."""

from __future__ import annotations

from pdserve.text.constraint import Constraint, ConstraintKind
from pdserve.text.sampling_params import SamplingParams
from pdserve.proto import router_pb2 as pb

_KINDS = {ConstraintKind.JSON_SCHEMA: pb.StructuredOutput.JSON_SCHEMA,
          ConstraintKind.JSON_OBJECT: pb.StructuredOutput.JSON_OBJECT,
          ConstraintKind.REGEX: pb.StructuredOutput.REGEX,
          ConstraintKind.CHOICE: pb.StructuredOutput.CHOICE,
          ConstraintKind.GRAMMAR: pb.StructuredOutput.GRAMMAR}
_FROM_WIRE = {v: k for k, v in _KINDS.items()}


def to_structured(c: Constraint) -> pb.StructuredOutput:
    return pb.StructuredOutput(kind=_KINDS[c.kind], text=c.text)


def from_structured(m: pb.StructuredOutput) -> Constraint:
    """The message as a Constraint (ValueError for a kind left unset)."""
    kind = _FROM_WIRE.get(m.kind)
    if kind is None:
        raise ValueError("sampling.structured.kind is unset: give JSON_SCHEMA, JSON_OBJECT, "
                         "REGEX, CHOICE or GRAMMAR, or leave structured out")
    return Constraint(kind, m.text)


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
              "keep_special_tokens": not sp.skip_special_tokens,
              "structured": to_structured(sp.constraint) if sp.constraint else None}
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
              "skip_special_tokens": not s.keep_special_tokens,
              "constraint": from_structured(s.structured) if s.HasField("structured") else None}
    fields.update(override)
    return SamplingParams(**fields)
