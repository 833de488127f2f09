"""Which attention backend runs a model: `create_backend` picks and builds one by name.

A module of its own so that the interface (`attention.py`) imports none of the backends that
implement it.
"""

from __future__ import annotations

import torch

from tandem.kernels.attention import AttentionBackend
from tandem.kernels.kv_cache import PagedKVCache


def create_backend(name: str, kv_cache: PagedKVCache, num_heads: int, head_dim: int, scale: float | None = None,
                   windows: tuple[int, ...] = (), prompt_dtype: torch.dtype | None = None) -> AttentionBackend:
    """`auto` picks FlashInfer on CUDA for 16-bit caches (it has no float32 kernels) and the torch
    backend everywhere else, and for models with sliding-window layers or a latent KV cache, which
    tandem does not plan with FlashInfer yet. `scale`: of q.k (default 1/sqrt(head_dim));
    `windows`: per layer, 0 or its sliding window; `prompt_dtype`: the torch backend's prompt
    pieces compute their attention in it (a float32 model's `--prefill-dtype`), None: in q's dtype."""
    scale = head_dim**-0.5 if scale is None else scale
    if name == "auto":
        half = kv_cache.dtype in (torch.float16, torch.bfloat16)
        plain = not any(windows) and not kv_cache.latent
        name = "flashinfer" if kv_cache.device.type == "cuda" and half and plain else "torch"
    if name == "torch":
        from tandem.kernels.torch_attention import TorchAttention

        return TorchAttention(kv_cache, num_heads, head_dim, scale, windows, prompt_dtype=prompt_dtype)
    if name == "flashinfer":
        if kv_cache.device.type != "cuda":
            raise ValueError("--attention-backend=flashinfer needs a CUDA device")
        if any(windows) or kv_cache.latent:
            raise ValueError("--attention-backend=flashinfer does not run sliding-window layers (Gemma 3) or latent "
                             "attention (DeepSeek-V3) yet: use --attention-backend torch or auto")
        from tandem.kernels.flashinfer_attention import FlashInferAttention

        return FlashInferAttention(kv_cache, num_heads, head_dim, scale)
    raise ValueError(f"--attention-backend={name!r} is unknown: choose auto, torch or flashinfer")
