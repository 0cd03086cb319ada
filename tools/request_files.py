"""Files a request crosses: every pdserve source file whose code runs while
one streamed chat request is served, per process (router, P, D).

    .venv/bin/python tools/request_files.py                  # this checkout's src/
    .venv/bin/python tools/request_files.py --rev 328a5be^   # a commit (git archive into /tmp)
    .venv/bin/python tools/request_files.py --src DIR --json # a tree's src/ folder; JSON out

It starts `pdserve up` (SmolLM2-135M, 1 prefill + 1 decode engine, a
small max-model-len, an OpenAI HTTP port; the tiny random-weights preset
has no chat template, so chat completions refuse it) in a child process, on a local
Ray of its own (RAY_TMPDIR in a fresh temp folder, free ports), with
PYTHONPATH = DIR, then tools/request_files_hook/. The hook's
sitecustomize.py runs in every Python process that starts with that
environment (`pdserve up`, which also hosts the router, and the Ray
workers, which inherit the local Ray's environment) and records which
files' code runs in each window the tool opens (a trace function that adds
the frame's file to a set; see the hook's docstring).

- A warm-up request first (one-time work, such as lazy imports, is not the
  request's), then a pause.
- Window B: idle, T seconds.
- Window A: one streamed chat completion (the official `openai` client,
  greedy, max_tokens 16), from 0.3 s before it is sent to TAIL seconds
  after its last chunk (what the engines do once the stream has ended,
  such as P freeing the pages D acknowledged), at least T seconds long.

A's files are the request's; the tables mark those that ran in B too (idle
loops, polls). The model's forward and generated code are counted apart:
src/pdserve/kernels/models/ (the model families, their loader and config),
src/pdserve/kernels/cpu/ (the C kernels' drivers) and proto/*_pb2*.py. In
an older tree a file is placed by where it lives at this checkout's HEAD
(git's rename detection between the two commits), so kernels/gemma3.py of
an older commit is excluded as kernels/models/gemma3.py is.

The tool imports no pdserve module: it measures whatever tree --src names,
and checks that every process imported pdserve from there. It stops
everything it started (by process id) and removes its temp folder. About a
minute on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
HOOK = REPO / "tools" / "request_files_hook"
PROMPT = "What is the capital of France?"
MAX_MODEL_LEN = 256
# what `pdserve up MODEL --prefill 1 --decode 1 --max-model-len 256` runs, for
# a tree whose `up` has no model flags (it takes a config only)
CONFIG = """model: {model}
engine:
  page_size: 16
  total_pages: 1024
  max_scheduled_tokens: 256
  max_batch_size: 64
  max_context_tokens: {max_model_len}
