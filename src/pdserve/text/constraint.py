"""What a request's output must match: a `Constraint` (a kind and its
text), plain data that `SamplingParams` carries from the API to every
engine; text/grammar.py checks and compiles it."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass


class ConstraintKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"     # text: the schema as JSON
    JSON_OBJECT = "json_object"     # any JSON object (text unused)
    REGEX = "regex"                 # text: the regular expression (Rust regex syntax)
    CHOICE = "choice"               # text: a JSON list of the strings allowed
    GRAMMAR = "grammar"             # text: a Lark grammar, or GBNF (llama.cpp's EBNF)


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    text: str = ""

    def __post_init__(self):
        object.__setattr__(self, "kind", ConstraintKind(self.kind))
        if not isinstance(self.text, str):
            raise ValueError(f"a {self.kind.value} constraint's text must be a string")

    @classmethod
    def json_schema(cls, schema) -> Constraint:
        """A schema given as a dict or as its JSON text."""
        return cls(ConstraintKind.JSON_SCHEMA,
                   schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, options) -> Constraint:
        return cls(ConstraintKind.CHOICE, json.dumps(list(options)))


class GrammarError(ValueError):
    """A constraint that cannot be compiled: the message names what is wrong
    (the keyword not implemented, the regex's error, the grammar's line)."""
