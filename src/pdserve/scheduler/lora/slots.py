"""The device's LoRA adapter slots: which adapter load each holds, and who
references it.

A request under an adapter takes a reference on its adapter's slot when it
is first admitted (a new prompt, a D's remote admission, a P's twin) and
keeps it while anything of it may still read that slot's weights: while it
is resident, retracted with a host snapshot (it resumes under the same
slot), landing on D, or waiting for its ack on P. It lets go when it leaves
the planner, or when retraction sends it back to the waiting line with
nothing kept (it then competes as a newcomer, for a slot too).

A slot is reused only when quiescent, no reference left: then no forward,
transfer, lease or retracted request can read it. A request whose adapter
holds no slot takes an empty one, else the least recently taken quiescent
one; if every slot is referenced it waits (Hold.ADAPTER_SLOT) and, FIFO,
so does everyone behind it, so the slots drain and it cannot starve.
Because every admitted request holds its slot, a round never mixes more
distinct adapters than there are slots.

A pinned load (`pin`, SGLang's pinning) keeps the slot it takes: the slot
is never handed to another load, quiescent or not, until the load is
unpinned or forgotten. At most slots - 1 loads are pinned, so unpinned
adapters always have a slot to rotate through.
"""

from __future__ import annotations

from pdserve.scheduler.lora.adapters import BASE


class SlotError(AssertionError):
    """The slot table disagrees with the requests that reference it."""


class AdapterSlots:
    __slots__ = ("slots", "holder", "refs", "pinned", "_of", "_taken", "_clock")

    def __init__(self, slots: int):
        self.slots = slots
        self.holder = [BASE] * slots       # the load id each slot holds (BASE: empty)
        self.refs = [0] * slots            # live requests referencing each slot
        self._of: dict[int, int] = {}      # load id -> its slot
        self._taken = [0] * slots          # when each slot was last taken (LRU)
        self._clock = 0
        self.pinned: set[int] = set()      # load ids whose slot is never reused

    def pin(self, adapter: int) -> None:
        """Keep `adapter`'s slot, once it takes one, from every other load."""
        if adapter in self.pinned:
            return
        if len(self.pinned) + 1 >= self.slots:
            raise ValueError(f"cannot pin another LoRA adapter: {len(self.pinned)} of "
                             f"lora.max_loras={self.slots} device slots are pinned and one "
                             "must stay free for the unpinned adapters; raise max_loras or "
                             "unpin one")
        self.pinned.add(adapter)

    def unpin(self, adapter: int) -> None:
        self.pinned.discard(adapter)

    def slot_of(self, adapter: int) -> int | None:
        return self._of.get(adapter)

    def can_take(self, adapter: int) -> bool:
        """Whether a request under `adapter` could be admitted now."""
        return adapter == BASE or adapter in self._of or any(
            r == 0 and h not in self.pinned for r, h in zip(self.refs, self.holder))

    def take(self, req) -> None:
        """Reference `req`'s adapter's slot, assigning one if it has none
        (can_take must hold). A request already holding one keeps it."""
        if req.adapter == BASE or req.lora_slot >= 0:
            return
        slot = self._of.get(req.adapter)
        if slot is None:
            slot = self._quiescent()
            if self.holder[slot] != BASE:
                del self._of[self.holder[slot]]
            self.holder[slot] = req.adapter
            self._of[req.adapter] = slot
        self.refs[slot] += 1
        self._clock += 1
        self._taken[slot] = self._clock
        req.lora_slot = slot

    def release(self, req) -> None:
        """`req` no longer reads its slot."""
        if req.lora_slot >= 0:
            self.refs[req.lora_slot] -= 1
            req.lora_slot = -1

    def _quiescent(self) -> int:
        """An empty slot (the lowest), else the least recently taken
        unreferenced one that no pinned load holds."""
        free = [s for s in range(self.slots)
                if self.refs[s] == 0 and self.holder[s] not in self.pinned]
        if not free:
            raise SlotError("no quiescent adapter slot: check can_take before take")
        empty = [s for s in free if self.holder[s] == BASE]
        return empty[0] if empty else min(free, key=lambda s: self._taken[s])

    def forget(self, adapter: int) -> None:
        """An unloaded adapter's slot, unreferenced, is empty again."""
        self.pinned.discard(adapter)
        slot = self._of.get(adapter)
        if slot is not None and self.refs[slot] == 0:
            del self._of[adapter]
            self.holder[slot] = BASE

    def in_use(self) -> int:
        return sum(1 for r in self.refs if r)

    def check_invariants(self, requests) -> None:
        """Each slot's count is the live requests that name it, each under
        the load the slot holds; the load index matches the holders."""
        counts = [0] * self.slots
        for req in requests:
            if req.lora_slot >= 0:
                counts[req.lora_slot] += 1
                if self.holder[req.lora_slot] != req.adapter:
                    raise SlotError(f"{req.id} (adapter load {req.adapter}) references slot "
                                    f"{req.lora_slot}, which holds load "
                                    f"{self.holder[req.lora_slot]}")
        if counts != self.refs:
            raise SlotError(f"adapter slot references {self.refs}, but live requests hold "
                            f"{counts}")
        if self.pinned and len(self.pinned) >= self.slots:
            raise SlotError(f"{len(self.pinned)} pinned loads for {self.slots} slots")
        want = {a: s for s, a in enumerate(self.holder) if a != BASE}
        if want != self._of:
            raise SlotError(f"adapter slot index {self._of} disagrees with holders {want}")