cluster: {{prefill: 1, decode: 1}}
"""


def log(msg: str) -> None:
    print(f"request_files: {msg}", file=sys.stderr, flush=True)


def excluded(rel: str) -> str | None:
    """Why a file (its path under src/pdserve at HEAD's layout) is counted
    apart, or None."""
    if rel.startswith("kernels/models/"):
        return "model"
    if rel.startswith("kernels/cpu/"):
        return "cpu kernels"
    if re.fullmatch(r"proto/[^/]*_pb2[^/]*\.py", rel):
        return "generated"
    return None


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def renames_to_head(commit: str | None) -> dict[str, str]:
    """Paths under src/pdserve at `commit` -> their path at REPO's HEAD, where
    git sees a rename ({} for HEAD itself or an unknown commit)."""
    head = git("rev-parse", "HEAD").strip()
    if not commit or commit == head:
        return {}
    out = git("diff", "-M", "--name-status", "-z", commit, head, "--", "src/pdserve")
    parts = out.split("\0")
    moved, i = {}, 0
    while i < len(parts) and parts[i]:
        status = parts[i]
        if status.startswith(("R", "C")):
            old, new = parts[i + 1], parts[i + 2]
            i += 3
            if status.startswith("R"):
                moved[old.removeprefix("src/pdserve/")] = new.removeprefix("src/pdserve/")
        else:
            i += 2
    return moved


def tree_of(args, tmp: Path) -> tuple[Path, str | None, str]:
    """(the src folder to run, its commit or None, a label)."""
    if args.rev:
        commit = git("rev-parse", "--verify", f"{args.rev}^{{commit}}").strip()
        dest = tmp / "tree"
        dest.mkdir()
        archive = subprocess.run(["git", "archive", commit, "src"], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return dest / "src", commit, f"{args.rev} ({commit[:9]})"
    src = Path(args.src).resolve() if args.src else REPO / "src"
    if not (src / "pdserve" / "__init__.py").is_file():
        sys.exit(f"request_files: {src} holds no pdserve package (give a tree's src/ folder)")
    try:
        commit = git("rev-parse", "HEAD", cwd=src).strip()
        dirty = bool(git("status", "--porcelain", "--", ".", cwd=src).strip())
    except subprocess.CalledProcessError:
        if src != REPO / "src":
            log(f"{src} is not in a git checkout: files are excluded by the paths they "
                "have there, with no rename to HEAD's layout (an older tree: use --rev)")
        return src, None, str(src)
    return src, commit, f"{src} at {commit[:9]}{' with uncommitted edits' if dirty else ''}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def up_command(src: Path, tmp: Path, model: str, port: int, http_port: int) -> list[str]:
    """`pdserve up` as a user types it: the model flags where this tree's
    `up` has them, else the equivalent config file."""
    script = Path(sys.executable).with_name("pdserve")
    cmd = [str(script)] if script.is_file() else [
        sys.executable, "-c", "import sys; from pdserve.cli.main import main; sys.exit(main())"]
    cmd += ["up"]
    has_flags = any("--max-model-len" in p.read_text(errors="replace")
                    for p in (src / "pdserve").rglob("*.py") if "cli" in p.parts
                    or "benchmarks" in p.parts)
    if has_flags:
        cmd += [model, "--prefill", "1", "--decode", "1", "--max-model-len", str(MAX_MODEL_LEN)]
    else:
        key = "path" if "/" in model or model.endswith(".gguf") else "preset"
        (tmp / "pd.yaml").write_text(CONFIG.format(model=json.dumps({key: model}),
                                                   max_model_len=MAX_MODEL_LEN))
        cmd += ["--config", str(tmp / "pd.yaml")]
    return cmd + ["--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port)]


class Deployment:
    def __init__(self, src: Path, tmp: Path, model: str):
        self.tmp = tmp
        self.hook_dir = tmp / "hook"
        self.hook_dir.mkdir()
        self.pkg = str(src.resolve() / "pdserve") + "/"
        self.http_port = free_port()
        self.cmd = up_command(src, tmp, model, free_port(), self.http_port)
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "RAY_ADDRESS", "PDSERVE_API_KEY")}
        env.update(PYTHONPATH=f"{src.resolve()}{os.pathsep}{HOOK}", RQF_DIR=str(self.hook_dir),
                   RQF_PKG=self.pkg, RAY_TMPDIR=str(tmp / "ray"), RAY_USAGE_STATS_ENABLED="0",
                   PYTHONUNBUFFERED="1")
        (tmp / "ray").mkdir()
        self.out_path = tmp / "up.log"
        self.out = open(self.out_path, "w")
        self.seq = 0
        self.ctl("-")
        log("$ " + " ".join(self.cmd))
        self.proc = subprocess.Popen(self.cmd, cwd=tmp, env=env, stdout=self.out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.known: dict[int, float] = {}           # pid -> create time, all we started

    def remember(self) -> None:
        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for p in self.hook_dir.glob("hello-*.json"):
            try:
                procs.append(psutil.Process(json.loads(p.read_text())["pid"]))
            except (psutil.NoSuchProcess, ValueError, KeyError):
                pass
        for p in procs:
            try:
                self.known.setdefault(p.pid, p.create_time())
            except psutil.NoSuchProcess:
                pass

    def wait_serving(self, timeout: float) -> None:
        end = time.time() + timeout
        while time.time() < end:
            self.remember()
            if "pdserve: serving" in self.out_path.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        tail = self.out_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"`pdserve up` did not start serving (exit {self.proc.poll()}):\n"
                           f"{tail}")

    def ctl(self, label: str) -> None:
        self.seq += 1
        tmp = self.hook_dir / "ctl.tmp"
        tmp.write_text(f"{self.seq} {label}\n")
        os.replace(tmp, self.hook_dir / "ctl")

    def hellos(self) -> dict[int, dict]:
        out = {}
        for p in self.hook_dir.glob("hello-*.json"):
            try:
                d = json.loads(p.read_text())
                out[d["pid"]] = d
            except (ValueError, KeyError, OSError):
                pass
        return out

    def collect(self, timeout: float = 10.0) -> tuple[list[dict], list[int]]:
        """Every live hooked process's record once it has seen the last
        window close; and the pids that did not answer."""
        end = time.time() + timeout
        while True:
            records, missing = [], []
            for pid in self.hellos():
                f = self.hook_dir / f"proc-{pid}.json"
                rec = None
                if f.exists():
                    try:
                        rec = json.loads(f.read_text())
                    except ValueError:
                        pass
                if rec is not None and rec["seq"] >= self.seq:
                    records.append(rec)
                elif psutil.pid_exists(pid):
                    missing.append(pid)
            if not missing or time.time() > end:
                return records, missing
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM to `pdserve up` (it drains and stops Ray), then SIGKILL to
        every process of ours still there after a grace period."""
        self.remember()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        left = []
        for pid, created in self.known.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 0.01:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=10)
        if self.proc.poll() is None:
            self.proc.wait(5)
        self.out.close()


