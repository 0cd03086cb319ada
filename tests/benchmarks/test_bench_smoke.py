"""Every `pdserve bench` kind, run once through the command line at tiny
sizes: each one starts, measures and prints its table (the numbers are the
benchmarks' business, not these tests')."""

import json
from pathlib import Path

import pytest
import torch

from pdserve.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
SIM_CFG = str(ROOT / "deploy" / "sim-demo.yaml")          # two fused engines, simulated
TRACE = str(ROOT / "deploy" / "demo-trace.jsonl")
TINY_CFG = str(ROOT / "deploy" / "local-tiny.yaml")       # one fused engine, tiny model


def bench(capsys, *args) -> str:
    code = main(["bench", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def test_bench_planner(capsys):
    out = bench(capsys, "planner", "--sizes", "8", "32", "--rounds", "5")
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["8"], ["32"])]
    assert [r[0] for r in rows] == ["8", "32"] and all(r[-1].endswith("x") for r in rows)


def test_bench_retraction(capsys):
    out = bench(capsys, "retraction", "--config", SIM_CFG, "--trace", TRACE, "--limit", "6")
    for run in ("optimistic, no host cache", "optimistic, host cache", "every request strict"):
        assert run in out
    assert out.startswith("6 requests")


def test_bench_disagg(capsys, tmp_path):
    res = tmp_path / "disagg.json"
    bench(capsys, "disagg", "--config", SIM_CFG, "--trace", TRACE, "--limit", "6",
          "--rates", "1.0", "--out", str(res))
    rows = json.loads(res.read_text())
    assert {r["config"] for r in rows} == {"fused x4", "2P+2D", "1P+3D", "3P+1D"}
    assert all(r["finished"] == 6 for r in rows)


@pytest.mark.slow                          # ~25 s: transformers and two warm-ups
def test_bench_llm(capsys):
    pytest.importorskip("transformers")
    out = bench(capsys, "llm", "--models", "tiny", "--dtype", "float32", "--workload",
                "uniform", "--batches", "1")
    row = next(ln.split() for ln in out.splitlines() if ln.startswith("tiny "))
    assert row[2:6] == ["float32", "eager", "uniform", "1"]   # auto leaves CPU eager
    assert row[-1] == "1/1"                 # float32: pdserve's tokens equal transformers'


def test_bench_capture(capsys):
    """On CPU, the capture's static buffers run eagerly (what a CUDA graph
    records): its logits are the eager forward's within 1e-5 in float32."""
    out = bench(capsys, "capture", "--device", "cpu", "--mode", "static", "--models", "tiny",
                "--dtype", "float32", "--batches", "1", "3", "--max-batch-size", "4",
                "--max-context", "256", "--rounds", "2", "--repeats", "2")
    load = next(ln for ln in out.splitlines() if ln.startswith("| tiny | float32 | torch |")
                and ln.endswith("MiB |"))
    assert load.split("|")[5].strip() == "15"       # 3 batch buckets x 5 width buckets
    rounds = [ln.split("|") for ln in out.splitlines()
              if ln.startswith("| tiny | float32 | torch |") and "x |" in ln]
    assert [r[4].strip() for r in rounds] == ["1", "3"]
    assert all(float(r[8]) < 1e-5 for r in rounds), rounds


def test_bench_capture_refuses_rounds_past_its_buckets():
    with pytest.raises(SystemExit, match="raise those or lower --batches and --context"):
        main(["bench", "capture", "--device", "cpu", "--models", "tiny", "--batches", "8",
              "--max-batch-size", "4"])
    with pytest.raises(SystemExit, match="--attention flashinfer needs --device cuda"):
        main(["bench", "capture", "--device", "cpu", "--attention", "flashinfer"])


def test_bench_transfer(capsys, monkeypatch):
    from pdserve.benchmarks.transfer import handoff

    # the benchmark's two pools, shrunk (the report quotes the 128-page row of
    # the "llama-3-8b" pool, so that name and size stay)
    monkeypatch.setattr(handoff, "POOLS", {
        "tiny": dict(shape=(2, 2, 4, 2, 8), dtype="float32", pages=64, sizes=(1, 16)),
        "llama-3-8b": dict(shape=(2, 2, 4, 2, 8), dtype="bfloat16", pages=256, sizes=(128,)),
    })
    out = bench(capsys, "transfer")
    assert "handoff_vs_raw_nixl=" in out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["tiny"], ["llama-3-8b"])]
    assert [(r[0], r[1]) for r in rows] == [("tiny", "1"), ("tiny", "16"), ("llama-3-8b", "128")]


