"""Loading a model: weights, the torch module and its tokenizer, bundled for the engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.common.cpu import ISA_CAP_VARIABLE, cpu_flags, isa_cap
from tandem.kernels.block_linear import fits_four_bits
from tandem.kernels.isa import cpu_features, runnable_flags
from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.kernels.linear import onednn_supports
from tandem.server.model.config import ModelConfig
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.loader import ModelLoadError, ModelSource, load_block_weights, load_weights, resolve_model
from tandem.server.model.random_weights import SHAPES, random_weights
from tandem.server.model.shard import Shard

log = logging.getLogger("tandem.model")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    source: ModelSource
    config: ModelConfig
    module: LlamaForCausalLM
    tokenizer: object  # a transformers tokenizer (None on tensor-parallel ranks other than 0)
    dtype: torch.dtype  # precision of the weights (--dtype)
    compute_dtype: torch.dtype  # what the math uses: dtype, or float32 where dtype is emulated
    device: torch.device
    shard: Shard = Shard()  # which tensor-parallel rank's share `module` holds (config: the whole model's)
    kv_dtype: torch.dtype | None = None  # what the KV cache keeps (resolve_kv_dtype); None: compute_dtype

    def __post_init__(self):
        if self.kv_dtype is None:
            self.kv_dtype = self.compute_dtype

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set(self.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


_CPU_HALF_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def _native_bf16_flags(flags: list[str]) -> list[str]:
    """The flags among `flags` with which this CPU multiplies bfloat16 natively."""
    return [flag for flag in _CPU_HALF_FLAGS[torch.bfloat16] if flag in flags]


def resolve_dtype(dtype: str, device: torch.device, block_weights: bool = False,
                  four_bit: bool = False) -> tuple[str, str]:
    """The dtype to load with, and why. `auto` is bfloat16 on CUDA. On a CPU it is float32 where the
    model comes with GGUF blocks and tandem's CPU kernels run (attention reads the float32 KV pages
    in place):
    - with 4-bit blocks (`four_bit`: Q4_0/Q4_1 kept as the file keeps them, 0.625 bytes a weight),
      everywhere: on a 2-core Xeon with AMX, a SmolLM2 decode step took 18.0 ms at 1 row against
      bfloat16's 33.1, and 36.8 against 38.6 at 8 rows (`tandem bench step --compare weights`);
    - with int8 blocks (1.25 bytes a weight), where the CPU has no AMX: measured faster than native
      bfloat16 on an AVX512-BF16 CPU (`tandem bench offline`, docs/performance.md), while with AMX
      bfloat16 won: `tandem bench offline --skip-hf --max-running-requests 8` served 174-177 tok/s
      in bfloat16 against 140 with float32 weights, int8 blocks and bfloat16 prefill products.
    Otherwise bfloat16 where the CPU multiplies it natively (AVX512-BF16 or AMX), else float32,
    which a CPU without them computes as fast as emulated bfloat16 and exactly."""
    if dtype != "auto":
        return dtype, "asked for"
    if device.type == "cuda":
        return "bfloat16", "auto: CUDA"
    flags = runnable_flags()
    kernels_missing = None
    if block_weights and (four_bit or "amx_bf16" not in flags):
        kernels_missing = cpu_ops_unavailable()
        if kernels_missing is None and four_bit:
            return "float32", ("auto: decodes from the GGUF file's 4-bit blocks with tandem's CPU kernels, faster than "
                               "bfloat16 here")
        if kernels_missing is None:
            return "float32", "auto: decodes from the GGUF file's int8 blocks with tandem's CPU kernels, faster than bfloat16 without AMX"
    native = _native_bf16_flags(flags)
    if native:
        why = f"auto: this CPU multiplies bfloat16 natively ({', '.join(native)})"
        if kernels_missing:
            why += f"; tandem's CPU kernels, faster here, cannot run: {kernels_missing}"
        elif block_weights and "amx_bf16" in flags:
            why += "; with AMX, faster than float32 with the GGUF file's int8 blocks"
        return "bfloat16", why
    return "float32", "auto: this CPU has neither AVX512-BF16 nor AMX, so bfloat16 would be emulated"


def compute_dtype_for(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to do math in (and, by default, keep the KV cache in: resolve_kv_dtype). A CPU
    without bf16/fp16 instructions emulates them 2-4x slower than float32 (measured: GEMMs and
    SDPA); there the weights keep their 16-bit values (rounded at load) but the arithmetic runs in
    float32. The KV cache follows the math: a 16-bit cache would cost a conversion of every
    gathered page on every layer."""
    if device.type != "cpu" or dtype not in _CPU_HALF_FLAGS:
        return dtype
    flags = runnable_flags()
    return dtype if any(flag in flags for flag in _CPU_HALF_FLAGS[dtype]) else torch.float32


