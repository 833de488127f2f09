"""The KV pool's size (from --max-total-tokens, or the memory the device has free) and the KV
layout a disaggregated peer must share to exchange pages with it."""

from __future__ import annotations

import logging

import torch

from tandem.kernels.kv_cache import PagedKVCache
from tandem.server.cgroup import gib, memory_available
from tandem.server.config import EngineConfig
from tandem.server.disagg.layout import KVLayout
from tandem.server.model.load import LoadedModel

log = logging.getLogger("tandem.engine")


def num_kv_pages(config: EngineConfig, model: LoadedModel, context_length: int) -> int:
    if config.max_total_tokens is not None:
        return config.max_total_tokens // config.page_size
    mc = model.module.config  # this tensor-parallel rank's KV heads
    per_token = kv_bytes_per_token(mc, model.precision.kv)
    free, source = free_memory_bytes(model.device)
    budget = int(free * config.kv_memory_fraction)
    if model.device.type == "cpu":  # every rank's pool comes out of the same host memory
        budget //= model.shard.size
    # Never more than the context length times the slot count: the rest could never be used.
    cap = context_length * config.max_running_requests
    pages = max(1, min(budget // per_token, cap) // config.page_size)
    log.info("KV pool %d tokens: --kv-memory-fraction %g of the free memory%s, %s%s", pages * config.page_size,
             config.kv_memory_fraction, "" if model.shard.size == 1 else f" over {model.shard.size} ranks", source,
             "" if budget // per_token < cap else f"; capped at the context length x --max-running-requests ({cap})")
    return pages


def kv_bytes_per_token(mc, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes on a rank whose share of the model `mc` describes: its KV
    heads' K and V, or MLA's one latent row (which every rank holds whole)."""
    return PagedKVCache.bytes_per_token(mc.num_layers, mc.kv_heads, mc.kv_dim, dtype, 1 if mc.latent else 2)


def free_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Bytes free for the KV pool on `device`, and where that figure comes from. On a CPU, what the
    process's cgroup leaves (a container's memory limit), where that is less than the host's."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return free, f"{gib(free)} free on {device}"
    return memory_available()


def kv_layout(model: LoadedModel, kv: PagedKVCache) -> KVLayout:
    """What a disaggregated peer must share with this engine to exchange KV pages: the whole
    model's pool, whichever share of its KV heads this tensor-parallel rank holds (a latent pool:
    all of it, on every rank)."""
    mc = model.config
    shape = f"L{mc.num_layers}-H{mc.num_heads}-KV{mc.num_kv_heads}-D{mc.head_dim}-V{mc.vocab_size}"
    if mc.latent:
        shape += f"-MLA{mc.kv_lora_rank}+{mc.qk_rope_head_dim}"
    return KVLayout(
        model=f"{mc.architecture}:{model.source.name}:{shape}",
        kv_dtype=str(kv.dtype).removeprefix("torch."),
        page_size=kv.page_size,
        num_layers=kv.num_layers,
        num_kv_heads=mc.kv_heads,
        head_dim=kv.head_dim,
        page_bytes=kv.page_bytes // kv.num_kv_heads * mc.kv_heads,
        kv_parts=kv.parts,
        replicated=mc.latent,
    )