def test_bench_serve(capsys, tmp_path):
    """Both client APIs against `pdserve up` in a child process: every
    request streams all its tokens."""
    res = tmp_path / "serve.json"
    bench(capsys, "serve", "--config", TINY_CFG, "--api", "grpc", "http", "--requests", "4",
          "--concurrency", "2", "--max-tokens", "4", "--prompt-len", "8", "--out", str(res))
    rows = json.loads(res.read_text())
    assert sorted(rows) == [f"{TINY_CFG} [grpc]", f"{TINY_CFG} [http]"]
    for row in rows.values():
        assert row["ok"] == 4 and row["failed"] == 0 and row["errors"] == []
        assert row["output_tok_per_s"] * row["wall_s"] == pytest.approx(16)


def test_bench_serve_says_why_a_deployment_did_not_start(tmp_path):
    from pdserve.benchmarks.common.processes import served

    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {fused: 1}\nmodel: {preset: no-such-model}\n")
    with pytest.raises(RuntimeError, match="exited with 2") as e:
        with served(str(bad)):
            pass
    assert "no-such-model" in str(e.value)


def test_bench_cache_groups(capsys):
    """At 32K a Gemma 3 27B request holds within 2 points of the ideal
    share of every-layer KV, and the planner admits exactly as many
    requests as the page arithmetic says the pools hold."""
    out = bench(capsys, "cache-groups", "--trace", TRACE, "--limit", "5")
    cols = next(ln.split() for ln in out.splitlines() if ln.split()[:2] == ["32K", "sliding"])
    ratio, ideal = float(cols[7].rstrip("%")), float(cols[8].rstrip("%"))
    assert abs(ratio - ideal) <= 2.0, cols
    assert cols[11] == cols[12], cols                  # most requests == planner peak
    assert "sliding" in out.split("requests of")[1]    # the simulated trace ran too


def test_bench_loop(capsys):
    out = bench(capsys, "loop", "--batches", "2", "--max-tokens", "8")
    rows = [ln.split("|")[1].strip() for ln in out.splitlines() if ln.startswith("| ")]
    assert "2" in rows


def test_bench_sampling(capsys):
    from pdserve.benchmarks.kernels.sampling import KINDS

    out = bench(capsys, "sampling", "--batches", "3", "--repeats", "1")
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in out.splitlines()
            if ln.startswith("| ") and ln.split("|")[2].strip() == "3"]
    # SmolLM2's real logits and the tiny preset's, every kind, both samplers timed
    assert [r[0] for r in rows] == ["smollm2-135m (49,152)"] * len(KINDS) + \
        ["tiny (98)"] * len(KINDS)
    assert [r[2] for r in rows] == list(KINDS) * 2
    assert all(r[5].endswith("x") and float(r[5][:-1]) >= 0 for r in rows)  # "0.00x" on a loaded host


def test_bench_tokens(capsys):
    out = bench(capsys, "tokens", "--lengths", "16", "48", "--model", "tiny")
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["16"], ["48"])]
    assert [r[0] for r in rows] == ["16", "48"]
    # loop now, output thread, loop before, before/now, router gRPC, router HTTP
    assert all(len(r) == 7 and r[-1].endswith("us") and r[-2].endswith("us") for r in rows)
    assert all(float(r[-1][:-2]) > 0 and float(r[-2][:-2]) > 0 for r in rows)


def test_router_cost_streams_every_token_through_a_real_router():
    """The router rows time a real Router's stream and front: each token an
    event, each event a message out (it raises if a token went missing)."""
    from pdserve.benchmarks.serving.tokens import _router_now
    from pdserve.text.tokenizer import PrintableTokenizer

    tok = PrintableTokenizer()
    ids = tok.encode("disaggregated serving", add_special_tokens=False)
    for front in ("grpc", "http"):
        assert _router_now(tok, ids, front) > 0


@pytest.mark.slow
@pytest.mark.chaos
def test_bench_soak(capsys):
    out = bench(capsys, "soak", "--seconds", "8", "--concurrency", "4", "--seed", "1")
    assert "soak: PASS" in out