def resolve_prefill_dtype(prefill_dtype: str, asked_dtype: str, dtype: str, device: torch.device) -> tuple[str, str]:
    """The dtype of projections over many rows, and why. Only float32 weights on a CPU have a
    choice: bfloat16 there rounds the inputs of prefill products and of decode steps of 5 rows or
    more (2 or more over 4-bit blocks held in stripes: `tandem.kernels.linear`), and the attention of prompt pieces (`TorchAttention`; not decode
    attention or smaller decode steps, and the KV cache only as `resolve_kv_dtype` decides), for two
    to three times float32's speed on AVX512-BF16. `auto` takes it only where `--dtype` was auto
    too, so that `--dtype float32` stays exact."""
    if dtype != "float32" or device.type != "cpu":
        if prefill_dtype == "bfloat16":
            raise ValueError(f"--prefill-dtype=bfloat16 applies to float32 weights on a CPU; here they are {dtype} on {device}")
        return dtype, "as the weights"
    if prefill_dtype != "auto":
        return prefill_dtype, "asked for"
    native = _native_bf16_flags(runnable_flags())
    if asked_dtype == "auto" and native and onednn_supports(torch.bfloat16):
        return "bfloat16", f"auto: this CPU multiplies bfloat16 natively ({', '.join(native)}), 2-3x float32's speed"
    if asked_dtype != "auto":
        return "float32", "auto: --dtype float32 asked for exact math"
    return "float32", "auto: no native bfloat16 on this CPU"


