"""Cache groups: which layers share a block table, and what each keeps.

A model's layers fall into cache groups by what their attention reads. A
full-history group keeps every page of a request's history; a sliding-window
group of window W keeps only the pages the next queries can read (the last
W - 1 positions plus the new rows) and frees the pages that slid out. Every
group uses the engine's one page size; each has its own page pool and block
tables, so a page id means nothing across groups.

A block table holds absolute slots: entry i covers tokens [i*ps, (i+1)*ps).
A sliding group's slots below its window are HOLE once their pages went
back, so slot arithmetic is the same in every group.

A sliding group may be replayable (spec §1.3): it never enters the prefix
cache; after a hit at P the first chunk re-feeds [P - min(W, P), P) and the
model regenerates that group's rows from those tokens.

A snapshot-state group (spec §1.2) holds the layers that keep a fixed-size
state instead of K/V (Qwen3.5's Gated DeltaNet). Its pool's "pages" are
state slots, and its table uses the same absolute slots as the others, but
sparsely: a state block spans `block` tokens (a multiple of the page size),
and block b's state lives in the slot of the block's last page. That entry
holds either the state at the block's end (a checkpoint, cacheable) or, for
the block holding the request's last computed token, its working state.
Every other entry is HOLE.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.scheduler.config import ConfigError

FULL_HISTORY = "full_history"
SLIDING_WINDOW = "sliding_window"
SNAPSHOT_STATE = "snapshot_state"
HOLE = -1      # a slot whose page a sliding group let go


@dataclass(frozen=True)
class CacheGroupSpec:
    retention: str = FULL_HISTORY
    window: int = 0                  # sliding: tokens a query sees, itself included
    replayable: bool = False         # sliding only: recomputed, never cached (§1.3)
    layers: tuple = ()               # the model's layers in this group (executor's business)
    replay: int = 0                  # replayable: rows a hit re-feeds (0: the window)
    block: int = 0                   # state: tokens per state block (0: one page)

    def __post_init__(self) -> None:
        if self.retention not in (FULL_HISTORY, SLIDING_WINDOW, SNAPSHOT_STATE):
            raise ConfigError(f"cache group retention must be {FULL_HISTORY}, "
                              f"{SLIDING_WINDOW} or {SNAPSHOT_STATE}, got {self.retention!r}")
        if self.retention == SNAPSHOT_STATE:
            if self.window or self.replayable or self.replay:
                raise ConfigError("a snapshot-state cache group has no window and is never "
                                  "replayable; only sliding-window groups are")
            if isinstance(self.block, bool) or not isinstance(self.block, int) \
                    or self.block < 0:
                raise ConfigError(f"a snapshot-state group's block is a number of tokens "
                                  f"(0: one page), got {self.block!r}")
        elif self.block:
            raise ConfigError("only a snapshot-state cache group has a state block")
        if self.retention == SLIDING_WINDOW:
            if isinstance(self.window, bool) or not isinstance(self.window, int) \
                    or self.window < 1:
                raise ConfigError(f"a sliding-window cache group needs a window of at "
                                  f"least 1 token, got {self.window!r}")
        elif self.window or self.replayable or self.replay:
            raise ConfigError("a full-history cache group has no window and cannot be "
                              "replayable; only sliding-window groups are")

    @property
    def sliding(self) -> bool:
        return self.retention == SLIDING_WINDOW

    @property
    def state(self) -> bool:
        return self.retention == SNAPSHOT_STATE

    @property
    def keeps_history(self) -> bool:
        return self.retention == FULL_HISTORY

    def block_tokens(self, page_size: int) -> int:
        """Tokens per block: a state group's state block, else one page."""
        return self.block or page_size

    def lookback(self) -> int:
        """Cached positions a query at P reads below P: W - 1 for a sliding
        group (the query reads [P - W + 1, P]), all of them for full history."""
        return self.window - 1 if self.sliding else -1

    def first_live_page(self, begin: int, page_size: int) -> int:
        """The lowest slot a forward whose first row is at `begin` reads;
        every slot below it can go back to the pool (0 for full history)."""
        if not self.sliding:
            return 0
        return max(begin - self.window + 1, 0) // page_size


