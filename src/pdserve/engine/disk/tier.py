"""The engine's edge to the disk (L3) KV tier: probes and prefetches at
arrival, the reads a plan asks for, and writes through from the host tier.

    arrival (before a build)   for the prompt's pages beyond what device and
                               host hold, GETs (the prefetch; best_effort
                               probes with EXISTS first). `Request.disk_pages` follows the
                               policy: best_effort, the pages the probe
                               found (those not read by admission are read
                               in the round); wait_complete and timeout, the
                               pages read, and `Request.disk_wait` holds the
                               request until every read ended (timeout: or
                               prefetch_timeout_s passed)
    a plan's DiskLoadOp        its pages from the prefetched bytes, or read
                               now; one that cannot be read is a miss, which
                               the planner turns into a retraction (§4)
    a state model              the prefetch also reads (GET) the state
                               checkpoint at each block boundary, and
                               `disk_pages` ends at one the disk holds; a
                               plan's state DiskLoadOp reads it into a host
                               slot; checkpoints are written through as
                               their host stores land (write_through), or
                               with the page they end (selective)
    a cached sliding group     (WindowFiles) its window pages, stored to
                               host as they are published, are written
                               through under the chain hash each ends
                               (write_through only); the probe EXISTS each
                               and `disk_pages` ends where every window's
                               tail is on disk; a plan's DiskLoadOp of the
                               group reads the tail into its host pages
    a pinned host store        write_through: each page queued to disk as it
                               reaches host; write_through_selective: once
                               host hits on it reach write_hits; skipped
                               while write_backlog pages wait to be written
                               (the store reads on its own lane, so reads
                               never queue behind writes)

The planner never touches the disk: it sees the probe's result on the
request and the reads' outcomes in the round's result. Keys are the chain
hash of the prefix each page ends (scheduler/cache/prefix.py), the cache group,
the weights fingerprint, dtype, page layout and tensor-parallel shard
(transfer/disk/store.py), so
every engine of a node on the same directory and model shares the files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.kernels.kv_cache import KVCache
from pdserve.engine.disk.groups import REMEMBERED, HostCheckpoints, StateFiles, WindowFiles
from pdserve.engine.disk.model_match import weights_fingerprint
from pdserve.scheduler.config import DiskCacheConfig, PrefetchPolicy, WritePolicy
from pdserve.scheduler.fsm import Waiting
from pdserve.scheduler.cache.prefix import ROOT_HASH, chain_hash
from pdserve.transfer.disk.files import FileStore
from pdserve.transfer.disk.store import DiskDone, DiskKey, DiskOp, DiskStore


@dataclass
class DiskCounts:
    """What the edge counts (engine stats and metrics)."""
    probes: int = 0             # requests probed at arrival
    probed_pages: int = 0       # pages asked for
    probes_absent: int = 0      # probes the store answered at once: their first page is absent
    prefetched_pages: int = 0   # pages read ahead of admission
    below_min: int = 0          # probes whose possible hit was under min_hit_tokens
    prefetch_complete: int = 0  # prefetches that ended before their request was let go
    prefetch_timed_out: int = 0
    prefetch_partial: int = 0   # best_effort: let go while reads were still out
    reads_hit: int = 0          # a plan's disk reads whose every page was read
    reads_missed: int = 0
    read_now_pages: int = 0     # pages a plan's read fetched itself (not prefetched)
    writes: int = 0             # pages queued to disk
    writes_dropped: int = 0     # write-through skipped: write_backlog pages already queued


@dataclass
class Prefetch:
    """One request's reads ahead of its admission."""
    req: object
    start: int                  # first page read (device and host held the rest at arrival)
    chains: list                # chain hash of pages [start, start + len)
    jobs: dict                  # job id -> index into chains
    deadline: float
    found: set = field(default_factory=set)     # indexes the EXISTS probe found
    got: dict = field(default_factory=dict)     # index -> bytes
    ended: set = field(default_factory=set)     # indexes whose read ended
    missed_at: int | None = None                # the first index whose read missed
    let_go: bool = False
    state_jobs: dict = field(default_factory=dict)  # GET of a checkpoint: job -> index
    window_jobs: dict = field(default_factory=dict)  # EXISTS of a tail page: job -> (group, index)
    tails: set = field(default_factory=set)         # (group, index) the disk holds
    states: dict = field(default_factory=dict)  # index whose page ends at a checkpoint -> its bytes (None: found, not read)

    def run(self, probed: bool = False) -> int:
        """Pages read (`probed`: found by the probe) from `start` on,
        without a gap."""
        have = self.found if probed else self.got
        n = 0
        while n in have:
            n += 1
        return n

    def finished(self) -> bool:
        end = len(self.chains) if self.missed_at is None else self.missed_at
        return not self.state_jobs and not self.window_jobs \
            and all(i in self.ended for i in range(end))


