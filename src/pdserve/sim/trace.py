"""Request traces for `pdserve sim` and benchmarks.

Accepted, one request a line (JSONL):
  ours:     id, arrival_s, one of prompt_tokens | prompt | hash_ids
            (+ block_tokens, + prompt_tokens as the exact length),
            max_new_tokens (int or null), output_tokens (optional),
            adapter (optional: the LoRA adapter's name, a request's `model`)
  Mooncake: timestamp (ms), input_length, output_length, hash_ids
and the Azure LLM inference CSVs (TIMESTAMP, ContextTokens, GeneratedTokens).
A bad line is an error that names the line and the field.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pdserve.scheduler.request import BlockPrompt, TokenPrompt


class TraceError(ValueError):
    pass


@dataclass
class TraceRequest:
    id: str
    arrival_s: float
    prompt: object             # TokenPrompt | BlockPrompt
    max_new_tokens: int | None
    output_tokens: int | None  # what the simulated model generates before it stops
    strict: bool = False       # reserve the whole generation at admission
    adapter: str | None = None  # the LoRA adapter it runs under (None: the base model)


def _unique_prompt(index: int, length: int, block_tokens: int = 512) -> BlockPrompt:
    # A prompt that shares nothing with any other: blocks named by (-1 - index, b)
    blocks = max(1, -(-length // block_tokens))
    return BlockPrompt([(-1 - index, b) for b in range(blocks)], length, block_tokens)


def _int(row: dict, key: str, where: str, *, allow_none: bool = False, minimum: int = 0):
    v = row.get(key)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceError(f"{where}: field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def _parse_ours(row: dict, index: int, where: str) -> TraceRequest:
    rid = row.get("id", f"r{index}")
    if not isinstance(rid, str) or not rid:
        raise TraceError(f"{where}: field 'id' must be a non-empty string, got {rid!r}")
    arrival = row.get("arrival_s", 0.0)
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or arrival < 0:
        raise TraceError(f"{where}: field 'arrival_s' must be a number >= 0, got {arrival!r}")
    prompt: TokenPrompt | BlockPrompt
    if "prompt" in row:
        toks = row["prompt"]
        if not isinstance(toks, list) or not toks or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in toks):
            raise TraceError(f"{where}: field 'prompt' must be a non-empty list of token ids")
        prompt = TokenPrompt(toks)
    elif "hash_ids" in row:
        ids = row["hash_ids"]
        if not isinstance(ids, list) or not ids:
            raise TraceError(f"{where}: field 'hash_ids' must be a non-empty list")
        bt = _int(row, "block_tokens", where, minimum=1) if "block_tokens" in row else 512
        length = _int(row, "prompt_tokens", where, minimum=1) if "prompt_tokens" in row \
            else len(ids) * bt
        try:
            prompt = BlockPrompt(ids, length, bt)
        except ValueError as e:
            raise TraceError(f"{where}: {e}") from None
    elif "prompt_tokens" in row:
        prompt = _unique_prompt(index, _int(row, "prompt_tokens", where, minimum=1))
    else:
        raise TraceError(f"{where}: give one of 'prompt', 'hash_ids' or 'prompt_tokens'")
    mnt = _int(row, "max_new_tokens", where, allow_none=True, minimum=1)
    out = _int(row, "output_tokens", where, minimum=1) if row.get("output_tokens") is not None else mnt
    strict = row.get("strict", False)
    if not isinstance(strict, bool):
        raise TraceError(f"{where}: field 'strict' must be true or false, got {strict!r}")
    adapter = row.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise TraceError(f"{where}: field 'adapter' must be a LoRA adapter's name (a "
                         f"non-empty string), got {adapter!r}")
    return TraceRequest(rid, float(arrival), prompt, mnt, out, strict, adapter)


def _parse_mooncake(row: dict, index: int, where: str) -> TraceRequest:
    ts = row.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
        raise TraceError(f"{where}: field 'timestamp' must be milliseconds >= 0, got {ts!r}")
    length = _int(row, "input_length", where, minimum=1)
    out = _int(row, "output_length", where, minimum=1)
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise TraceError(f"{where}: field 'hash_ids' must be a non-empty list")
    try:
        prompt = BlockPrompt(ids, length, 512)
    except ValueError as e:
        raise TraceError(f"{where}: {e}") from None
    return TraceRequest(f"mc{index}", ts / 1000.0, prompt, out, out)


def _read_jsonl(path: Path) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path.name}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{where}: each line must be a JSON object")
            parse = _parse_mooncake if "input_length" in row else _parse_ours
            out.append(parse(row, len(out), where))
    return out


def _read_azure(path: Path) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    t0 = None
    with path.open(newline="") as f:
        for lineno, row in enumerate(csv.DictReader(f), 2):
            where = f"{path.name}:{lineno}"
            try:
                ts = datetime.fromisoformat(row["TIMESTAMP"][:26])
                ctx, gen = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (KeyError, ValueError) as e:
                raise TraceError(f"{where}: expected TIMESTAMP, ContextTokens, "
                                 f"GeneratedTokens ({e})") from None
            t0 = ts if t0 is None else t0
            i = len(out)
            out.append(TraceRequest(f"az{i}", (ts - t0).total_seconds(),
                                    _unique_prompt(i, max(ctx, 1)), max(gen, 1), max(gen, 1)))
    return out


def native_rate(trace: list[TraceRequest]) -> float:
    """Requests a second over the trace's span (its first arrival is t=0)."""
    span = max((t.arrival_s for t in trace), default=0.0)
    return len(trace) / span if span > 0 else float(len(trace))


def scale_arrivals(trace: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """The same requests arriving `factor` times as fast (open loop)."""
    if not factor > 0:
        raise ValueError(f"rate factor must be > 0, got {factor!r}")
    return [dataclasses.replace(t, arrival_s=t.arrival_s / factor) for t in trace]


def read_trace(path, limit: int | None = None) -> list[TraceRequest]:
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace file {str(p)!r} does not exist")
    reqs = _read_azure(p) if p.suffix == ".csv" else _read_jsonl(p)
    if limit is not None:
        reqs = reqs[:limit]
    seen = set()
    for r in reqs:
        if r.id in seen:
            raise TraceError(f"{p.name}: request id {r.id!r} appears twice; ids must be unique")
        seen.add(r.id)
    return reqs
