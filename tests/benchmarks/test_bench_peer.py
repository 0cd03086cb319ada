"""`pdserve bench peer`: finding llama-server, the GGUF both serve, the load
alternating between servers, the table with its ratios, and a clean skip
without llama.cpp. llama.cpp itself is stood in for by fake_llama_server.py."""

import os
import stat
import sys

import pytest

from pdserve.benchmarks.serving import peer
from pdserve.cli.main import main

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support")


@pytest.fixture
def fake_exe(tmp_path):
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {SUPPORT}/fake_llama_server.py \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_without_llama_server_the_benchmark_says_so_and_skips(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["bench", "peer"]) == 0
    assert "llama-server is not on the PATH" in capsys.readouterr().out


def test_a_given_llama_server_that_is_not_there_is_an_error(capsys):
    assert main(["bench", "peer", "--llama-server", "/no/such/llama-server"]) == 2
    assert "--llama-server '/no/such/llama-server' is not a file" in capsys.readouterr().err


def test_a_config_without_a_gguf_is_refused(capsys, fake_exe):
    assert main(["bench", "peer", "--config", "deploy/local-tiny.yaml",
                 "--llama-server", fake_exe]) == 2
    assert "serves the tiny preset; use a config whose model is a .gguf" in \
        capsys.readouterr().err


def test_the_shipped_fused_config_serves_the_preset_gguf():
    assert peer.gguf_of("deploy/local-fused.yaml").endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_both_servers_get_the_same_load_alternating_and_the_table_has_ratios(fake_exe):
    with peer.llama_server(fake_exe, "model.gguf", 2, 8, 16384) as url:
        servers = [peer.Server("ours", url), peer.Server("llama.cpp", url)]
        cells = peer.measure(servers, [1, 4], repeats=2, prompt_len=8, max_tokens=5,
                             per_stream=1)
    for (name, c), cell in cells.items():
        assert len(cell.runs) == 2
        assert all(r["ok"] == 8 and r["output_tok_per_s"] > 0 for r in cell.runs)
        assert all(r["ok"] * 5 == round(r["output_tok_per_s"] * r["wall_s"]) for r in cell.runs)
    lines = peer.table(servers, [1, 4], cells, "llama.cpp")
    assert lines[0] == ("| server | c=1 out tok/s | c=1 ITL p50 | c=1 TTFT p50 | c=4 out tok/s "
                        "| c=4 ITL p50 | c=4 TTFT p50 |")
    assert [ln.split(" | ")[0] for ln in lines[2:]] == ["| ours", "| llama.cpp",
                                                        "| ours / llama.cpp"]
    ratios = lines[-1].strip("| ").split(" | ")[1:]
    # tok/s and TTFT always have a ratio; ITL has one when some tokens arrived
    # in separate reads (a loaded host may coalesce a short stream's events)
    assert all(ratios[i].endswith("x") for i in (0, 2, 3, 5))
    assert all(ratios[i].endswith("x") or ratios[i] == "-" for i in (1, 4))


def test_the_same_prompts_go_to_every_server():
    a, b = peer.samples(3, 16, 4, seed=0), peer.samples(3, 16, 4, seed=0)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert all(peer.PROMPT_TOKENS[0] <= t < peer.PROMPT_TOKENS[1] for s in a for t in s.prompt)


def test_every_cell_sends_fresh_prompts_the_same_to_every_server(monkeypatch):
    """No cell's prompt hits a prefix an earlier cell cached (guidellm's
    synthetic prompts are fresh too); within a cell both servers get the same."""
    sent = []
    monkeypatch.setattr("pdserve.sim.load.drive", lambda url, load, *a, **kw: (
        sent.append((url, [tuple(s.prompt) for s in load])) or {"failed": 0}))
    peer.measure([peer.Server("ours", "a"), peer.Server("llama.cpp", "b")], [1, 8],
                 repeats=2, prompt_len=8, max_tokens=4, per_stream=1)
    timed = sent[2:]                                  # after one warm-up each
    assert [u for u, _ in timed] == ["a", "b"] * 4
    cells = [p for (_, p), (_, q) in zip(timed[::2], timed[1::2]) if p == q]
    assert len(cells) == 4                            # both servers, the same prompts
    assert sent[0][1] == sent[1][1]                   # one warm-up, the same for both
    prompts = [p for cell in cells for p in cell] + sent[0][1]
    assert len(set(prompts)) == len(prompts)          # none repeats, warm-up's included