class DiskTier:
    def __init__(self, cfg: DiskCacheConfig, store: DiskStore, *, model_id: str, dtype: str,
                 layout: str, page_size: int, tp_rank: int = 0, tp_size: int = 1,
                 state: "StateFiles | None" = None, windows: tuple = (),
                 clock=time.monotonic):
        """`state`: a state model's checkpoints (their group, block and slot
        layout); None for a model without a state group. `windows`: the
        sliding groups whose window tails the tier stores (WindowFiles)."""
        self.cfg = cfg
        self.state = state
        self.windows = {w.group: w for w in windows}
        self.store = store
        self.model_id, self.dtype, self.layout = model_id, dtype, layout
        self.page_size = page_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.clock = clock
        self.counts = DiskCounts()
        self._prefetch: dict[str, Prefetch] = {}
        self._jobs: dict[int, str] = {}             # prefetch job -> request id
        self._seen_seq = -1                         # the newest submission probed
        self._written: set[tuple[int, int]] = set()     # (group, chain) this engine wrote or read
        self._host_chain: dict[int, int] = {}       # host page -> chain it caches
        self._hits: dict[int, int] = {}             # chain -> host hits (selective)
        self._checkpoints = HostCheckpoints()       # selective: the state's host slots
        self._writes_out: set[int] = set()          # PUT jobs not yet polled

    @classmethod
    def open(cls, cfg: DiskCacheConfig, model, page_size: int, layout: str,
             state: "StateFiles | None" = None, windows: tuple = ()) -> "DiskTier":
        """The file-backed tier of `cfg` for `model`, or a DiskStoreError
        saying why its path cannot be used."""
        store = FileStore(cfg.path, cfg.max_bytes)
        return cls(cfg, store, model_id=weights_fingerprint(model),
                   dtype=str(model.dtype).removeprefix("torch."), layout=layout,
                   page_size=page_size, state=state, windows=windows)

    def key(self, chain: int, group: int = 0) -> DiskKey:
        st = self.state
        layout = st.layout if st is not None and group == st.group else \
            self.windows[group].layout if group in self.windows else self.layout
        return DiskKey(chain, group, self.model_id, self.dtype, layout,
                       self.tp_rank, self.tp_size)

    def close(self) -> None:
        self.store.close()

    # ---- arrivals and prefetch ------------------------------------------------
    def before_build(self, planner) -> None:
        """Probe new arrivals, land finished reads, and set each waiting
        request's `disk_pages` and `disk_wait` for the build to come."""
        self._arrivals(planner)
        self._land(self.store.poll())
        now = self.clock()
        for rid, pf in list(self._prefetch.items()):
            req = pf.req
            if planner.requests.get(rid) is not req or not isinstance(req.state, Waiting):
                self._drop(rid)                     # admitted (its read ran) or gone
                continue
            if not pf.let_go:
                policy = self.cfg.prefetch_policy
                if pf.finished():
                    pf.let_go = True
                    self.counts.prefetch_complete += 1
                elif policy is PrefetchPolicy.BEST_EFFORT:
                    pf.let_go = True
                    self.counts.prefetch_partial += 1
                elif policy is PrefetchPolicy.TIMEOUT and now >= pf.deadline:
                    pf.let_go = True
                    self.counts.prefetch_timed_out += 1
            run = pf.run(probed=self.cfg.prefetch_policy is PrefetchPolicy.BEST_EFFORT)
            if self.state is not None:          # a hit ends at a checkpoint the disk holds
                while run and (run - 1 not in pf.states
                               or (pf.start + run) % self.state.block_pages):
                    run -= 1
            while run and not self._tails_found(pf, pf.start + run):
                run -= 1                        # a hit ends where every window's tail is
            if run * self.page_size < self.cfg.min_hit_tokens:
                run = 0
            req.disk_pages = pf.start + run if run else 0
            req.disk_wait = not pf.let_go

    def _tails_found(self, pf: Prefetch, end: int) -> bool:
        """Does the disk hold each window's tail for a hit ending at page
        `end`, within the pages probed (a tail reaching below them: no)?"""
        for w in self.windows.values():
            tail = w.tail(end, self.page_size)
            if tail.start < pf.start or any((w.group, i - pf.start) not in pf.tails
                                            for i in tail):
                return False
        return True

    def holding(self) -> bool:
        """Is a request held for its prefetch?"""
        return any(not pf.let_go for pf in self._prefetch.values())

    def wait_progress(self, timeout_s: float) -> None:
        """Block until the reads of every held prefetch ended (or
        `timeout_s`): an engine with nothing else to do waits here, woken
        once, not once a page."""
        jobs = [j for pf in self._prefetch.values() if not pf.let_go for j in pf.jobs]
        if jobs:
            self.store.wait_ended(jobs, timeout_s)

    def _arrivals(self, planner) -> None:
        new = []
        for req in reversed(planner.waiting):
            if req.seq <= self._seen_seq:
                break
            new.append(req)
        for req in reversed(new):
            self._seen_seq = max(self._seen_seq, req.seq)
            self._probe(req, planner.cached_pages(req))

    def _probe(self, req, cached: int) -> None:
        ps = self.page_size
        pages = (req.num_tokens - 1) // ps           # what a hit may cover (scheduler/round/prefill.py)
        if pages <= cached:
            return
        if (pages - cached) * ps < self.cfg.min_hit_tokens:
            self.counts.below_min += 1
            return
        chains = self._chains(req, pages)[cached:]
        self.counts.probes += 1
        self.counts.probed_pages += len(chains)
        if self.store.absent(self.key(chains[0])):
            self.counts.probes_absent += 1          # nothing to read: no prefetch, no wait
            return
        jobs = {}
        # best_effort admits on what the probe found; the others on what was read
        ops = (DiskOp.EXISTS, DiskOp.GET) \
            if self.cfg.prefetch_policy is PrefetchPolicy.BEST_EFFORT else (DiskOp.GET,)
        for op in ops:
            for i, c in enumerate(chains):
                j = self.store.submit(op, self.key(c))
                jobs[j] = i
                self._jobs[j] = req.id
        pf = Prefetch(req, cached, chains, jobs, self.clock() + self.cfg.prefetch_timeout_s)
        st = self.state
        if st is not None:
            for i, c in enumerate(chains):
                if (cached + i + 1) % st.block_pages == 0:
                    for op in ops:          # as the pages: best_effort on what EXISTS found
                        j = self.store.submit(op, self.key(c, st.group))
                        pf.state_jobs[j] = i
                        self._jobs[j] = req.id
        for w in self.windows.values():     # tails are read at admission: probed only
            for i, c in enumerate(chains):
                j = self.store.submit(DiskOp.EXISTS, self.key(c, w.group))
                pf.window_jobs[j] = (w.group, i)
                self._jobs[j] = req.id
        self._prefetch[req.id] = pf
        req.disk_wait = self.cfg.prefetch_policy is not PrefetchPolicy.BEST_EFFORT

    def _chains(self, req, pages: int) -> list[int]:
        h, out = ROOT_HASH, []
        for i in range(pages):
            h = chain_hash(h, req.page_key(i, self.page_size))
            out.append(h)
        return out

    def _land(self, done: list[DiskDone]) -> None:
        for d in done:
            if d.op is DiskOp.PUT:
                self._writes_out.discard(d.job)
                if not d.ok:
                    self._written.discard((d.key.group, d.key.chain))   # another engine may write it
                continue
            rid = self._jobs.pop(d.job, None)
            pf = self._prefetch.get(rid) if rid is not None else None
            if pf is None:
                continue
            if d.job in pf.window_jobs:
                if d.ok:
                    pf.tails.add(pf.window_jobs[d.job])
                del pf.window_jobs[d.job]
                continue
            if d.job in pf.state_jobs:
                i = pf.state_jobs.pop(d.job)
                if d.ok and d.op is DiskOp.EXISTS:
                    pf.states.setdefault(i, None)   # found; its bytes read in the round
                elif d.ok and d.data is not None:
                    pf.states[i] = d.data
                continue
            i = pf.jobs.pop(d.job)
            if d.op is DiskOp.EXISTS:
                if d.ok:
                    pf.found.add(i)
                continue
            pf.ended.add(i)
            if d.ok and d.data is not None and (pf.missed_at is None or i < pf.missed_at):
                pf.got[i] = d.data
                self._written.add((0, d.key.chain))
                self.counts.prefetched_pages += 1
            elif not d.ok and (pf.missed_at is None or i < pf.missed_at):
                pf.missed_at = i
                for k in [k for k in pf.got if k > i]:
                    del pf.got[k]

    def _drop(self, rid: str) -> None:
        pf = self._prefetch.pop(rid)
        for j in [*pf.jobs, *pf.state_jobs, *pf.window_jobs]:
            self._jobs.pop(j, None)

    # ---- a round's copies (the executor calls this after its host stores) --------
    def copies(self, plan, result, host, state_host=None, hosts=None) -> set[str]:
        """Write-through of the round's full-history stores (their host
        pages now hold them), then the round's disk reads into host pages,
        hit or miss, each acked in `result`; host hits counted for
        selective writes. Returns the requests whose read missed (their
        forward this round runs on unfilled pages: the planner retracts
        them and drops what they sample). `host`: group 0's host cache;
        `state_host`: a state model's host state cache (its checkpoints
        are written through as they reach host, under write_through);
        `hosts`: every group's host cache, for the sliding groups in
        `windows` (their window tails, written through and read back)."""
        assert isinstance(host, KVCache)            # the tier caches full-history pages
        st = self.state
        self._checkpoints.host = state_host
        for s in plan.stores:
            if st is not None and s.group == st.group:
                self._checkpoint_stored(s, state_host)
                continue
            if s.group in self.windows:
                self._window_stored(s, hosts[s.group])
                continue
            if s.group != 0:
                continue
            if not s.pinned:
                self.host_overwritten(s.host_pages)
                continue
            assert s.entries is not None            # a pinned store names what it publishes
            for hp, (parent, key) in zip(s.host_pages, s.entries):
                self.stored(chain_hash(parent, key), hp, lambda hp=hp: host.read_page(hp))
        missed = set()
        for op in plan.disk_loads:
            on_state = st is not None and op.group == st.group
            if on_state:
                self._checkpoints.overwritten(op.host_pages)
            elif op.group == 0:
                self.host_overwritten(op.host_pages)
            data = None if op.req_id in missed else self.read(op)
            if data is None:
                result.disk_loads_missed.append(op.id)
                missed.add(op.req_id)
                continue
            for hp, b in zip(op.host_pages, data):
                if on_state:
                    state_host.write_slot(hp, b)
                elif op.group in self.windows:
                    hosts[op.group].write_page(hp, b)
                else:
                    host.write_page(hp, b)
            result.disk_loads_done.append(op.id)
        for rid in {op.req_id for op in plan.disk_loads}:
            if rid in self._prefetch:
                self._drop(rid)                     # its reads are done with the prefetch
        staged = {hp for op in plan.disk_loads if op.group == 0 for hp in op.host_pages}
        for ld in plan.loads:
            if ld.group == 0:
                for hp in ld.host_pages:
                    if hp not in staged:
                        self.host_hit(hp, lambda hp=hp: host.read_page(hp))
        return missed

    # ---- a plan's reads ---------------------------------------------------------
    def read(self, op) -> list[bytes] | None:
        """The bytes of a DiskLoadOp's pages, prefetched or read now; None
        if any page cannot be read (a miss). The request's prefetch ends
        with its round's reads (`copies`): a request retracted for a miss
        re-prefills without the disk."""
        pf = self._prefetch.get(op.req_id)
        out = []
        for n, chain in enumerate(op.chains):
            data = None
            if pf is not None:
                i = op.first_page + n - pf.start
                if 0 <= i < len(pf.chains) and pf.chains[i] == chain:
                    # window tails are not prefetched: read now
                    data = pf.got.pop(i, None) if op.group == 0 else None \
                        if op.group in self.windows else pf.states.pop(i, None)
            if data is None:
                self.counts.read_now_pages += 1
                d = self.store.wait(self.store.submit(DiskOp.GET, self.key(chain, op.group)),
                                    self.cfg.prefetch_timeout_s)
                data = d.data if d is not None and d.ok else None
            if data is None:
                self.counts.reads_missed += 1
                return None
            out.append(data)
        self.counts.reads_hit += 1
        return out

    # ---- writes -------------------------------------------------------------------
    def stored(self, chain: int, host_page: int, page_bytes) -> None:
        """A page reached host page `host_page` under `chain` (a pinned
        store): write it through now, or (selective) note which chain the
        host page caches, for its hits. `page_bytes()` reads it."""
        self._host_chain[host_page] = chain
        if self.cfg.write_policy is WritePolicy.WRITE_THROUGH:
            self._write(chain, page_bytes)

    def host_overwritten(self, host_pages) -> None:
        """Host pages written with something else (a snapshot, a disk read)."""
        for hp in host_pages:
            self._host_chain.pop(hp, None)

    def host_hit(self, host_page: int, page_bytes) -> None:
        """A host prefix hit read `host_page`: selective writes count it."""
        if self.cfg.write_policy is not WritePolicy.WRITE_THROUGH_SELECTIVE:
            return
        chain = self._host_chain.get(host_page)
        if chain is None:
            return
        n = self._hits.get(chain, 0) + 1
        if len(self._hits) >= REMEMBERED:
            self._hits.clear()
        self._hits[chain] = n
        if n >= self.cfg.write_hits:
            self._hits.pop(chain, None)
            self._write(chain, page_bytes)
            self._write_checkpoint(chain)

    def _window_stored(self, s, host) -> None:
        """A pinned store of a sliding group's window tail landed on host:
        write each page through under the chain hash it ends (`entries`),
        beside the full-history page of the same slot. Under
        write_through_selective tails are not written (a tail is needed
        whole, at one hit's end, and hits count full-history pages)."""
        if not s.pinned or self.cfg.write_policy is not WritePolicy.WRITE_THROUGH:
            return
        for hp, chain in zip(s.host_pages, s.entries or ()):
            self._write(chain, lambda hp=hp: host.read_page(hp), s.group)

    def _checkpoint_stored(self, s, state_host) -> None:
        """A store of the state group landed on host: a pinned one is a
        checkpoint publication, written now (write_through) or when the
        page it ends is (selective; at once if that page is already on
        disk); an unpinned one (a snapshot) overwrites its slots."""
        if not s.pinned:
            self._checkpoints.overwritten(s.host_pages)
            return
        st = self.state
        assert st is not None
        for hp, chain in zip(s.host_pages, s.entries or ()):
            if self.cfg.write_policy is WritePolicy.WRITE_THROUGH:
                self._write(chain, lambda hp=hp: state_host.read_slot(hp), st.group)
            elif self.cfg.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
                self._checkpoints.stored(chain, hp)
                if (0, chain) in self._written:
                    self._write_checkpoint(chain)

    def _write_checkpoint(self, chain: int) -> None:
        """Selective: the page ending at `chain` was written; so is the
        state checkpoint there, if the host holds it, so a disk hit can
        end at that page (a hit ends at a checkpoint the disk holds)."""
        st = self.state
        slot = self._checkpoints.slot(chain) if st is not None else None
        if st is not None and slot is not None:
            host = self._checkpoints.host
            self._write(chain, lambda: host.read_slot(slot), st.group)

    def _write(self, chain: int, page_bytes, group: int = 0) -> None:
        if (group, chain) in self._written:
            return
        if self.store.queued_writes() >= self.cfg.write_backlog:
            # the disk is behind: this page stays on host only (a later store
            # or host hit may write it); reads never wait for writes anyway
            self.counts.writes_dropped += 1
            return
        if len(self._written) >= REMEMBERED:
            self._written.clear()       # a skip list only: forgetting costs a rewrite
        self._written.add((group, chain))
        self._writes_out.add(self.store.submit(DiskOp.PUT, self.key(chain, group), page_bytes()))
        self.counts.writes += 1

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write is on disk (tests, a clean stop)."""
        return self.store.drain(timeout_s)

    def stats(self) -> dict:
        s = self.store.stats
        return {**self.counts.__dict__, "bytes_read": s.bytes_read,
                "bytes_written": s.bytes_written, "disk_gets": s.gets, "disk_get_hits": s.hits,
                "disk_evictions": s.evictions, "disk_removed_bad": s.removed_bad,
                "disk_failed_puts": s.failed_puts, "disk_read_unwritten": s.read_unwritten}
