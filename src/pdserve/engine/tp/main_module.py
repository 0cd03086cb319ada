"""What a tensor-parallel engine's spawned ranks need of the program that
started them. Python's spawn start method (the one CUDA allows) starts a
child by re-running the parent's main module, named `__mp_main__`: its file,
or under `python -m` its module. So a script read from stdin (`python -
<<EOF`) cannot start a rank at all (there is no file to re-run), and a
script that makes its LLM at its top level, outside `if __name__ ==
"__main__":`, makes it again in each rank, which Python refuses there. Both
fail in the child, where the user sees a FileNotFoundError or a rank that
exited; these say why, in the parent.
"""

from __future__ import annotations

import os
import sys
from multiprocessing import process
from types import ModuleType

from pdserve.kernels.tensor_parallel import TpError

GUARD = 'if __name__ == "__main__":'


class MainModuleError(TpError):
    """The ranks cannot re-run this program's main module."""


def rerun_path(main: ModuleType | None = None) -> str | None:
    """The file a spawned child re-runs for `main` (default: this process's
    `__main__`), as multiprocessing finds it; None where it re-runs none (an
    interactive session, `python -c`, a notebook) or imports a module by
    name (`python -m`)."""
    main = main if main is not None else sys.modules["__main__"]
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return None
    path = getattr(main, "__file__", None)
    if path is None:
        return None
    start = getattr(process, "ORIGINAL_DIR", None)    # the cwd at start: not in the stubs
    if not os.path.isabs(path) and start is not None:
        path = os.path.join(start, path)
    return os.path.normpath(path)


def check_main_module(size: int, main: ModuleType | None = None) -> None:
    """Refuse, before any rank is spawned, a main module the ranks cannot
    re-run (its file is gone, or it never was one: stdin)."""
    path = rerun_path(main)
    if path is None or os.path.isfile(path):
        return
    name = os.path.basename(path)
    why = ("it was read from stdin, not a file" if name == "<stdin>"
           else f"its file {path} is not there to re-run")
    raise MainModuleError(
        f"tensor_parallel_size {size} starts {size - 1} more rank(s) as spawned processes, "
        f"and each first re-runs this program's main module, which they cannot: {why}. "
        f"Save the program as a file, make the LLM under `{GUARD}`, and run the file")


def exited_before_start(rank: int, pid: int | None, exitcode: int | None,
                        main: ModuleType | None = None) -> MainModuleError | TpError:
    """The error for a rank that exited before it started (before its
    TpStarted, while its process re-ran the program's main module). Where
    the ranks re-run a script, the likeliest cause is a script without the
    guard: the rank made the LLM again and Python refused it."""
    head = (f"tensor-parallel rank {rank} (pid {pid}) exited with code {exitcode} as it "
            "started (its own error is above, on stderr)")
    path = rerun_path(main)
    if path is None:
        return TpError(head)
    return MainModuleError(
        f"{head}. Each rank first re-runs this program's main module ({path}); a script "
        f"that makes a tensor-parallel LLM outside `{GUARD}` makes it again there, where "
        "Python refuses to start more processes: put that code under the guard")
