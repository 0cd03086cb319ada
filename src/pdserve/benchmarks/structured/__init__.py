"""Structured outputs measured: `pdserve bench structured` and the JSON
schemas it (and tools/compare_grammar_libraries.py) draws on
(schemas.json: realistic agent and extraction schemas)."""
