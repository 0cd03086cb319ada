"""`pdserve bench NAME`: each benchmark parses its own options and no other's."""

import subprocess
import sys

import pytest

from pdserve.cli.bench import BENCHMARKS
from pdserve.cli.main import COMMANDS, build_parser, main


def test_an_option_of_another_benchmark_is_refused(capsys):
    """--sizes is the planner's: serve does not take it."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "serve", "--config", "x.yaml", "--sizes", "8"])
    assert e.value.code == 2
    assert "unrecognized arguments: --sizes 8" in capsys.readouterr().err


def test_bench_help_lists_every_benchmark(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "--help"])
    assert e.value.code == 0
    listed = {ln.split()[0] for ln in capsys.readouterr().out.splitlines()
              if ln.startswith("    ") and ln.split()}
    assert listed >= {"planner", "retraction", "disagg", "llm", "transfer", "serve", "soak",
                      "tokens", "cache-groups", "sim-accuracy", "autoscale", "loop"}
    assert listed >= {name for name, _, _ in BENCHMARKS}


def test_a_benchmark_is_required(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv, needs", [
    (["serve"], "bench serve needs --address HOST:PORT or --config FILE"),
    (["sim-accuracy", "--config", "x.yaml"], "bench sim-accuracy needs --config (repeatable) "
                                             "or --replay, and --profile"),
    (["disagg", "--config", "x.yaml"], "bench disagg needs --config and --trace"),
    (["retraction", "--trace", "t.jsonl"], "bench retraction needs --config and --trace"),
])
def test_options_argparse_cannot_check_are_named_before_anything_runs(capsys, argv, needs):
    assert main(["bench", *argv]) == 2
    assert needs in capsys.readouterr().err


def test_building_the_parser_loads_no_torch_or_ray():
    """`pdserve --help` must not pay for torch or Ray."""
    code = ("import sys; from pdserve.cli.main import build_parser; build_parser(); "
            "print(sorted({'torch', 'ray', 'grpc'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def _modules_after(argvs: list[list[str]]) -> list[str]:
    """The modules a fresh interpreter holds after parsing each argv (each
    ends in --help) with one parser: what those commands cost to start."""
    code = ("import contextlib, io, sys; from pdserve.cli.main import build_parser\n"
            f"for argv in {argvs!r}:\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        build_parser().parse_args(argv)\n"
            "print(' '.join(sorted(sys.modules)))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.split()


def test_pdserve_up_imports_no_benchmark():
    """A command's parser is built from its own module: `pdserve up` does not
    import the benchmarks to define options it never takes (their shared
    option helpers in benchmarks/common/options.py aside)."""
    loaded = _modules_after([["up", "--help"]])
    assert "pdserve.cli.up" in loaded
    assert [m for m in loaded if m.startswith("pdserve.benchmarks.")] == \
        ["pdserve.benchmarks.common", "pdserve.benchmarks.common.options"]


def test_bench_name_imports_only_that_benchmark():
    loaded = set(_modules_after([["bench", "planner", "--help"]]))
    assert {b.module for b in BENCHMARKS} & loaded == \
        {"pdserve.benchmarks.planner.build_cost"}


def test_every_command_s_and_benchmark_s_help_loads_no_torch_or_ray():
    """Defining a command's options imports its module and no more: torch,
    Ray and gRPC wait for the command to run."""
    argvs = [[c.name, "--help"] for c in COMMANDS if c.name != "bench"]
    argvs += [["bench", b.name, "--help"] for b in BENCHMARKS]
    loaded = _modules_after(argvs)
    assert {"pdserve.cli.up", "pdserve.benchmarks.engine.loop"} <= set(loaded)
    assert sorted({"torch", "ray", "grpc"} & set(loaded)) == []


def test_bench_state_capacity_prints_the_three_ways(capsys):
    assert main(["bench", "state-capacity", "--prompt", "32768"]) == 0
    rows = {ln.split()[1]: ln.split() for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("   32K")}
    assert set(rows) == {"snapshot", "vLLM-style", "every"}
    assert rows["snapshot"][-2:] == ["433", "3.36x"]
    assert rows["every"][-2:] == ["129", "1.00x"]
    assert int(rows["vLLM-style"][-2]) < 433


def test_bench_state_reuse_hits_only_with_checkpoints_and_never_past_the_trace_s_reuse(capsys):
    assert main(["bench", "state-reuse", "--limit", "60"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()
            if ln.split()[:1] in (["ideal"], ["fused"], ["1P+1D"])]

    def hit(engines, ckpts, side):
        (row,) = [r for r in rows if r[:3] == [engines, ckpts, side]]
        return int(row[4].replace(",", ""))
    ideal = int(rows[0][2].replace(",", ""))
    assert ideal > 0
    assert hit("fused", "off", "fused") == hit("1P+1D", "off", "P") == 0
    assert 0 < hit("fused", "on", "fused") <= ideal
    assert 0 < hit("1P+1D", "on", "P") <= ideal
    # D's K/V hit does not depend on state checkpoints: P sends the state anyway
    assert hit("1P+1D", "on", "D") == hit("1P+1D", "off", "D") > 0


def test_bench_state_reuse_real_hits_on_cpu_and_answers_the_same(capsys):
    from pdserve.benchmarks.cache.state_reuse import real

    assert real(block=64, convs=1, turns=2, answer=2) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()
            if ln.split()[:1] in (["on"], ["off"])]
    assert {r[0]: int(r[2].replace(",", "")) for r in rows} == {"off": 0, "on": 192}
