"""The grammar backend: llguidance (text/grammar.py is the interface).

JSON is compiled compact (no free whitespace: a model that may emit
whitespace forever between tokens of a valid document can never finish it,
vLLM's #38696). The parser's limits bound what one compile or one mask may
cost; a constraint past them is refused by name like any other bad one."""

from __future__ import annotations

import json

import llguidance as llg
import llguidance.numpy as llnp

from typing import TYPE_CHECKING

from pdserve.text.constraint import Constraint, ConstraintKind, GrammarError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
_LIMITS = llg.LLParserLimits(verbose_errors=False)


def grammar_text(c: Constraint) -> str:
    """llguidance's grammar for `c`; GrammarError for text that is not even
    the kind it claims (a schema that is not JSON, choices not a list)."""
    kind = c.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                      overrides=_JSON_OPTIONS)
    if kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(c.text)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the JSON schema must be an object (or true/false), not "
                               f"{type(schema).__name__}")
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if kind is ConstraintKind.REGEX:
        return llg.LLMatcher.grammar_from_regex(c.text)
    if kind is ConstraintKind.CHOICE:
        try:
            options = json.loads(c.text)
        except ValueError:
            options = None
        if not isinstance(options, list) or not options or \
                not all(isinstance(o, str) and o for o in options):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(o) for o in options))
    if kind is ConstraintKind.GRAMMAR:
        try:
            return llg.grammar_from("grammar", c.text)   # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise GrammarError(f"invalid grammar: {e}") from None
    raise GrammarError(f"unknown constraint kind {kind!r}")


def _what(c: Constraint) -> str:
    return {ConstraintKind.JSON_SCHEMA: "JSON schema", ConstraintKind.REGEX: "regex",
            ConstraintKind.GRAMMAR: "grammar"}.get(c.kind, c.kind.value)


def _explain(c: Constraint, message: str) -> str:
    message = message.strip()
    if message.startswith("Unimplemented keys:"):
        keys = message[len("Unimplemented keys:"):].strip()
        return (f"the JSON schema uses {keys}, which pdserve's structured outputs do not "
                "support; remove the keyword(s) from the schema")
    return f"invalid {_what(c)}: {message}"


def check(c: Constraint) -> None:
    """GrammarError naming what is wrong with `c`, without a vocabulary."""
    grammar = grammar_text(c)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, limits=_LIMITS)
    if is_error:
        raise GrammarError(_explain(c, messages[0] if messages else "rejected"))


class _Vocabulary:
    """llguidance's TokenizerWrapper protocol over a tokenizer without a
    tokenizer.json (the tiny preset's characters): each id's bytes."""

    def __init__(self, tokenizer, vocab_size: int):
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        special = {i for i in (self.eos_token_id, self.bos_token_id) if i is not None}
        self.special_token_ids = sorted(special)
        self.tokens = [b"<|special_%d|>" % i if i in special
                       else tokenizer.decode([i]).encode("utf-8")
                       for i in range(min(tokenizer.vocab_size, vocab_size))]
        self._encode = tokenizer.encode
        self.is_tokenizer_wrapper = True

    def __call__(self, s) -> list[int]:
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return self._encode(text, add_special_tokens=False)


def _ll_tokenizer(tokenizer, vocab_size: int) -> llg.LLTokenizer:
    eos = tokenizer.eos_token_id
    to_json = getattr(tokenizer, "to_json", None)
    text = to_json() if to_json is not None else None
    if text is not None:
        return llg.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
    return llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size)),
                           n_vocab=vocab_size, eos_token=eos)


class LLGuidanceCompiler:
    """Compiles constraints against one model's vocabulary. Building the
    vocabulary's token trie costs a fraction of a second (SmolLM2: about
    0.3 s), once, on the first compile."""

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._ll: llg.LLTokenizer | None = None

    def compile(self, constraint: Constraint) -> LLGuidanceGrammar:
        if self._ll is None:
            self._ll = _ll_tokenizer(self._tokenizer, self.vocab_size)
        grammar = grammar_text(constraint)
        probe = llg.LLMatcher(self._ll, grammar, log_level=0, limits=_LIMITS)
        if probe.is_error():
            raise GrammarError(_explain(constraint, probe.get_error()))
        return LLGuidanceGrammar(self._ll, grammar, probe)


class LLGuidanceGrammar:
    """A compiled grammar: each `matcher()` a fresh start (the first is the
    compile's own probe, so the first request pays no second build)."""

    def __init__(self, ll: llg.LLTokenizer, grammar: str, probe: llg.LLMatcher):
        self._ll, self._grammar = ll, grammar
        self._probe: llg.LLMatcher | None = probe

    def matcher(self) -> LLGuidanceMatcher:
        if self._probe is not None:
            m, self._probe = self._probe, None
            return LLGuidanceMatcher(m)
        return LLGuidanceMatcher(llg.LLMatcher(self._ll, self._grammar, log_level=0,
                                               limits=_LIMITS))


class LLGuidanceMatcher:
    __slots__ = ("_m",)

    def __init__(self, m: llg.LLMatcher):
        self._m = m

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token)

    def fill_mask(self, mask, row: int) -> None:
        llnp.fill_next_token_bitmask(self._m, mask, row)

    def valid_prefix(self, tokens) -> int:
        return self._m.validate_tokens(list(tokens)) if tokens else 0

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def is_done(self) -> bool:
        return self._m.is_stopped()

    def error(self) -> str:
        return self._m.get_error()

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._m.deep_copy())