def resolve_kv_dtype(kv_cache_dtype: str, compute: torch.dtype, prefill: torch.dtype,
                     device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype the KV cache keeps, and why. `auto`: the compute dtype, except where a float32
    model's prompt products run in bfloat16 (`resolve_prefill_dtype`) on a CPU that multiplies
    bfloat16 natively: there bfloat16, half the bytes each decode step's attention reads
    (`paged_decode_attention` widens them as it loads; over float32 pages it took ~40% of an
    8-sequence decode step of SmolLM2 at ~350 tokens on a 2-core Zen 5). Prompts' K and V come out
    of bfloat16 products there already; what it adds is the rounding of the K and V of decode steps
    whose products stay float32 (one row over 4-bit blocks, below BFLOAT16_MIN_ROWS otherwise), while `--dtype float32` (exact) keeps float32. A cache other than the
    compute dtype: on a CPU, float32 or bfloat16 beside float32 or bfloat16 math (tandem's kernels
    read both); on CUDA the attention kernels read the compute dtype."""
    if kv_cache_dtype == "auto":
        native = device.type == "cpu" and _native_bf16_flags(runnable_flags())
        if native and compute == torch.float32 and prefill == torch.bfloat16:
            return torch.bfloat16, (f"auto: prompt products in bfloat16 on this CPU ({', '.join(native)}); half the "
                                    "bytes for decode attention")
        return compute, "auto: as the math"
    if kv_cache_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--kv-cache-dtype={kv_cache_dtype!r} is invalid: choose auto, float32 or bfloat16")
    kv = DTYPES[kv_cache_dtype]
    if kv != compute:
        if device.type != "cpu":
            raise ValueError(f"--kv-cache-dtype={kv_cache_dtype} on {device}: the KV cache there keeps the compute "
                             f"dtype, {str(compute).removeprefix('torch.')}")
        if compute not in (torch.float32, torch.bfloat16):
            raise ValueError(f"--kv-cache-dtype={kv_cache_dtype} with {str(compute).removeprefix('torch.')} math: "
                             "a KV cache other than the compute dtype needs float32 or bfloat16 math")
    return kv, "asked for"


def load_model(model: str, dtype: str, device: str, prefill_dtype: str = "auto", shard: Shard = Shard(),
               all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, gguf_blocks: str = "4bit",
               kv_cache_dtype: str = "auto") -> LoadedModel:
    """`shard`, `all_reduce`: load one tensor-parallel rank's share (`tandem.server.model.shard`).
    `gguf_blocks`: 4bit or int8, the form small products read a GGUF file's Q4 blocks in (`Linear`).
    `kv_cache_dtype`: auto, float32 or bfloat16 (`resolve_kv_dtype`)."""
    if gguf_blocks not in ("4bit", "int8"):
        raise ValueError(f"--gguf-blocks={gguf_blocks!r} is invalid: choose 4bit or int8")
    from tandem.server.model.tokenizer import load_tokenizer

    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is invalid: choose auto or one of {', '.join(DTYPES)}")
    source = resolve_model(model)
    dev = resolve_device(device)
    # Random weights are drawn below, on the device in the dtype it computes in.
    config, weights = (SHAPES[source.name], None) if source.kind == "random" else load_weights(source)
    shard.check(config)
    blocks = load_block_weights(source, config) if dev.type == "cpu" else {}
    asked = dtype
    four_bit = gguf_blocks == "4bit" and any(fits_four_bits(b) for b in blocks.values())
    dtype, why = resolve_dtype(asked, dev, block_weights=bool(blocks), four_bit=four_bit)
    compute = compute_dtype_for(DTYPES[dtype], dev)
    if compute != DTYPES[dtype]:
        why += f"; float32 math and KV cache: this CPU has no native {dtype} instructions"
    prefill, prefill_why = resolve_prefill_dtype(prefill_dtype, asked, dtype, dev)
    kv, kv_why = resolve_kv_dtype(kv_cache_dtype, compute, DTYPES[prefill], dev)
    if weights is None:
        weights = random_weights(config, compute, dev)
    module = LlamaForCausalLM(config, weights, DTYPES[dtype], dev, compute_dtype=compute, blocks=blocks,
                              prefill_dtype=DTYPES[prefill] if prefill != dtype else None, shard=shard,
                              all_reduce=all_reduce, four_bit=gguf_blocks == "4bit")
    del weights  # the module holds its own (fused) copies
    if dev.type == "cuda":  # give the unfused copies back, so that the KV pool can size itself from what is free
        torch.cuda.empty_cache()
    if shard.rank:
        return LoadedModel(source, config, module, None, DTYPES[dtype], compute, dev, shard, kv)
    log.info("%s: %s", source.name, config.describe())
    first = module.layers[0]
    layer_linear = getattr(first, "qkv", None) or getattr(first, "gate_up", None)
    forms = (f"layers' projections: {layer_linear.describe()}; " if layer_linear is not None else "") + \
        f"LM head: {module.lm_head.describe()}"
    log.info("%s on %s: %s weights (%s); batched projections in %s (%s); KV cache in %s (%s); %s; CPU flags: %s%s%s",
             source.name, dev, dtype, why, prefill, prefill_why, str(kv).removeprefix("torch."), kv_why, forms,
             " ".join(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))) or "-",
             f" ({cpu_features().describe()})" if dev.type == "cpu" else "",
             f", capped at {cap} by {ISA_CAP_VARIABLE}" if (cap := isa_cap()) else "")
    return LoadedModel(source, config, module, load_tokenizer(source), DTYPES[dtype], compute, dev, shard, kv)


__all__ = ["LoadedModel", "ModelConfig", "Shard", "ModelLoadError", "load_model", "resolve_device", "resolve_dtype",
           "resolve_prefill_dtype", "resolve_kv_dtype", "compute_dtype_for", "cpu_flags", "DTYPES"]
