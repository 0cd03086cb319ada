"""The paged KV cache's storage: one page-major tensor for every layer's K
and V, so that a page is one contiguous region. A run of pages moves (to a
host cache, or to a peer over NIXL) as one copy or one descriptor."""

from __future__ import annotations

import weakref

import torch

from pdserve.transfer import page_runs


class KVCache:
    """One page-major tensor for every layer's K and V:
    [pages, layers, 2, page_size, kv_heads, head_dim]. A page is one
    contiguous region, so moving a run of pages (to host, or to a peer over
    NIXL) is one copy or one descriptor; a layer's K (or V) is a strided view
    [pages, page_size, kv_heads, head_dim]."""

    def __init__(self, layers, pages, page_size, kv_heads, head_dim, dtype, device,
                 pin_memory: bool = False):
        """`pin_memory`: a host cache page-locked for a GPU's DMA (see
        `_pin`); pages are then not zeroed, as a device pool's fresh pages
        are not read before they are written."""
        self.page_size = page_size
        shape = (pages, layers, 2, page_size, kv_heads, head_dim)
        if pin_memory:
            self.data = torch.empty(shape, dtype=dtype)
            self._pin()
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)

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

    def layer(self, i):
        return self.data[:, i, 0], self.data[:, i, 1]

    def layout(self) -> str:
        """The page's shape, as the disk tier names it (disk keys and headers)."""
        return "kv:" + "x".join(str(n) for n in self.data.shape[1:])

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
