"""An LLM holds what it started until close(), the end of its `with`
block, or its collection: `del llm` then a new tensor-parallel LLM works
in one process (a notebook, a test module). A tensor-parallel engine's
ranks are spawned, and each re-runs the program's main module: a program
they cannot re-run, or one that would make its LLM again there, is an
error that names the `if __name__ == "__main__":` guard."""

from __future__ import annotations

import subprocess
import sys
import types
import weakref

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.tp.main_module import (
    GUARD, MainModuleError, check_main_module, exited_before_start, rerun_path)

TP2 = dict(dtype="float32", attention="torch", tensor_parallel_size=2, page_size=4,
           total_pages=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["hello there", "a"]
SCRIPT = """
from pdserve import LLM
LLM(tensor_parallel_size=2, page_size=4, total_pages=64)
print("made")
"""


def _tokens(llm: LLM) -> list:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_a_tp_llm_only_deleted_leaves_the_next_one_its_process_group():
    first = LLM(**TP2)
    want = _tokens(first)
    ranks = list(first.model.procs)
    gone = weakref.ref(first)
    del first
    assert gone() is None                       # freed by the del alone: no cycle holds it
    assert all(p.exitcode is not None for p in ranks)
    second = LLM(**TP2)
    try:
        assert _tokens(second) == want
    finally:
        second.close()


def test_a_with_block_closes_its_llm_and_one_open_keeps_the_group_by_name():
    with LLM(**TP2) as llm:
        with pytest.raises(ValueError, match="default process group is in use in this process "
                                             r"\(another tensor-parallel LLM still open"):
            LLM(**TP2)
        ranks = list(llm.model.procs)
    assert all(p.exitcode is not None for p in ranks)
    llm.close()                                 # a second close does nothing


def test_a_program_read_from_stdin_is_refused_before_any_rank_is_spawned():
    run = subprocess.run([sys.executable, "-"], input=SCRIPT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0 and "made" not in run.stdout
    assert "MainModuleError" in run.stderr and "read from stdin, not a file" in run.stderr
    assert GUARD in run.stderr
    assert "FileNotFoundError" not in run.stderr


def test_a_script_without_the_guard_fails_at_once_naming_it(tmp_path):
    """The rank re-runs the script, which makes the LLM again; Python
    refuses that in the rank, and rank 0 says why instead of waiting in the
    group for a rank that is gone."""
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode != 0 and "made" not in run.stdout
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve.engine.tp.main_module.MainModuleError: tensor-parallel rank 1")
    assert f"re-runs this program's main module ({script})" in last and GUARD in last


def test_only_a_main_module_run_from_a_file_that_is_gone_is_refused(tmp_path):
    def main(file=None, spec=None) -> types.ModuleType:
        m = types.ModuleType("__main__")
        m.__spec__ = spec
        if file is not None:
            m.__file__ = file
        return m
    there = tmp_path / "there.py"
    there.write_text("")
    check_main_module(2, main())                            # python -c, a notebook
    check_main_module(2, main(str(there)))
    by_name = types.SimpleNamespace(name="mypkg.run")       # python -m: imported by name
    check_main_module(2, main(str(tmp_path / "gone.py"), by_name))
    with pytest.raises(MainModuleError, match=f"its file {tmp_path / 'gone.py'} is not there"):
        check_main_module(2, main(str(tmp_path / "gone.py")))
    assert rerun_path(main()) is None
    # without a file re-run, a rank that exits as it starts is no guard's doing
    assert not isinstance(exited_before_start(1, 7, 1, main()), MainModuleError)
