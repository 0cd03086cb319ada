"""The host (L2) tier: a page pool and prefix index in host memory per cache
group, and the tickets of the copies between it and the device pools.

A copy is a ticket that owns page references until the executor acks it
(or reports it failed), so that every refcount stays checkable
(`HostCache.check_invariants`) and no page a copy reads or writes is freed
or granted again while the copy may still run, however late the ack comes:
  a publication store    pinned: one ref on each device page of the chain
                         from the root to its last source, and one on each
                         host target; at the ack the targets enter the host
                         index (the full history's by chain, a state group's
                         checkpoints by the chain hash of the prefix they end)
  a retraction snapshot  stream-ordered: one ref on each host target, beside
                         the one the Retracted state holding the snapshot
                         has (aborting it lets go of that one only). Its
                         device sources are not held: the executor copies
                         them ahead of anything else the plan does (§2)
  a load                 one ref on each host source and one on each device
                         target until done (a host prefix hit, or a
                         readmission's snapshot): the request may let go of
                         a target (an abort, a publication that adopts a
                         cached twin) while the copy still writes it
  a disk read            one ref on each host page it fills (a staging page
                         of a disk hit, never entered in the host index),
                         beside the ref the load that copies it on to the
                         device holds; both let go within the round

Host writes are best effort: a tier that cannot supply pages is skipped and
the device copy stays cached. Op ids count up across stores and loads in the
order the planner makes them. The coordinator (coordinator.py) makes the
publication stores as it publishes and the loads of a host hit as it admits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.scheduler.cache.groups import HOLE
from pdserve.scheduler.plan import DiskLoadOp, LoadOp, StoreOp
from pdserve.scheduler.cache.pool import PagePool, check_refcounts, drop_refs
from pdserve.scheduler.cache.prefix import PrefixIndex, WindowIndex

if TYPE_CHECKING:
    from pdserve.scheduler.cache.group_pools import CacheGroup


class HostTier:
    """The L2 host cache of one group: a page pool and prefix index in host
    memory. The full-history group's index serves prefix hits by chain, a
    state group's (`keyed`) serves checkpoints by the chain hash of the
    prefix they end; every group's tier takes retraction snapshots."""

    def __init__(self, total_pages: int, keyed: bool = False):
        self.pool = PagePool(total_pages)
        self.index = WindowIndex(self.pool) if keyed else \
            PrefixIndex(self.pool, strict_holding=False)

    def allocate(self, n: int) -> list[int] | None:
        """n host pages (refcount 1), evicting idle cached ones; None if the
        tier cannot supply them all (host writes are best effort)."""
        short = n - self.pool.num_free
        if short > 0:
            got = self.index.evict(short, best_effort=True)
            for p in got:
                self.pool.put_free(p)
            if len(got) < short:
                return None
        return self.pool.take(n)

    def hold(self, pages) -> None:
        rc = self.pool.refcount
        for p in pages:
            if rc[p] == 0 and self.index.contains(p):
                self.index.claim(p)
            rc[p] += 1

    def release(self, pages) -> None:
        drop_refs(self.pool, self.index, pages)


