"""Structured outputs as the OpenAI API and vLLM's extension ask for them,
read into one `Constraint` and checked before anything is admitted:

- `response_format`: `{type: text}` (free text), `{type: json_object}`,
  `{type: json_schema, json_schema: {name, schema, strict}}`;
- `structured_outputs` (vLLM): exactly one of `json` (a schema, as an object
  or its JSON text), `regex`, `choice` (a list of strings), `grammar` (Lark or
  GBNF), `json_object: true`.

Every refusal is an `Unsupported(param, message)` (a 400) that names the field
and what to change; a schema the grammar library cannot compile, or whose
keyword it does not implement, names that too (text/grammar.py)."""

from __future__ import annotations

import json

from pdserve.text.constraint import Constraint, ConstraintKind, GrammarError
from pdserve.text.grammar import check_constraint


class Unsupported(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_VLLM_ONLY = ("structural_tag", "whitespace_pattern", "disable_fallback", "disable_any_whitespace",
              "disable_additional_properties")


def request_constraint(structured, response_format) -> Constraint | None:
    """The constraint a request's fields ask for (None: free text), checked."""
    fmt = _from_response_format(response_format)
    own = _from_structured_outputs(structured)
    if fmt is not None and own is not None:
        raise Unsupported("structured_outputs", "send either response_format or "
                          "structured_outputs, not both")
    c, param = (fmt, "response_format") if fmt is not None else (own, "structured_outputs")
    if c is not None:
        checked(c, param)
    return c


def checked(c: Constraint, param: str) -> Constraint:
    try:
        check_constraint(c)
    except GrammarError as e:
        raise Unsupported(param, f"{param}: {e}") from None
    return c


def _from_response_format(rf) -> Constraint | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise Unsupported("response_format", "response_format {type: json_schema} needs "
                              "json_schema: {name, schema, strict}")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            # OpenAI's default for a json_schema without one: any JSON object
            return Constraint(ConstraintKind.JSON_OBJECT)
        if not isinstance(schema, (dict, bool)):
            raise Unsupported("response_format", "response_format.json_schema.schema must be "
                              "a JSON schema object")
        return Constraint.json_schema(schema)
    raise Unsupported("response_format", f"response_format type {kind!r} is not supported: "
                      "use text, json_object or json_schema")


def _from_structured_outputs(so) -> Constraint | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise Unsupported("structured_outputs", "structured_outputs must be an object with one "
                          "of " + ", ".join(_KEYS))
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    for k in given:
        if k in _VLLM_ONLY:
            raise Unsupported("structured_outputs", f"structured_outputs.{k} is not supported "
                              "by pdserve; leave it out")
        if k not in _KEYS:
            raise Unsupported("structured_outputs", f"structured_outputs.{k} is unknown: give "
                              "one of " + ", ".join(_KEYS))
    if len(given) != 1:
        raise Unsupported("structured_outputs", "give exactly one of "
                          + ", ".join(_KEYS) + f" in structured_outputs, not {len(given)}")
    (key, value), = given.items()
    param = f"structured_outputs.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise Unsupported(param, f"{param} is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise Unsupported(param, f"{param} must be a JSON schema (an object)")
        return Constraint.json_schema(value)
    if key == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    if key == "choice":
        if not isinstance(value, list) or not value or \
                not all(isinstance(v, str) and v for v in value):
            raise Unsupported(param, f"{param} must be a non-empty list of non-empty strings")
        return Constraint.choice(value)
    if not isinstance(value, str) or not value:
        raise Unsupported(param, f"{param} must be a non-empty string")
    return Constraint(ConstraintKind.REGEX if key == "regex" else ConstraintKind.GRAMMAR, value)