def test_offline_rate_runs_at_the_served_concurrency(monkeypatch):
    """`bench serve --offline` runs the same requests through pdserve.LLM
    with at most --concurrency at once (the served closed loop's cap),
    --repeats times; the median run stands for it."""
    from pdserve import llm
    from pdserve.benchmarks.serving import serve

    batches = []

    class Recorded(llm.LLM):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            step = self.engine.step

            def counted():
                out = step()
                if out is not None:
                    batches.append(len(out.plan.decodes))
                return out
            self.engine.step = counted
    monkeypatch.setattr(llm, "LLM", Recorded)
    from pdserve.sim.load import workload

    samples = workload(6, 8, 5, None, None, 1024, 0)
    threads = torch.get_num_threads()
    r = serve.run_offline(TINY_CFG, samples, 0, concurrency=2, repeats=3)
    assert r["ok"] == 6 and r["output_tok_per_s"] * r["wall_s"] == pytest.approx(30)
    assert max(batches) == 2
    # its TPOT is the engine's median decode-only round, the served rows' floor
    assert 0 < r["tpot_s"]["p50"] <= r["tpot_s"]["p99"] < r["wall_s"]
    assert torch.get_num_threads() == threads        # the served count, then put back
    runs = r["tok_per_s_runs"]
    assert len(runs) == 3 and runs == sorted(runs) and r["output_tok_per_s"] == runs[1]


def test_bench_spec(capsys):
    """The tiny preset, a few tokens: the table's rows, and greedy outputs
    that agree with speculation off (float32)."""
    out = bench(capsys, "spec", "--preset", "tiny", "--dtype", "float32", "--ks", "2",
                "--concurrency", "1,2", "--requests", "1", "--max-tokens", "8", "--repeats",
                "1", "--pd")
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in out.splitlines()
            if ln.startswith("| ") and not ln.startswith("| case") and "---" not in ln
            and not ln.startswith("| engine")]
    cases = [r for r in rows if r[0] in ("off", "ngram k=2") and len(r) == 11]
    assert [r[0] for r in cases] == ["off", "ngram k=2"] * 2
    assert all(r[-1].split("/")[0] == r[-1].split("/")[1] for r in cases)
    # the gate's rounds beside each table: decode-only rounds by batch bucket
    gate = [r for r in rows if r[0] == "ngram k=2" and len(r) == 9]
    assert gate and all(int(r[2]) + int(r[3]) > 0 for r in gate)
    assert "The gate's rounds" in out
    pd = [r for r in rows if r[0] in ("fused", "P/D")]
    assert [r[0] for r in pd] == ["fused", "P/D"]


def test_bench_disk(capsys):
    out = bench(capsys, "disk", "--preset", "tiny", "--conversations", "2", "--turns", "2",
                "--turn-tokens", "32", "--repeats", "1")
    for row in ("host alone (A) vs host + disk (B)", "one FIFO worker (before)",
                "cold (A) vs warm (B)", "tier off (A) vs on (B)"):
        assert row in out


def test_bench_disk_read_behind_writes(capsys):
    out = bench(capsys, "disk", "--only", "read-behind-writes", "--backlog", "4",
                "--page-kib", "16", "--repeats", "2")
    assert "one FIFO worker (before)" in out and "separate lanes" in out


@pytest.mark.slow                          # ~2 min: SmolLM2 loaded seven ways
def test_bench_quantized(capsys):
    from pdserve.kernels.cpu.native import native_kernels

    out = bench(capsys, "quantized", "--batches", "1", "--rounds", "1", "--repeats", "1",
                "--context", "16")
    rows = {ln.split("|")[2].strip(): ln for ln in out.splitlines()
            if ln.startswith("| 1 |")}
    quantized = {"quantized float32, torch kernels", "quantized bfloat16, torch kernels"}
    if native_kernels().lib:
        quantized |= {"quantized float32, pdserve layer", "quantized bfloat16, pdserve layer",
                      "quantized bfloat16, pdserve ops"}
    assert set(rows) == {"float32", "bfloat16"} | quantized
    agree = [ln for ln in out.splitlines() if ln.startswith("| quantized ")]
    assert len(agree) == len(quantized)
    assert all(float(a.split("|")[2].strip().rstrip("%")) > 90 for a in agree)
