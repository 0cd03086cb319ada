"""Building and choosing pdserve's own CPU kernels (kernels/cpu/native.py): a
build reused by its text, a failed one that says why, engines building at
once, and the choice between them and torch's kernels."""

import os
import subprocess
import sys

import pytest

from pdserve.kernels.cpu import native
from pdserve.kernels.cpu.native import KERNELS_ENV, build, chosen_kernels, native_kernels

LIB = native_kernels().lib


def test_a_build_is_reused_and_a_failed_one_says_why(tmp_path, monkeypatch):
    src = tmp_path / "k.c"
    src.write_text("int pd_one(void) { return 1; }\n")
    out = tmp_path / "cache"
    first = build((src,), out)
    stamp = first.stat().st_mtime_ns
    assert build((src,), out) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in out.iterdir()] == [first.name]   # no temporary left behind
    src.write_text("int pd_one(void) { return 2; }\n")
    assert build((src,), out) != first                           # new text, new library
    src.write_text("this is not C\n")
    with pytest.raises(RuntimeError, match="failed"):
        build((src,), out)
    assert len(list(out.iterdir())) == 2
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    src.write_text("int pd_two(void) { return 2; }\n")
    with pytest.raises((RuntimeError, OSError)):
        build((src,), out)


def test_the_choice_of_kernels(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "torch")
    assert chosen_kernels().lib is None and "torch" in chosen_kernels().why
    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="auto, native or torch"):
        chosen_kernels()
    monkeypatch.setenv(KERNELS_ENV, "native")
    if LIB is None:
        with pytest.raises(ValueError, match="unset it"):
            chosen_kernels()
    else:
        assert chosen_kernels().lib is not None
    monkeypatch.delenv(KERNELS_ENV)
    assert chosen_kernels() is native_kernels()


def test_a_cpu_without_avx2_gets_torchs_kernels(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: {"sse2"})
    native_kernels.cache_clear()
    try:
        found = native_kernels()
        assert found.lib is None and "avx2 and fma" in found.why
    finally:
        native_kernels.cache_clear()


def test_engines_starting_together_build_one_library(tmp_path):
    """Processes building at once (engines on one host) all end with the
    same working library."""
    code = ("import sys; from pathlib import Path; from pdserve.kernels.cpu.native import "
            "build, SOURCES; print(build(SOURCES, Path(sys.argv[1])))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "..", "src"), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outs) == 1 and [p.name for p in tmp_path.iterdir()] == [os.path.basename(outs.pop())]
