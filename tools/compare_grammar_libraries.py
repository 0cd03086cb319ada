"""llguidance against xgrammar on this machine: how pdserve chose its grammar
library (issue 55; the figures are in docs/benchmarks.md, "Structured
outputs: the grammar library").

By hand, not in CI: xgrammar is not a dependency, so install it beside
llguidance first (`pip install xgrammar==0.2.8`, which pulls no torch where
torch 2.13.0 is installed). Run from the checkout:

    .venv/bin/python tools/compare_grammar_libraries.py [--steps 200] [--seed 0]

On SmolLM2-135M-Instruct's tokenizer (read from its GGUF file, as pdserve's
loader reads it), for each JSON schema in benchmarks/structured/schemas.json:
- compile to first mask: the schema compiled (no cache) and one mask filled;
- mask time per token: a seeded random walk through tokens both libraries
  allow (one sequence, both libraries timed on it), a single-threaded fill of
  the next-token bitmask per step (a token that closes a string, object or
  array is taken one step in ten, so strings run to a few tokens).
Both compile compact JSON (no free whitespace), as pdserve serves it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib import resources

import numpy as np


def smollm2_tokenizer():
    from pdserve.kernels.models.loader import load_tokenizer

    return load_tokenizer(None, "smollm2-135m")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200, help="tokens walked per schema")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import llguidance as llg
    import llguidance.numpy as llnp
    import torch
    import transformers
    import xgrammar as xgr

    torch.set_num_threads(1)
    tok = smollm2_tokenizer()
    vocab = tok.vocab_size
    text = (resources.files("pdserve.benchmarks.structured") / "schemas.json").read_text()
    schemas = json.loads(text)

    t = time.perf_counter()
    ll_tok = llg.LLTokenizer(tok._tok.to_str(), n_vocab=vocab, eos_token=tok.eos_token_id)
    ll_tok_s = time.perf_counter() - t
    t = time.perf_counter()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tok)
    xg_info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab,
                                                 stop_token_ids=[tok.eos_token_id])
    xg_tok_s = time.perf_counter() - t
    closing = [any(c in tok.decode([i]) for c in '"}]') for i in range(vocab)]
    compiler = xgr.GrammarCompiler(xg_info, max_threads=1, cache_enabled=False)

    ll_compile, xg_compile = [], []
    ll_mask, xg_mask = [], []
    rng = random.Random(args.seed)
    ll_bits = llnp.allocate_token_bitmask(1, vocab)
    xg_bits = xgr.allocate_token_bitmask(1, vocab)
    for entry in schemas:
        schema = entry["schema"]
        t = time.perf_counter()
        grammar = llg.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False})
        ll = llg.LLMatcher(ll_tok, grammar)
        llnp.fill_next_token_bitmask(ll, ll_bits, 0)
        ll_compile.append(time.perf_counter() - t)
        assert not ll.is_error(), (entry["name"], ll.get_error())

        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=(",", ":"))
        xg = xgr.GrammarMatcher(compiled)
        xg.fill_next_token_bitmask(xg_bits, 0)
        xg_compile.append(time.perf_counter() - t)

        for _ in range(args.steps):
            t = time.perf_counter()
            llnp.fill_next_token_bitmask(ll, ll_bits, 0)
            ll_mask.append(time.perf_counter() - t)
            t = time.perf_counter()
            xg.fill_next_token_bitmask(xg_bits, 0)
            xg_mask.append(time.perf_counter() - t)
            both = np.unpackbits(ll_bits[0].view(np.uint8), bitorder="little")[:vocab] & \
                np.unpackbits(xg_bits[0].numpy().view(np.uint8), bitorder="little")[:vocab]
            allowed = np.flatnonzero(both)
            allowed = allowed[allowed != tok.eos_token_id]
            if len(allowed) == 0:
                break               # only EOS left: the document is complete
            # a model writes strings and arrays of some length: a token that
            # closes one is taken one time in ten when others are allowed
            open_ = [i for i in allowed if not closing[i]]
            pick = open_ if open_ and rng.random() < 0.9 else allowed
            token = int(pick[rng.randrange(len(pick))])
            assert ll.consume_token(token), (entry["name"], ll.get_error())
            assert xg.accept_token(token), entry["name"]

    def row(name, compile_s, mask_s):
        ms = [x * 1e3 for x in compile_s]
        us = [x * 1e6 for x in mask_s]
        return (f"| {name} | {statistics.median(ms):.2f} | {pct(ms, 0.99):.1f} | {max(ms):.1f} "
                f"| {statistics.mean(us):.1f} | {statistics.median(us):.1f} | {pct(us, 0.99):.0f} |")

    print(f"SmolLM2 vocabulary {vocab}; {len(schemas)} schemas; {len(ll_mask)} masks each; "
          f"tokenizer setup: llguidance {ll_tok_s:.2f} s, xgrammar {xg_tok_s:.2f} s")
    print("| library | compile to first mask p50 (ms) | p99 | max | mask mean (µs) | p50 | p99 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(row(f"llguidance {llg.__version__ if hasattr(llg, '__version__') else '1.9.1'}",
              ll_compile, ll_mask))
    for name, times in (("llguidance", ll_compile), ("xgrammar", xg_compile)):
        worst = max(range(len(times)), key=times.__getitem__)
        print(f"{name}: slowest compile {schemas[worst]['name']} {times[worst] * 1e3:.0f} ms")
    print(row(f"xgrammar {xgr.__version__ if hasattr(xgr, '__version__') else '0.2.8'}",
              xg_compile, xg_mask))


if __name__ == "__main__":
    main()
