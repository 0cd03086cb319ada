"""text/grammar.py: constraints checked by name, compiled against a
vocabulary, and matchers that allow exactly what the grammar allows."""

import json

import numpy as np
import pytest

from pdserve.text.grammar import (Constraint, ConstraintKind, GrammarError, check_constraint,
                                  compiler_for, mask_words)
from pdserve.text.tokenizer import PrintableTokenizer


def _allowed(m, vocab: int) -> set[int]:
    mask = np.zeros((1, mask_words(vocab)), np.int32)
    m.fill_mask(mask, 0)
    bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


@pytest.mark.parametrize("constraint, words", [
    (Constraint.json_schema({"type": "array", "uniqueItems": True}), '["uniqueItems"]'),
    (Constraint.json_schema("{not json"), "not valid JSON"),
    (Constraint.json_schema("[1]"), "must be an object"),
    (Constraint(ConstraintKind.REGEX, "a(b"), "unclosed group"),
    (Constraint(ConstraintKind.GRAMMAR, "start: undefined_rule"), "undefined_rule"),
    (Constraint.choice([]), "non-empty list"),
])
def test_a_bad_constraint_is_refused_naming_what_is_wrong(constraint, words):
    with pytest.raises(GrammarError, match=None) as e:
        check_constraint(constraint)
    assert words in str(e.value)


def test_good_constraints_of_every_kind_pass_the_check():
    for c in (Constraint.json_schema({"type": "object"}), Constraint(ConstraintKind.JSON_OBJECT),
              Constraint(ConstraintKind.REGEX, r"[0-9]{3}"), Constraint.choice(["yes", "no"]),
              Constraint(ConstraintKind.GRAMMAR, 'start: "a" "b"+'),
              Constraint(ConstraintKind.GRAMMAR, 'root ::= "yes" | "no"')):
        check_constraint(c)


def test_the_mask_allows_exactly_the_grammars_next_tokens_and_done_ends_it():
    """Characters as tokens (the tiny preset): after `{"x":` only digits
    and '-' may follow; after the closing brace the grammar is complete."""
    tok = PrintableTokenizer()
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
              "additionalProperties": False}
    m = compiler_for(tok, 98).compile(Constraint.json_schema(schema)).matcher()
    for ch in '{"x":':
        assert not m.is_done()
        assert m.accept(tok.encode(ch)[0])
    assert {tok.decode([t]) for t in _allowed(m, 98)} == set("-0123456789")
    for ch in "12}":
        assert m.accept(tok.encode(ch)[0])
    assert m.is_done()


def test_rollback_and_copy_return_to_an_earlier_state():
    tok = PrintableTokenizer()
    m = compiler_for(tok, 98).compile(Constraint.choice(["abc", "abd"])).matcher()
    ids = [tok.encode(c)[0] for c in "ab"]
    for t in ids:
        assert m.accept(t)
    fork = m.copy()
    assert m.valid_prefix([tok.encode("c")[0], tok.encode("x")[0]]) == 1
    assert m.accept(tok.encode("c")[0]) and m.is_done()
    m.rollback(1)
    assert not m.is_done() and _allowed(m, 98) == _allowed(fork, 98) == \
        {tok.encode("c")[0], tok.encode("d")[0]}


def test_tokens_past_the_tokenizers_vocabulary_are_never_allowed():
    """The model's logits may be wider than its tokenizer (padding rows)."""
    tok = PrintableTokenizer()
    m = compiler_for(tok, 128).compile(Constraint(ConstraintKind.REGEX, ".*")).matcher()
    assert max(_allowed(m, 128)) < 98


def test_a_constraint_crosses_the_wire_unchanged():
    from pdserve.proto.sampling import from_options, to_options
    from pdserve.text.sampling_params import SamplingParams

    for c in (Constraint.json_schema({"type": "object"}), Constraint.choice(["a", "b"]), None):
        sp = SamplingParams(constraint=c)
        assert from_options(to_options(sp)).constraint == c
    assert json.loads(Constraint.choice(["a"]).text) == ["a"]
