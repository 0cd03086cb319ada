"""The paged KV cache's storage: one page-major tensor for every layer's K
and V, so that a page is one contiguous region. A run of pages moves (to a
host cache, or to a peer over NIXL) as one copy or one descriptor.

A page may also hold a second model's layers of the same cache group: a
draft model's (engine.speculative.method: draft), whose K/V are computed
for the same tokens as the target's, so they are cached, stored, read from
disk and shipped to a peer with the page, under the planner's one block
table. Such a page is laid out flat: the target's layers, then the
companion's, each of its own head count and size (`companion`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from pdserve.transfer import page_runs


@dataclass(frozen=True)
class KVShape:
    """A run of layers in every page: how many, and their K/V geometry;
    `tag` names the weights that computed them where the pages' readers
    must tell two models of one shape apart (a draft's fingerprint)."""
    layers: int
    kv_heads: int
    head_dim: int
    tag: str = ""
    parts: int = 2       # K and V; latent attention's one entry a token: 1

    def describe(self, page_size: int) -> str:
        return f"{self.layers}x2x{page_size}x{self.kv_heads}x{self.head_dim}" + \
            (f"@{self.tag}" if self.tag else "")

class KVCache:
    """One page-major tensor for every layer's K and V:
    [pages, layers, 2, page_size, kv_heads, head_dim], or with a companion
    model's layers in the pages [pages, elements of a page], each layer's K
    and V a run of it. Either way a page is one contiguous region, so
    moving a run of pages (to host, or to a peer over NIXL) is one copy or
    one descriptor; a layer's K (or V) is a strided view
    [pages, page_size, kv_heads, head_dim]."""

    def __init__(self, layers, pages, page_size, kv_heads, head_dim, dtype, device,
                 pin_memory: bool = False, companion: KVShape | None = None, parts: int = 2):
        """`pin_memory`: a host cache page-locked for a GPU's DMA (see
        `_pin`); pages are then not zeroed, as a device pool's fresh pages
        are not read before they are written. `companion`: a second
        model's layers in the same pages, after these (layers `layers`
        onwards; `draft_layers` is their view); `data` is then
        [pages, elements of a page]. `parts`: 2, a layer keeps K and V; 1,
        one entry a token (latent attention's latent and rotary key:
        `layer` gives it as K, and None for V)."""
        self.page_size = page_size
        if parts not in (1, 2) or (parts == 1 and companion is not None):
            raise ValueError(f"a KV cache keeps 1 or 2 parts a token, without a companion "
                             f"for 1; got {parts} parts, companion {companion}")
        self.shapes = [KVShape(layers, kv_heads, head_dim, parts=parts)] + \
            ([companion] if companion is not None else [])
        if companion is None:
            shape: tuple = (pages, layers, parts, page_size, kv_heads, head_dim)
        else:
            shape = (pages, sum(_elements(s, page_size) for s in self.shapes))
        if pin_memory:
            self.data = torch.empty(shape, dtype=dtype)
            self._pin()
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        self._layers = self._layer_views() if companion is not None else None

    def _pin(self) -> None:
        """Page-lock `data` in place with cudaHostRegister. torch's
        pin_memory=True allocates through its caching host allocator, which
        rounds every block up to a power of two: a 117 GiB host cache would
        lock (and zero) 128 GiB. A plain allocation registered as it is locks
        exactly its own bytes; it is unregistered when this cache goes."""
        nbytes = self.data.numel() * self.data.element_size()
        if not nbytes:
            return
        cudart = torch.cuda.cudart()
        ptr = self.data.data_ptr()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(
                f"could not page-lock the {nbytes / 2 ** 30:.1f} GiB host KV cache "
                f"(cudaHostRegister: {err}); lower engine.host_pages, or raise the "
                "locked-memory limit (ulimit -l)")
        weakref.finalize(self, cudart.cudaHostUnregister, ptr)

    @property
    def companion(self) -> KVShape | None:
        return self.shapes[1] if len(self.shapes) > 1 else None

    def _layer_views(self) -> list:
        """Each layer's (K, V) views [pages, page_size, kv_heads, head_dim]
        of a flat page, in page order."""
        out, at, pages = [], 0, self.data.shape[0]
        for s in self.shapes:
            n = 2 * self.page_size * s.kv_heads * s.head_dim
            for _ in range(s.layers):
                kv = self.data[:, at:at + n].view(pages, 2, self.page_size, s.kv_heads,
                                                   s.head_dim)
                out.append((kv[:, 0], kv[:, 1]))
                at += n
        return out

    def layer(self, i):
        if self._layers is not None:
            return self._layers[i]
        if self.shapes[0].parts == 1:
            return self.data[:, i, 0], None
        return self.data[:, i, 0], self.data[:, i, 1]

    def draft_layers(self) -> "CompanionLayers":
        """The companion's layers, numbered from 0, as its model reads them."""
        if self.companion is None:
            raise ValueError("this cache's pages hold no second model's layers")
        return CompanionLayers(self, self.shapes[0].layers)

    def layout(self) -> str:
        """The page's shape, as the disk tier names it (disk keys and headers)."""
        if self.companion is None:
            return "kv:" + "x".join(str(n) for n in self.data.shape[1:])
        return "kv:" + "+".join(s.describe(self.page_size) for s in self.shapes)

    def read_page(self, page: int) -> bytes:
        """Page `page`'s bytes, every layer's K and V (a disk write's payload)."""
        return _to_bytes(self.data[page])

    def write_page(self, page: int, data: bytes) -> None:
        """Page `page` = `data`, bytes `read_page` gave for the same layout."""
        _from_bytes(self.data[page], data)

    def copy_pages_from(self, src: "KVCache", src_pages, dst_pages) -> None:
        """This cache's `dst_pages[i]` = `src`'s `src_pages[i]`: one copy per
        run of pages consecutive on both sides. Between a GPU pool and a
        pinned host cache each copy is a DMA queued on the current stream
        (non_blocking) and nothing waits: the caller synchronizes once,
        before it reports the copies done. Stream order already puts them
        before any later kernel that touches the same pages."""
        for s0, d0, n in page_runs(src_pages, dst_pages):
            self.data[d0:d0 + n].copy_(src.data[s0:s0 + n], non_blocking=True)


class CompanionLayers:
    """A companion model's view of a shared cache: its layer j is the
    cache's layer `first + j` (kernels/models/model.py reads caches by `layer`)."""

    def __init__(self, cache: KVCache, first: int):
        self.cache, self.first = cache, first
        self.page_size = cache.page_size

    def layer(self, j: int):
        return self.cache.layer(self.first + j)


def _elements(s: KVShape, page_size: int) -> int:
    return s.layers * 2 * page_size * s.kv_heads * s.head_dim


def _to_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, whatever its dtype (bfloat16 has no numpy twin)."""
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _from_bytes(dst: torch.Tensor, data: bytes) -> None:
    """Fill `dst` (contiguous) from bytes `_to_bytes` made of its shape and dtype."""
    n = dst.numel() * dst.element_size()
    if len(data) != n:
        raise ValueError(f"{len(data)} bytes for a {n}-byte page; the file was written "
                         "for another layout")
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dst.dtype).view(dst.shape)
    dst.copy_(src)
