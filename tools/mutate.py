"""Hand mutation testing: would the suite let these one-line bugs land?

Each mutation below is a plausible bug in critical code: a file under
src/pdserve, its exact original text (found exactly once there), the text
that replaces it, and the test files that should catch it. For each, in a
copy of the tree (src/, tests/, deploy, pyproject.toml of HEAD, or of the
working tree with --worktree; the checkout itself is never touched), the
tool makes the one edit, runs those test files (`pytest -x -q`, the
default markers) and puts the file back. A failing test catches the
mutation; a run where every test passes means it survived: a bug the
suite would let through. It prints a table and exits 1 if any survived,
2 if the list has rotted (an original text not found exactly once, a test
file gone) or a run ended without a verdict (a test file failed to
collect: the tree is broken, not the mutant caught).

    make mutate                                   # every mutation, on HEAD
    .venv/bin/python tools/mutate.py lease-holds tp-kv-heads   # some, by name
    .venv/bin/python tools/mutate.py --worktree   # with uncommitted edits
    .venv/bin/python tools/mutate.py --list

Run by hand, not in CI: each mutation runs its test files whole, and the
24 below take about three and a half minutes on 2 cores. The first 13 are the audit's in
shared/research/mutation-audit.md; add one when a review finds a guard with
no test that fails without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path("src") / "pdserve"
# what pytest needs of the tree: the package, the tests, their settings, and
# the deploy configs some tests read through the repository root
COPIED = ("src", "tests", "deploy", "pyproject.toml")


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str               # under src/pdserve
    original: str           # occurs exactly once in the file
    mutant: str
    tests: tuple[str, ...]  # test files, tests/test_<name>.py
    bug: str                # what would go wrong, in a line

    @property
    def file(self) -> Path:
        return PACKAGE / self.path

    def test_paths(self) -> list[str]:
        """Each test file, wherever tests/ keeps it (a missing one as tests/test_NAME.py)."""
        tests = ROOT / "tests"
        return [next((str(p.relative_to(ROOT)) for p in tests.rglob(f"test_{t}.py")),
                     f"tests/test_{t}.py") for t in self.tests]


MUTATIONS = [
    Mutation("lease-holds", "transfer/lease.py",
             "return self._deadline.get(req_id, -1.0) > now",
             "return req_id in self._deadline",
             ("transfer", "lease_drain", "peer_refusals", "control_checks", "failed_round"),
             "P posts a KV write after its lease ran out, into pages D may reuse"),
    Mutation("landing-fenced", "transfer/landing.py",
             "return LandingVerdict.DRAINED if ld.fenced else LandingVerdict.LANDED",
             "return LandingVerdict.LANDED",
             ("transfer", "lease_drain", "peer_refusals", "control_checks"),
             "D takes a fenced (timed-out) write as landed"),
    Mutation("page-key-last-token", "scheduler/request.py",
             "return self.prompt.segment(start, end)",
             "return self.prompt.segment(start, end - 1)",
             ("scheduler_pool", "scheduler_fused", "scheduler_property", "scheduler_pd",
              "scheduler_waiting"),
             "prompts that differ in a page's last token share its cached KV"),
    Mutation("disk-checksum", "transfer/disk/store.py",
             'if hashlib.blake2b(payload, digest_size=16).hexdigest() != head.get("blake2b"):',
             "if False:",
             ("disk_store", "disk_engine", "scheduler_disk"),
             "a damaged disk page is served as KV"),
    Mutation("lora-salt", "scheduler/request.py",
             "return (ADAPTER_SALT, self.adapter, self._page_key(0, page_size))",
             "return (ADAPTER_SALT, self._page_key(0, page_size))",
             ("lora_cache", "lora_serving", "lora_replay"),
             "two LoRA adapters share a cached prefix"),
    Mutation("spec-accept-ratio", "kernels/spec/rejection.py",
             "ratio = torch.clamp(ratio / qx, max=1.0)",
             "ratio = (ratio >= 0.5 * qx).to(ratio.dtype)",
             ("spec_rejection", "spec_engine", "spec_draft"),
             "sampled speculative decoding no longer follows the target distribution"),
    Mutation("tp-kv-heads", "kernels/tensor_parallel.py",
             "slice(kv.start * d, kv.stop * d)",
             "slice(kv.start * d, (kv.start + 1) * d)",
             ("tensor_parallel", "tp_engine", "tp_pd", "tp_rank_transfer"),
             "a TP rank with more than one KV head gets the first one's K/V only"),
    Mutation("remote-prefill-page-twice", "engine/control_checks.py",
             "if len(set(r.landing_pages)) != len(r.landing_pages):",
             "if False:",
             ("control_checks", "control_fuzz", "peer_refusals"),
             "a RemotePrefill naming a landing page twice is accepted"),
    Mutation("ack-epoch", "engine/peer/prefill_side.py",
             "if info is not None and (info[0], info[1], info[3]) == (d_name, d_inc, epoch):",
             "if info is not None and info[0] == d_name:",
             ("peer_refusals", "control_checks", "lease_drain", "failed_round", "control_fuzz"),
             "a late ack from the same D for an earlier attempt releases the live copy"),
    Mutation("ask-floor", "engine/peer/prefill_side.py",
             "if floor is not None and floor[0] == r.target_incarnation and r.epoch <= floor[1]:",
             "if False:",
             ("frozen_peers", "transfer_safety_machine"),
             "a RemotePrefill that arrives after P told D the landing ended writes into its pages"),
    Mutation("ask-for-another-incarnation", "engine/peer/prefill_side.py",
             "if r.prefill_incarnation != self.me.epoch:",
             "if False:",
             ("frozen_peers", "transfer_safety_machine", "control_checks"),
             "a restarted P takes an ask meant for its old incarnation, whose landing D freed"),
    Mutation("lease-revived", "transfer/lease.py",
             "if self._peer.get(rid) == peer and self._deadline[rid] > now:",
             "if self._peer.get(rid) == peer:",
             ("transfer", "frozen_peers"),
             "a late heartbeat revives a lease that expired, for a twin D gave up on"),
    Mutation("stale-job", "engine/loop.py",
             "if job.deadline is not None and self.clock() >= job.deadline:",
             "if False:",
             ("frozen_peers",),
             "a thawed engine runs jobs whose callers gave up (an old RemotePrefill)"),
    Mutation("ended-by-another-p", "transfer/landing.py",
             """        ld = self._by_key.get((req_id, epoch))
        if ld is None or ld.source != source:
            return None""",
             """        ld = self._by_key.get((req_id, epoch))
        if ld is None:
            return None""",
             ("transfer", "frozen_peers"),
             "another P's (or an old incarnation's) TransferEnded frees a quarantined landing"),
    Mutation("ingest-bound", "scheduler/capacity.py",
             "return -(-(prompt_tokens + cfg.decode_input_tokens) // cfg.page_size)",
             "return -(-(prompt_tokens + cfg.decode_input_tokens - 1) // cfg.page_size)",
             ("scheduler_capacity", "scheduler_liveness", "router"),
             "a prompt one token past what fits is admitted"),
    Mutation("overlap-late-stop", "scheduler/round/overlap.py",
             "if r.state.holds_pages and r.state.res.forwards_out > 1]",
             "if r.state.holds_pages and r.state.res.forwards_out > 2]",
             ("overlap", "disk_overlap"),
             "a stop finishes its request with the next round's forward still out"),
    Mutation("overlap-abort", "scheduler/round/overlap.py",
             "if not (isinstance(st, fsm.Holding) and st.res.forwards_out):",
             "if not (isinstance(st, fsm.Holding) and st.res.forwards_out > 1):",
             ("overlap", "disk_overlap"),
             "an abort frees pages a forward in flight still writes"),
    Mutation("capture-flashinfer-stale-plan", "kernels/capture.py",
             "self.model.attention.plan_captured(gb.planned, m.seqs, ps, scratch)",
             "self.model.attention.plan_captured(gb.planned, m.seqs[:1], ps, scratch)",
             ("device", "capture"),
             "a captured flashinfer decode replays over a table planned for another round"),
    Mutation("pool-descending-runs", "scheduler/cache/pool.py",
             "pages = free[len(free) - n:][::-1]",
             "pages = free[len(free) - n:]",
             ("scheduler_pool",),
             "the pool hands out pages in descending order, which NIXL does not merge"),
    Mutation("experts-grouped-unpermuted", "kernels/models/moe/experts.py",
             "pairs = torch.empty_like(y).index_copy_(0, order, y)",
             "pairs = y",
             ("experts_paths",),
             "the grouped path sums the expert-sorted outputs as if they were each token's"),
    Mutation("experts-capture-counts-padding", "kernels/models/moe/experts.py",
             "if self.live_rows is None:",
             "if True:",
             ("capture",),
             "a captured MoE batch's padding rows count as the experts' tokens"),
    Mutation("trace-blocks-unshared", "sim/load.py",
             'rng = random.Random(f"{seed}:{h}")',
             'rng = random.Random(f"{seed}:{h}:{len(out)}:{length}")',
             ("local_engine",),
             "a replayed trace's requests no longer share the blocks their hash ids name"),
    Mutation("plan-map-uncut-prompts", "sim/plan/map.py",
             "cut = trace if length is None else cut_prompts(trace, length)",
             "cut = trace",
             ("plan",),
             "the map's cells plan the whole prompts whatever --prompt-len says"),
    Mutation("calibrate-one-core", "sim/calibrate/sweep.py",
             "workers = share_kernel_cores(cfg.engine.cpu_threads if clock == \"wall\" else 1)",
             "workers = share_kernel_cores(1)",
             ("calibrate",),
             "calibrate times pdserve's C kernels on one core where an engine shares them"),
]


@dataclasses.dataclass
class Outcome:
    mutation: Mutation
    caught: bool
    seconds: float
    by: str                 # the test that failed first (pytest -x stops there)


def rotted(m: Mutation, root: Path = ROOT) -> str | None:
    """Why `m` no longer applies to the tree at `root`, or None."""
    path = root / m.file
    if not path.is_file():
        return f"{m.file} does not exist"
    n = path.read_text().count(m.original)
    if n != 1:
        return f"{m.file} holds its original text {n} times, not once: {m.original!r}"
    missing = [t for t in m.test_paths() if not (root / t).is_file()]
    if missing:
        return f"its test files {missing} do not exist"
    return None


class NoVerdict(Exception):
    """pytest ended without a test verdict (collection failed, no tests)."""


def first_failure(output: str) -> str:
    """The test pytest -x stopped at, from its summary."""
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return m.group(1) if m else output.strip().splitlines()[-1] if output.strip() else ""


def run_one(m: Mutation, tree: Path) -> Outcome:
    """Apply `m` in `tree`, run its tests there, put the file back."""
    path = tree / m.file
    source = path.read_text()
    path.write_text(source.replace(m.original, m.mutant, 1))
    # no bytecode written: a mutant's .pyc must never outlive it (a restored
    # file of the same size within the same second would look unchanged)
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.perf_counter()
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                              *m.test_paths()], cwd=tree, env=env, capture_output=True,
                             text=True)
    finally:
        path.write_text(source)
    seconds = time.perf_counter() - t0
    output = run.stdout + run.stderr
    if run.returncode == 0:
        return Outcome(m, False, seconds, "")
    if run.returncode == 1:
        return Outcome(m, True, seconds, first_failure(output))
    raise NoVerdict(f"{m.name}: pytest ended with code {run.returncode}, not a test "
                    f"verdict:\n{output[-3000:]}")


def export_rev(rev: str, dest: Path) -> Path:
    """The tree of commit `rev` (what `make mutate` tests: a shared
    checkout's half-made edits are not the suite's)."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "--", *COPIED],
                             cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def copy_tree(dest: Path) -> Path:
    """The working tree, uncommitted edits and all."""
    for name in COPIED:
        src = ROOT / name
        if src.is_symlink():
            os.symlink(os.readlink(src), dest / name)
        elif src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def table(outcomes: list[Outcome]) -> str:
    w = max(len(o.mutation.name) for o in outcomes)
    rows = [f"{'mutation':<{w}}  {'verdict':<8}  {'s':>6}  first failing test"]
    for o in outcomes:
        verdict = "caught" if o.caught else "SURVIVED"
        rows.append(f"{o.mutation.name:<{w}}  {verdict:<8}  {o.seconds:6.1f}  "
                    f"{o.by if o.caught else o.mutation.bug}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--rev", default="HEAD", help="the commit to test (default HEAD)")
    ap.add_argument("--worktree", action="store_true",
                    help="test the working tree, uncommitted edits included, not --rev")
    args = ap.parse_args(argv)
    by_name = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        ap.error(f"unknown mutations {unknown}; --list shows them")
    chosen = [by_name[n] for n in args.names] or MUTATIONS
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file}: {m.bug}")
        return 0
    t0 = time.perf_counter()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="pdserve-mutate-") as tmp:
        tree = copy_tree(Path(tmp)) if args.worktree else export_rev(args.rev, Path(tmp))
        bad = [f"{m.name}: {why}" for m in chosen if (why := rotted(m, tree))]
        if bad:
            print("the mutation list no longer matches the tree:\n  " + "\n  ".join(bad))
            return 2
        for m in chosen:
            try:
                o = run_one(m, tree)
            except NoVerdict as e:
                print(e)
                return 2
            print(f"{m.name}: {'caught' if o.caught else 'SURVIVED'} ({o.seconds:.1f} s)",
                  flush=True)
            outcomes.append(o)
    print()
    print(table(outcomes))
    survived = [o.mutation.name for o in outcomes if not o.caught]
    print(f"\n{len(outcomes)} mutations, {len(outcomes) - len(survived)} caught, "
          f"{len(survived)} survived, {time.perf_counter() - t0:.0f} s")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
