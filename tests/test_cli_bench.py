"""`pdserve bench NAME`: each benchmark parses its own options and no other's."""

import subprocess
import sys

import pytest

from pdserve.cluster.cli import BENCHMARKS, build_parser, main


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
    """Every benchmark module is imported to define its options: `pdserve
    --help` must not pay for torch or Ray."""
    code = ("import sys; from pdserve.cluster.cli import build_parser; build_parser(); "
            "print(sorted({'torch', 'ray', 'grpc'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_bench_state_capacity_prints_the_three_ways(capsys):
    assert main(["bench", "state-capacity", "--prompt", "32768"]) == 0
    rows = {ln.split()[1]: ln.split() for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("   32K")}
    assert set(rows) == {"snapshot", "vLLM-style", "every"}
    assert rows["snapshot"][-2:] == ["433", "3.36x"]
    assert rows["every"][-2:] == ["129", "1.00x"]
    assert int(rows["vLLM-style"][-2]) < 433