FULL = CacheGroupSpec()


class StateBlocks:
    """Where a snapshot-state group's table keeps a request's states (pure
    token arithmetic, shared by the coordinator and the executor).

    Block b (tokens [b*B, (b+1)*B), B a multiple of the page size) keeps its
    state in the table entry of its last page: `entry(t)` for the block
    holding token t - 1. A forward over [begin, end) reads entry(begin),
    writes its final state to entry(end) and, when a block boundary falls
    strictly inside and end is off-boundary, the state at the last such
    boundary to that boundary's entry: one aligned checkpoint per forward,
    never every boundary it crosses."""

    def __init__(self, spec: CacheGroupSpec, page_size: int):
        self.spec = spec
        self.page_size = page_size
        self.block = spec.block_tokens(page_size)
        self.per_block = self.block // page_size

    def entry(self, t: int) -> int:
        """The table entry holding the state after the first t tokens (t > 0)."""
        return ((t - 1) // self.block + 1) * self.per_block - 1

    def first_live(self, begin: int) -> int:
        return self.entry(begin) if begin > 0 else 0

    def aligned(self, t: int) -> bool:
        return t > 0 and t % self.block == 0

    def checkpoint(self, begin: int, end: int) -> int:
        """The boundary a forward over [begin, end) materializes besides its
        final state (0: none; an aligned end is its own checkpoint)."""
        if end % self.block == 0:
            return 0
        b = end // self.block * self.block
        return b if b > begin else 0


def describe(groups) -> str:
    parts = []
    for g in groups:
        if g.state:
            what = "snapshot state" + (f", block {g.block}" if g.block else "")
        elif g.sliding:
            what = f"window {g.window}" + (", replayable" if g.replayable else "")
        else:
            what = "full history"
        n = f"{len(g.layers)} layers, " if g.layers else ""
        parts.append(f"{n}{what}")
    return "; ".join(parts)


def replay_window(groups) -> int:
    """W of §1.3: the rows a hit must re-feed, the largest over the
    replayable groups (0: none). It is the window itself for one sliding
    layer; a model whose sliding layers stack declares more (`replay`),
    since each one reads W - 1 positions further back than the one above."""
    return max((g.replay or g.window for g in groups if g.replayable), default=0)


def prefix_granularity(groups, page_size: int) -> int:
    """Tokens between the boundaries every group can resume from: the LCM
    of the groups' blocks (a state group only at its checkpoints)."""
    from math import lcm
    out = page_size
    for g in groups:
        out = lcm(out, g.block_tokens(page_size))
    return out


def check_groups(groups, page_size: int | None = None) -> None:
    """The combinations the coordinator serves, or a ConfigError."""
    full = [g for g in groups if g.keeps_history]
    if len(full) > 1 or (full and groups[0] is not full[0]):
        raise ConfigError("at most one full-history cache group, listed first")
    state = [i for i, g in enumerate(groups) if g.state]
    if state:
        if not full or len(state) > 1 or state[0] != len(groups) - 1:
            raise ConfigError("a snapshot-state cache group comes last, one at most, beside a "
                              "full-history group (the state layers' K/V-keeping partners)")
        if any(g.replayable for g in groups):
            raise ConfigError("a snapshot-state group cannot sit beside replayable sliding "
                              "groups: a replayed row would need the state below the replay, "
                              "which no checkpoint holds; turn engine.sliding_replay off")
        block = groups[state[0]].block
        if page_size and block % page_size:
            raise ConfigError(f"the state group's block of {block} tokens is not a multiple "
                              f"of the page size {page_size}; make it one")
    replayable = [g.replayable for g in groups if g.sliding]
    if any(replayable) and not all(replayable):
        raise ConfigError("bounded replay is all or nothing: a replayed row passes through "
                          "every sliding layer, so either every sliding-window group is "
                          "replayable or none is")
