"""What a peer must agree on to exchange KV pages: `KvLayout`, one per
engine, carried in its transport's metadata and compared when two peers
meet (`check_peer`), so a pair that cannot map its pages is refused at the
handshake with both sides named, not at the first write.

Each rank of an engine holds its KV heads of every page; between engines
of tensor-parallel sizes p and d each D rank is written the heads it owns
by the P ranks that hold them (transfer/tp/pieces.py says which, from the
two layouts). So two engines of different sizes map as long as the
model's KV geometry, dtype and page size agree; the size says who holds
which heads."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KvLayout:
    tensor_parallel_size: int   # the engine's ranks (whole pages on the wire regardless)
    kv_heads: int               # the model's KV heads (every rank's together)
    head_dim: int
    dtype: str                  # torch's name: "float32", "bfloat16", ...
    page_size: int              # tokens per page
    layers: tuple               # layers per cache group
    # a draft model's layers in each group's pages ("" per group without),
    # as kernels/kv_cache.KVShape describes them; () when none has any
    draft: tuple = ()
    # what a token keeps per layer and head: K and V (2), or latent
    # attention's one entry (1: one "head", the latent and rotary key, which
    # every rank of a tensor-parallel engine holds whole)
    parts: int = 2

    def describe(self, name: str) -> str:
        what = f"{self.kv_heads} KV heads x {self.head_dim}" if self.parts == 2 else \
            f"a latent entry of {self.head_dim} a token"
        return (f"{name} (tensor_parallel_size {self.tensor_parallel_size}: {what}, "
                f"{self.dtype}, pages of {self.page_size} tokens, "
                f"{'+'.join(str(n) for n in self.layers)} layers"
                + (f", draft layers {'+'.join(d or '-' for d in self.draft)}" if self.draft
                   else "") + ")")

    def mismatch(self, other: "KvLayout") -> list[str]:
        """What differs between the two that a page cannot be mapped across."""
        out = []
        for field, what in (("parts", "K/V parts"), ("kv_heads", "KV heads"),
                            ("head_dim", "head size"),
                            ("dtype", "dtype"), ("page_size", "page size"),
                            ("layers", "layers per cache group"),
                            ("draft", "draft model's layers in the pages")):
            if getattr(self, field) != getattr(other, field):
                out.append(what)
        return out

    def check_peer(self, me: str, other: "KvLayout", peer: str) -> None:
        """ValueError naming both sides when their pages cannot be mapped."""
        bad = self.mismatch(other)
        if bad:
            raise ValueError(f"{self.describe(me)} and {other.describe(peer)} cannot exchange KV "
                             f"pages: their {', '.join(bad)} differ; serve the same model, "
                             "model.dtype and engine.page_size on both roles")

    def as_json(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers)
        d["draft"] = list(self.draft)
        return d

    @classmethod
    def from_json(cls, d) -> "KvLayout":
        if not isinstance(d, dict):
            raise ValueError(f"a KV layout must be a mapping, got {d!r}")
        try:
            return cls(int(d["tensor_parallel_size"]), int(d["kv_heads"]), int(d["head_dim"]),
                       str(d["dtype"]), int(d["page_size"]), tuple(int(n) for n in d["layers"]),
                       tuple(str(x) for x in d.get("draft", ())), int(d.get("parts", 2)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a KV layout lacks or garbles {e}: {d!r}") from None
