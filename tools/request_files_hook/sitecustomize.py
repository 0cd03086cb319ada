"""tools/request_files.py's hook: which source files' code runs, per window.

Put this folder on PYTHONPATH and set RQF_DIR; every Python process that
starts with that environment (`pdserve up`, the Ray workers of the local
Ray it starts, Ray's own agents) then records, per window, the set of
files whose code ran in it. Without RQF_DIR it does nothing.

- A global trace function (sys.settrace and threading.settrace, not
  setprofile: a trace function that returns None is called once when a
  frame starts or a generator or coroutine resumes, and never for C calls,
  returns or lines, a third fewer calls than a profile function) adds the
  frame's file name to the open window's set; with no window open it only
  reads one global. Threads that C code starts (not `threading`) carry no
  trace function: a poller samples their stacks instead and reports them.
- A daemon thread polls RQF_DIR/ctl every 0.1 s: it holds "SEQ LABEL"
  (LABEL "-" closes the window). When a window closes, the process writes
  RQF_DIR/proc-PID.json: each window's files (under RQF_PKG only, the
  pdserve package the deployment should run, so the set is small), the
  pdserve files of any other tree that ran (a sign the wrong tree is
  imported), pdserve.__file__, its Ray actor's name and its threads.
- 0.1 s after it starts (not at once: Ray forks and then execs its
  non-Python servers) it writes RQF_DIR/hello-PID.json, so the tool knows
  which processes to wait for.

Then the next sitecustomize on sys.path, if there is one, runs as usual.
"""

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("RQF_DIR")
_PKG = os.environ.get("RQF_PKG", "")      # ".../src/pdserve/" of the tree measured
_cur = None                               # the open window's set of file names, or None
_windows: dict = {}
_uncovered: dict = {}                     # label -> pdserve files seen on untraced threads
_seq = 0
_label = "-"


def _trace(frame, event, arg):
    s = _cur
    if s is not None:
        s.add(frame.f_code.co_filename)
    # None: no line, return or exception events for this frame


def _write(path, obj):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _actor_name():
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        worker = ray._private.worker.global_worker
        if not ray.is_initialized() or worker.mode != ray.WORKER_MODE:
            return None                             # a driver: Ray would warn
        return ray.get_runtime_context().get_actor_name()
    except Exception:
        return None


def _dump():
    pkg = sys.modules.get("pdserve")
    mine, other = {}, set()
    for label, files in list(_windows.items()):
        got = [f for f in list(files) if f.startswith(_PKG)]
        mine[label] = sorted(f[len(_PKG):] for f in got)
        other.update(f for f in list(files)
                     if "/pdserve/" in f and not f.startswith(_PKG) and f.endswith(".py"))
    _write(os.path.join(_DIR, f"proc-{os.getpid()}.json"), {
        "pid": os.getpid(), "argv": sys.argv, "seq": _seq,
        "pdserve_file": getattr(pkg, "__file__", None),
        "actor": _actor_name(),
        "threads": sorted(t.name for t in threading.enumerate()),
        "windows": mine,
        "uncovered": {k: sorted(v) for k, v in _uncovered.items()},
        "other_pdserve": sorted(other)})


def _sample_untraced():
    """Files under the package on the stacks of threads `threading` did not
    start (they carry no trace function)."""
    active = threading._active                      # ident -> Thread
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        t = active.get(ident)
        if ident == me or (t is not None and not isinstance(t, threading._DummyThread)):
            continue
        while frame is not None:
            f = frame.f_code.co_filename
            if f.startswith(_PKG):
                _uncovered.setdefault(_label, set()).add(f[len(_PKG):])
            frame = frame.f_back


def _hello():
    try:
        _write(os.path.join(_DIR, f"hello-{os.getpid()}.json"),
               {"pid": os.getpid(), "argv": sys.argv, "executable": sys.executable})
    except OSError:
        pass


def _poll():
    global _cur, _seq, _label
    ctl = os.path.join(_DIR, "ctl")
    mtime = None
    time.sleep(0.1)
    _hello()            # not at once: a fork that execs another program says nothing
    while True:
        time.sleep(0.1)
        try:
            m = os.stat(ctl).st_mtime_ns
            if m != mtime:
                mtime = m
                with open(ctl) as f:
                    seq, label = f.read().split()
                seq = int(seq)
                if seq > _seq:
                    was = _label
                    _seq, _label = seq, label
                    _cur = None if label == "-" else _windows.setdefault(label, set())
                    if label == "-" or was != "-":
                        _dump()
            if _cur is not None:
                _sample_untraced()
        except (OSError, ValueError):
            pass
        except Exception as e:                      # never take the process down
            try:
                sys.stderr.write(f"request_files hook: {type(e).__name__}: {e}\n")
            except Exception:
                pass


def _start_poller():
    threading.Thread(target=_poll, name="request-files-poll", daemon=True).start()


def _install():
    _start_poller()                                 # before settrace: the poller is not traced
    sys.settrace(_trace)
    threading.settrace(_trace)

    def after_fork():
        global _windows, _uncovered, _cur, _seq, _label
        _windows, _uncovered, _cur, _seq, _label = {}, {}, None, 0, "-"
        _start_poller()
    os.register_at_fork(after_in_child=after_fork)


def _chain():
    """Run the sitecustomize this one hides, if any."""
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)


if _DIR and _PKG and os.path.isdir(_DIR):
    _install()
try:
    _chain()
except Exception as e:
    sys.stderr.write(f"request_files hook: the next sitecustomize failed: {e}\n")
