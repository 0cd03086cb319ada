"""Structured outputs: what a request constrains its output to, and the small
interface the engine drives a grammar through.

A `Constraint` (text/constraint.py) is plain data, a kind and its text,
that rides in `SamplingParams` from the API to every engine. `check_constraint` is what
the router runs at ingest, without a tokenizer: a bad schema, regex or
grammar, or a schema keyword the library does not implement, raises
`GrammarError` naming it, and nothing is admitted. An engine compiles the
constraint against its vocabulary (`GrammarCompiler.compile`, off its loop)
into a `CompiledGrammar`, and each request decodes with its own `Matcher`:

    matcher.fill_mask(mask, row)    # the tokens allowed next, as bits
    matcher.accept(token)           # the token sampled (False: not allowed)
    matcher.is_done()               # the grammar is complete: the request ends
    matcher.valid_prefix(drafts)    # how many speculative drafts it allows
    matcher.rollback(n), copy()

Masks are int32 rows of ceil(V / 32) words, bit i of word w allowing token
32 w + i (the layout llguidance and xgrammar both fill). The one backend is
text/grammar_llguidance.py (chosen by measurement: docs/benchmarks.md,
"Structured outputs: the grammar library")."""

from __future__ import annotations

from typing import Protocol

from pdserve.text.constraint import Constraint, ConstraintKind, GrammarError
from pdserve.text.grammar_llguidance import LLGuidanceCompiler, check

__all__ = ["Constraint", "ConstraintKind", "GrammarError", "Matcher", "CompiledGrammar",
           "GrammarCompiler", "mask_words", "check_constraint", "compiler_for"]


class Matcher(Protocol):
    def accept(self, token: int) -> bool: ...
    def fill_mask(self, mask, row: int) -> None: ...
    def valid_prefix(self, tokens) -> int: ...
    def rollback(self, n: int) -> None: ...
    def is_done(self) -> bool: ...
    def copy(self) -> Matcher: ...


class CompiledGrammar(Protocol):
    def matcher(self) -> Matcher: ...


class GrammarCompiler(Protocol):
    vocab_size: int

    def compile(self, constraint: Constraint) -> CompiledGrammar: ...


def mask_words(vocab_size: int) -> int:
    """int32 words a mask row takes for a vocabulary."""
    return (vocab_size + 31) // 32


def check_constraint(constraint: Constraint) -> None:
    """Raise GrammarError naming what is wrong with `constraint`, checked
    without a vocabulary (the router's check at ingest)."""
    check(constraint)


def compiler_for(tokenizer, vocab_size: int) -> GrammarCompiler:
    """The compiler for a model's tokenizer, its masks `vocab_size` wide (the
    model's logits; tokens past the tokenizer's are never allowed)."""
    return LLGuidanceCompiler(tokenizer, vocab_size)
