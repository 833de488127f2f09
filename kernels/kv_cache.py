"""The paged KV pool: per layer one K and one V tensor of [num_pages, page_size, num_kv_heads,
head_dim] (FlashInfer's NHD paged layout). Page ids come from the scheduler's PageAllocator.

All of them are views into one contiguous buffer [num_layers, 2, num_pages, page_size,
num_kv_heads, head_dim], so a KV transfer registers a single memory region. A latent cache
(multi-head latent attention, `value_dim` set) holds one part per layer, [num_layers, 1, ...]:
each row is a token's latent and rotated key part, and V is a view of each row's first
`value_dim` values. On a CPU that buffer
asks Linux for transparent huge pages: a decode step reads each sequence's pages wherever the
allocator put them, and over gigabytes of 4 KiB pages most of those reads also miss the TLB
(`tandem bench step --compare kv-pages`)."""

from __future__ import annotations

import ctypes
import sys

import torch

from tandem.kernels.layer_ops import cuda_kernels

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned part of `t`'s memory with transparent huge pages (which
    it does where /sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`). Pages
    already touched stay as they are, so call it before writing. True if the kernel took the advice."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    first, end = -(-start // HUGE_PAGE) * HUGE_PAGE, (start + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), MADV_HUGEPAGE) == 0


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        huge_pages: bool = True,
        value_dim: int | None = None,
    ):
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.value_dim = value_dim  # latent: V is K[..., :value_dim]; None: a V of its own
        self.parts = 1 if value_dim is not None else 2
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        # Zeroed, not empty: backends read whole pages, including the unwritten tail of a
        # sequence's last page. Masked scores drop those positions, but 0 * NaN is still NaN in
        # softmax(QK) @ V, so every slot must always hold a finite value.
        self.buffer = torch.empty((num_layers, self.parts, *shape), dtype=dtype, device=self.device)
        self.huge_pages = huge_pages and advise_huge_pages(self.buffer)
        self.buffer.zero_()
        self.k = [self.buffer[layer, 0] for layer in range(num_layers)]
        self.v = [self.buffer[layer, 1] if self.parts == 2 else self.k[layer][..., :value_dim]
                  for layer in range(num_layers)]

    @property
    def latent(self) -> bool:
        return self.parts == 1

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V, or latent)."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.buffer.element_size()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, parts: int = 2) -> int:
        """`parts`: 2 (K and V) or 1 (a latent cache)."""
        return parts * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def flat_k(self, layer: int) -> torch.Tensor:
        return self.k[layer].view(-1, self.num_kv_heads, self.head_dim)

    def flat_v(self, layer: int) -> torch.Tensor:
        return self.v[layer].view(-1, self.num_kv_heads, self.head_dim)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Store the new tokens' K and V (a latent cache: K alone, v None) at flat slots (page *
        page_size + offset), in the cache's dtype (which may be narrower than the compute dtype).
        On CUDA, K and V already in the cache's 16-bit dtype go in one kernel (`triton_ops`)."""
        if self.parts == 2 and self.device.type == "cuda":
            kernels = cuda_kernels(self.buffer, k, v)
            if kernels is not None and kernels.takes_kv(k) and kernels.takes_kv(v):
                kernels.store_kv(self.k[layer], self.v[layer], slots, k, v)
                return
        self.flat_k(layer)[slots] = k.to(self.dtype)
        if self.parts == 2:
            self.flat_v(layer)[slots] = v.to(self.dtype)


def flat_slots(pages: list[int], start: int, end: int, page_size: int) -> list[int]:
    """Flat KV slots of positions [start, end) of a sequence with page table `pages`."""
    return [pages[pos // page_size] * page_size + pos % page_size for pos in range(start, end)]