class HostCache:
    """Every group's host tier (`tiers`, none when `host_pages` is 0) and the
    tickets of copies in flight between them and the device `groups` (the
    coordinator's): stores made and not yet handed to a plan
    (`pending_stores`), stores handed out and not yet acked (`stores`, the
    pending ones included) and loads (`loads`)."""

    def __init__(self, groups: list[CacheGroup], host_pages: int = 0, host_slots: int = 0):
        """`host_pages`: each page group's host tier (0: none); `host_slots`:
        a state group's (0: as many as its device pool)."""
        self.groups = groups
        self.page_size = groups[0].page_size
        self.state = next((i for i, g in enumerate(groups) if g.spec.state), None)
        self.tiers = [HostTier(host_slots or grp.pool.total, keyed=True) if grp.spec.state
                      else HostTier(host_pages) for grp in groups] if host_pages else []
        self.pending_stores: list[StoreOp] = []
        self.stores: dict[int, StoreOp] = {}
        self.loads: dict[int, LoadOp] = {}
        self.disk_loads: dict[int, DiskLoadOp] = {}
        self._next_op = 0
        # The plan build each unacked snapshot store and load was made in: a
        # load may read a snapshot its own plan stores (the executor runs
        # that store first), never one an earlier plan's unacked store writes.
        self.round = 0
        self._made_in: dict[int, int] = {}

    def new_round(self) -> None:
        """A plan build starts (Planner.build)."""
        self.round += 1

    def _op_id(self) -> int:
        self._next_op += 1
        return self._next_op

    def pinned_stores_outstanding(self) -> int:
        return sum(1 for s in self.stores.values() if s.pinned)

    # ---- loads of a host hit ----------------------------------------------
    def load(self, req_id: str, g: int, host_pages: list, device_pages: list, plan) -> None:
        """A load ticket for a host hit: it holds the host pages until done."""
        self.tiers[g].hold(host_pages)
        self._start_load(LoadOp(self._op_id(), req_id, host_pages, device_pages, group=g), plan)

    def _start_load(self, op: LoadOp, plan) -> None:
        """Issue a load whose ticket already holds its host sources: it
        takes a ref on each device target, held until the ack."""
        rc = self.groups[op.group].pool.refcount
        for p in op.device_pages:
            rc[p] += 1
        self.loads[op.id] = op
        self._made_in[op.id] = self.round
        plan.loads.append(op)

    # ---- reads from the disk tier -------------------------------------------
    def disk_room(self, host_hit: list) -> int:
        """Host pages a disk hit could stage through now: free and idle
        cached ones, less the idle pages of the same admission's host hit
        (its load holds them first). Pure."""
        host = self.tiers[0]
        rc = host.pool.refcount
        return host.pool.num_free + host.index.num_idle - sum(1 for p in host_hit if rc[p] == 0)

    def state_disk_room(self) -> bool:
        """Could the state group's host tier stage one checkpoint read from
        disk now (a free or idle cached slot)? Pure."""
        if self.state is None or not self.tiers:
            return False
        host = self.tiers[self.state]
        return host.pool.num_free + host.index.num_idle > 0

    def window_disk_room(self, g: int, n: int) -> bool:
        """Could sliding group g's host tier stage `n` tail pages read from
        disk now? Pure."""
        host = self.tiers[g] if self.tiers else None
        return host is not None and host.pool.num_free + host.index.num_idle >= n

    def load_from_disk(self, req_id: str, chains: list, first_page: int,
                       device_pages: list, plan, group: int = 0) -> None:
        """Read `chains` from disk into fresh host pages (a DiskLoadOp that
        holds them) and copy those on to `device_pages` (a LoadOp behind it
        in the same plan); `group`: the state group's, one checkpoint into
        a host slot. The caller checked `disk_room` (`state_disk_room`)."""
        host_pages = self.tiers[group].allocate(len(chains))
        assert host_pages is not None               # disk_room counted them
        op = DiskLoadOp(self._op_id(), req_id, list(chains), host_pages, first_page, group)
        self.disk_loads[op.id] = op
        plan.disk_loads.append(op)
        self.load(req_id, group, host_pages, device_pages, plan)

    def disk_load_done(self, op_id: int) -> DiskLoadOp:
        """A disk read ended, hit or miss: its ticket lets go of the staging
        pages (the load behind it holds them until its own ack)."""
        op = self.disk_loads.pop(op_id)
        self.tiers[op.group].release(op.host_pages)
        return op

    # ---- publication stores ------------------------------------------------
    def store_published(self, req_id: str, fresh, table) -> None:
        """A pinned store of the full-history pages just published (`fresh`:
        (page, parent hash, key, hash) each) the host index lacks; the
        request's chain from the root to the last of them stays pinned."""
        host = self.tiers[0]
        assert isinstance(host.index, PrefixIndex)  # group 0 keeps history: never keyed
        todo = [f for f in fresh if not host.index.has_hash(f[3])]
        if not todo:
            return
        host_pages = host.allocate(len(todo))
        if host_pages is None:
            return                      # best effort: the device copy stays cached
        self._pinned_store(req_id, 0, [f[0] for f in todo], host_pages,
                           [(f[1], f[2]) for f in todo], table[:table.index(todo[-1][0]) + 1])

    def store_states(self, req_id: str, fresh: list) -> None:
        """Pinned stores of newly published state checkpoints to the state
        group's host tier (best effort), each source slot held until the ack."""
        g = self.state
        assert g is not None                        # only a state group publishes states
        host = self.tiers[g]
        assert isinstance(host.index, WindowIndex)  # a state group's tier is keyed
        todo = [(slot, h) for slot, h in fresh if host.index.find(h) is None]
        host_slots = host.allocate(len(todo)) if todo else None
        if not host_slots:
            return
        slots = [s for s, _ in todo]
        self._pinned_store(req_id, g, slots, host_slots, [h for _, h in todo], slots)

    def store_windows(self, req_id: str, fresh: list) -> None:
        """Pinned stores of newly published window pages of cached sliding
        groups (`fresh`: (group, device page, chain hash) each), for the
        disk tier to write through (best effort): they enter no host index
        (a host hit never reads a window's tail), and each source page is
        held until the ack."""
        for g in sorted({f[0] for f in fresh}):
            todo = [(p, h) for gg, p, h in fresh if gg == g]
            host_pages = self.tiers[g].allocate(len(todo))
            if host_pages is None:
                continue
            pages = [p for p, _ in todo]
            self._pinned_store(req_id, g, pages, host_pages, [h for _, h in todo], pages)

    def _pinned_store(self, req_id: str, g: int, src: list, dst: list, keys: list,
                      pins: list) -> None:
        """Queue a publication store of group `g`'s `src` to host `dst`,
        `pins` held (a refcount each) until its ack."""
        rc = self.groups[g].pool.refcount
        for page in pins:
            rc[page] += 1
        op = StoreOp(self._op_id(), req_id, src, dst, True, keys, pins, group=g)
        self.stores[op.id] = op
        self.pending_stores.append(op)

    def take_pending_stores(self) -> list[StoreOp]:
        out, self.pending_stores = self.pending_stores, []
        return out

    # ---- the host snapshot of a retraction ---------------------------------
    def snapshot(self, req_id: str, res, pages: int, plan) -> list | None:
        """Stream-ordered copies of the device pages of slots [0, pages) of
        every group but the replayable ones (of a state group, the state
        after those pages' tokens), to fresh host pages the
        caller's Retracted state will hold: per group, a host page or HOLE
        per slot. None if the host tiers cannot take them all."""
        if not self.tiers or pages == 0:
            return None
        snap: list[list[int]] = []
        ops: list[StoreOp] = []
        for g, grp in enumerate(self.groups):
            slots = res.tables[g][:pages]
            if grp.spec.state:
                # the working state only: the checkpoints are cached or recomputed
                r = grp.first_live(pages * self.page_size)
                slots = [HOLE] * r + res.tables[g][r:r + 1]
            src = [p for p in slots if p != HOLE] if not grp.spec.replayable else []
            host_pages = self.tiers[g].allocate(len(src)) if src else []
            if host_pages is None:
                for g2, s in enumerate(snap):
                    self.tiers[g2].release([p for p in s if p != HOLE])
                return None
            it = iter(host_pages)
            snap.append([next(it) if p != HOLE else HOLE for p in slots] if src else [])
            if src:
                ops.append(StoreOp(self._op_id(), req_id, src, host_pages, False, group=g))
        for op in ops:
            self.tiers[op.group].hold(op.host_pages)     # the ticket's, until the ack
            self.stores[op.id] = op
            self._made_in[op.id] = self.round
            plan.stores.append(op)
        return snap

    def snapshot_in_flight(self, req_id: str) -> bool:
        """Did an earlier plan store `req_id`'s retraction snapshot, and is
        that store still unacked? Its host pages may not be written yet: a
        load may not read them (one in this plan runs ahead of its loads)."""
        return any(not s.pinned and s.req_id == req_id and self._made_in[s.id] < self.round
                   for s in self.stores.values())

    def load_snapshot(self, req_id: str, res, snap: list, start: int, plan) -> None:
        """Readmission: load each group's snapshot pages of the slots the
        (just admitted) table holds from `start` on; host copies of slots a
        device hit or a slid-out window made moot are let go. The
        snapshot's hold on what loads passes to the load ticket."""
        for g, host_pages in enumerate(snap):
            if not host_pages:
                continue
            table = res.tables[g]
            load_h, load_d, drop = [], [], []
            for i, hp in enumerate(host_pages):
                if hp == HOLE:
                    continue
                if i >= start and i < len(table) and table[i] != HOLE:
                    load_h.append(hp)
                    load_d.append(table[i])
                else:
                    drop.append(hp)
            self.tiers[g].release(drop)
            if load_h:
                self._start_load(LoadOp(self._op_id(), req_id, load_h, load_d, group=g), plan)

    def release_snapshot(self, snap: list) -> None:
        for g, host_pages in enumerate(snap):
            self.tiers[g].release([p for p in host_pages if p != HOLE])

    # ---- acks ------------------------------------------------------------
    def store_done(self, op_id: int) -> None:
        op = self.stores.pop(op_id)
        self._made_in.pop(op_id, None)
        if not op.pinned:
            # the ticket lets go; the snapshot's own hold stays with its owner
            self.tiers[op.group].release(op.host_pages)
            return
        host = self.tiers[op.group]
        assert op.entries is not None               # a pinned store names what it publishes
        if op.group == self.state:
            assert isinstance(host.index, WindowIndex)  # the state group's tier is keyed
            for hp, h in zip(op.host_pages, op.entries):
                host.index.insert(h, hp)             # dropped if h was cached meanwhile
        elif op.group == 0:
            assert isinstance(host.index, PrefixIndex)  # a page group's tier is a chain
            for hp, (parent, key) in zip(op.host_pages, op.entries):
                host.index.insert(parent, key, hp)   # dropped if its parent left the host index
        # a window tail's store (store_windows) was for the disk tier only
        host.release(op.host_pages)
        self._unpin(op)

    def store_failed(self, op_id: int) -> None:
        """A store that did not happen: its host pages hold nothing, so they
        go back unpublished; a pinned store's sources are unpinned (a
        snapshot's pages stay with the snapshot, whose owner fails too)."""
        op = self.stores.pop(op_id)
        self._made_in.pop(op_id, None)
        self.tiers[op.group].release(op.host_pages)
        if op.pinned:
            self._unpin(op)

    def load_done(self, op_id: int) -> None:
        """A load landed (or failed): the ticket lets go of its host sources
        and its device targets; a target its request let go meanwhile (an
        abort, an adopted twin) is free again only now."""
        op = self.loads.pop(op_id)
        self._made_in.pop(op_id, None)
        self.tiers[op.group].release(op.host_pages)
        grp = self.groups[op.group]
        drop_refs(grp.pool, grp.index, op.device_pages)

    def _unpin(self, op: StoreOp) -> None:
        grp = self.groups[op.group]
        assert op.pins is not None                  # a pinned store holds its chain
        drop_refs(grp.pool, grp.index, reversed(op.pins))

    # ---- invariants ------------------------------------------------------
    def held_device_pages(self, g: int):
        """The device pages of group g that unacked copies hold, one entry
        per reference: publication stores' pins, loads' targets."""
        for op in self.stores.values():
            if op.pinned and op.group == g:
                assert op.pins is not None          # a pinned store holds its chain
                yield from op.pins
        for ld in self.loads.values():
            if ld.group == g:
                yield from ld.device_pages

    def check_copies(self, live: dict) -> None:
        """No page is written by two unacked copies, nor read before the
        copy that writes it is acked; a page an unacked load writes sits in
        no other live request's table (`live`: request id -> tables) unless
        the device prefix index caches it (a hit shares what the load
        writes, behind it on the copy stream)."""
        for g, grp in enumerate(self.groups):
            writers: dict = {}
            for op in self.loads.values():
                if op.group != g:
                    continue
                for p in op.device_pages:
                    if p in writers:
                        raise AssertionError(f"group {g} page {p}: written by loads "
                                             f"{writers[p]} and {op.id}, both unacked")
                    writers[p] = op.id
            if not writers:
                continue
            for rid, tables in live.items():
                for p in tables[g]:
                    ld = self.loads.get(writers.get(p, -1))
                    if ld is not None and ld.req_id != rid and not grp.index.contains(p):
                        raise AssertionError(
                            f"group {g} page {p}: unacked load {ld.id} of {ld.req_id} "
                            f"writes it, and {rid} holds it too")
        snap_writes = {(s.group, hp): s.id for s in self.stores.values() if not s.pinned
                       for hp in s.host_pages}
        made_in = self._made_in
        for op in self.loads.values():
            for hp in op.host_pages:
                store = snap_writes.get((op.group, hp))
                if store is not None and made_in[store] < made_in[op.id]:
                    raise AssertionError(
                        f"host group {op.group} page {hp}: load {op.id} reads it before "
                        f"store {store} that writes it is acked")

    def check_invariants(self, snapshots: list | None = None) -> None:
        """free + cached + held == total in every host pool, and every
        refcount equals the references its owners (retracted snapshots,
        store and load tickets) hold: a page an unacked copy reads or
        writes is never free."""
        for g, host in enumerate(self.tiers):
            expected = [0] * host.pool.total
            for snap in snapshots or ():
                for p in (snap[g] if snap else ()):
                    if p != HOLE:
                        expected[p] += 1
            for op in self.stores.values():
                if op.group == g:
                    for p in op.host_pages:
                        expected[p] += 1
            for ld in self.loads.values():
                if ld.group == g:
                    for p in ld.host_pages:
                        expected[p] += 1
            for dl in self.disk_loads.values():
                if dl.group == g:
                    for p in dl.host_pages:
                        expected[p] += 1
            check_refcounts(f"host group {g}", host.pool, host.index, expected)