def stream_once(client, model: str, max_tokens: int) -> tuple[float, int, str | None]:
    t = time.perf_counter()
    chunks, finish = 0, None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], stream=True,
            max_tokens=max_tokens, temperature=0):
        chunks += 1
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return time.perf_counter() - t, chunks, finish


def role_of(rec: dict, router_pid: int) -> str:
    if rec["pid"] == router_pid:
        return "router"
    actor = rec.get("actor") or ""
    names = " ".join([actor, *rec.get("threads", [])])
    for key, role in (("prefill", "P"), ("decode", "D"), ("fused", "fused")):
        if key in names:
            return role
    return "other"


def measure(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="rqf-", dir="/tmp"))   # short: Ray's socket paths
    dep = None
    try:
        src, commit, label = tree_of(args, tmp)
        moved = renames_to_head(commit)
        log(f"measuring {label}")
        dep = Deployment(src, tmp, args.model)
        t0 = time.time()
        dep.wait_serving(args.start_timeout)
        log(f"serving after {time.time() - t0:.1f} s")
        from openai import OpenAI
        client = OpenAI(base_url=f"http://127.0.0.1:{dep.http_port}/v1", api_key="none",
                        max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        warm, _, _ = stream_once(client, model, args.max_tokens)
        log(f"warm-up request: {warm:.2f} s")
        time.sleep(1.5)
        window = max(args.min_window, 0.3 + 2 * warm + args.tail)
        dep.ctl("B")
        time.sleep(window)
        dep.ctl("-")
        time.sleep(0.3)
        a0 = time.perf_counter()
        dep.ctl("A")
        time.sleep(0.3)                 # every poller (0.1 s) has opened A
        took, chunks, finish = stream_once(client, model, args.max_tokens)
        time.sleep(args.tail)
        time.sleep(max(0.0, window - (time.perf_counter() - a0)))
        dep.ctl("-")
        a_len = time.perf_counter() - a0
        log(f"request: {took:.2f} s, {chunks} chunks, finish_reason {finish}; "
            f"windows: B {window:.1f} s, A {a_len:.1f} s")
        records, missing = dep.collect()
        dep.remember()
        return report(records, missing, dep, src, commit, label, moved, dict(
            model=model, prompt=PROMPT, max_tokens=args.max_tokens, request_s=round(took, 3),
            chunks=chunks, finish_reason=finish, window_b_s=round(window, 2),
            window_a_s=round(a_len, 2), warmup_s=round(warm, 3)))
    finally:
        if dep is not None:
            dep.stop()
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def report(records, missing, dep, src, commit, label, moved, request) -> dict:
    warnings = []
    if missing:
        warnings.append(f"processes that never reported: {missing}")
    hooked = dep.hellos()
    roles: dict[str, dict] = {}
    imported: dict[str, int] = {}
    for rec in records:
        a, b = set(rec["windows"].get("A", [])), set(rec["windows"].get("B", []))
        pf = rec.get("pdserve_file")
        if pf:
            imported[pf] = imported.get(pf, 0) + 1
        if pf and not pf.startswith(dep.pkg):
            warnings.append(f"pid {rec['pid']} imported pdserve from {pf}, not {dep.pkg}")
        if rec.get("other_pdserve"):
            warnings.append(f"pid {rec['pid']} ran pdserve files of another tree: "
                            f"{rec['other_pdserve'][:5]}")
        for w, files in rec.get("uncovered", {}).items():
            warnings.append(f"pid {rec['pid']}: threads not started by `threading` (untraced) "
                            f"ran {files} in window {w}: sampled, not traced")
            if w == "A":
                a.update(files)
        if not a and not b:
            continue
        role = role_of(rec, dep.proc.pid)
        r = roles.setdefault(role, {"pids": [], "actors": [], "a": set(), "b": set()})
        r["pids"].append(rec["pid"])
        if rec.get("actor"):
            r["actors"].append(rec["actor"])
        r["a"] |= a
        r["b"] |= b
    for role in ("router", "P", "D"):
        if role not in roles:
            warnings.append(f"no {role} process reported any pdserve file: is the hook "
                            f"in every process? ({len(hooked)} processes started with it)")

    def entry(rel: str) -> dict:
        now = moved.get(rel, rel)
        e = {"file": rel, "excluded": excluded(now)}
        if now != rel:
            e["now"] = now
        return e

    def summary(a: set, b: set) -> dict:
        files = sorted(a)
        counted = [f for f in files if entry(f)["excluded"] is None]
        return {
            "files": len(counted),
            "folders": len({os.path.dirname(f) or "." for f in counted}),
            "idle_too": sum(1 for f in counted if f in b),
            "excluded": len(files) - len(counted),
            "list": [{**entry(f), "idle_too": f in b} for f in files],
        }

    order = [r for r in ("router", "P", "D", "fused", "other") if r in roles]
    out = {
        "tree": label, "src": str(src), "commit": commit, "request": request,
        "processes_hooked": len(hooked), "pdserve_imported_from": imported,
        "roles": {r: {"pids": roles[r]["pids"], "actors": roles[r]["actors"],
                      **summary(roles[r]["a"], roles[r]["b"])} for r in order},
        "warnings": warnings,
    }
    all_a = set().union(*(roles[r]["a"] for r in order)) if order else set()
    all_b = set().union(*(roles[r]["b"] for r in order)) if order else set()
    out["total"] = summary(all_a, all_b)
    out["total"]["idle_only_files"] = sorted(all_b - all_a)
    return out


def print_tables(out: dict) -> None:
    print(f"Files a request crosses: {out['tree']}")
    rq = out["request"]
    print(f"one streamed chat completion ({rq['model']}, max_tokens {rq['max_tokens']}, "
          f"greedy): {rq['request_s']} s, {rq['chunks']} chunks, finish {rq['finish_reason']}; "
          f"window A {rq['window_a_s']} s, idle window B {rq['window_b_s']} s just before")
    for f, n in out["pdserve_imported_from"].items():
        print(f"pdserve.__file__ in {n} of the {out['processes_hooked']} hooked processes: {f}")
    print("(* also ran in the idle window B; paths under src/pdserve)")
    for role, r in out["roles"].items():
        who = ", ".join(r["actors"]) or ", ".join(map(str, r["pids"]))
        print(f"\n== {role} ({who}): {r['files']} files in {r['folders']} folders "
              f"({r['idle_too']} also idle), {r['excluded']} excluded")
        for e in r["list"]:
            if e["excluded"] is None:
                print(f"  {'*' if e['idle_too'] else ' '} {e['file']}"
                      + (f"   (now {e['now']})" if "now" in e else ""))
        ex = [e for e in r["list"] if e["excluded"]]
        if ex:
            print("  excluded:")
            for e in ex:
                print(f"  {'*' if e['idle_too'] else ' '} {e['file']}   [{e['excluded']}]"
                      + (f"   (now {e['now']})" if "now" in e else ""))
    t = out["total"]
    print(f"\n== total (union of the roles): {t['files']} files in {t['folders']} folders "
          f"({t['idle_too']} also idle); {t['excluded']} excluded files counted apart")
    for role, r in out["roles"].items():
        print(f"   {role:6} {r['files']:3} files  {r['folders']:2} folders  "
              f"{r['excluded']:2} excluded  ({r['idle_too']} also idle)")
    for w in out["warnings"]:
        print(f"warning: {w}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--src", help="a tree's src/ folder whose pdserve to run (default: this "
                                 "checkout's src/)")
    g.add_argument("--rev", help="a commit of this repository: its src/ is extracted "
                                 "(git archive) into the temp folder and run")
    p.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    p.add_argument("--model", default="smollm2-135m",
                   help="the model served: a preset or a checkpoint (default smollm2-135m: "
                        "the tiny preset has no chat template, and chat completions "
                        "refuse it)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tail", type=float, default=1.0,
                   help="seconds window A stays open after the last chunk (1.0)")
    p.add_argument("--min-window", type=float, default=3.0,
                   help="the windows' least length in seconds (3.0)")
    p.add_argument("--start-timeout", type=float, default=150.0)
    p.add_argument("--keep", action="store_true", help="keep the temp folder (logs, records)")
    args = p.parse_args(argv)
    out = measure(args)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print_tables(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
