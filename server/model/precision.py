"""A model's precision: the dtype of its weights, of its math, of its products over many rows and
of its KV cache, decided once at load (`Precision.resolve`) from --dtype, --prefill-dtype,
--kv-cache-dtype and --gguf-blocks, the device, and the GGUF blocks the model comes with.

The four choices are made in order, each from the ones before it:
1. weights (`resolve_dtype`): what --dtype asks, or what `auto` means on this device and CPU;
2. compute (`compute_dtype_for`): the weights' dtype, or float32 where the CPU would emulate it;
3. prefill (`resolve_prefill_dtype`): products over many rows, bfloat16 only over float32 weights on a CPU;
4. KV cache (`resolve_kv_dtype`): the compute dtype, or bfloat16 beside bfloat16 prompt products.
A new numeric form (quantized checkpoints' FP8, say) is one more field of `Precision` and one more
step here; the model and the engine read the record, never the flags.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.block_linear import BlockWeights, fits_four_bits
from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.kernels.isa import runnable_flags
from tandem.kernels.weight_forms import onednn_supports
from tandem.server.config import EngineConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16", as the flags spell it."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Precision:
    """What a loaded model keeps and computes in. Made once by `resolve` (or `uniform`), read by the
    model (`LlamaForCausalLM`), the KV pool and the engine; the `*_why` fields are what the startup
    log says of each choice."""

    weights: torch.dtype  # what the weights are rounded to (--dtype)
    compute: torch.dtype  # what the math runs in, and the weights are held in: `weights`, or float32 where it is emulated
    prefill: torch.dtype  # products over many rows (prefill chunks, larger decode steps) and prompt attention
    kv: torch.dtype  # what the KV cache keeps
    four_bit: bool  # GGUF blocks that fit 4 bits are multiplied in that form (--gguf-blocks 4bit), else as int8
    weights_why: str  # why `weights` ("asked for", or what auto found); `describe` adds why `compute` differs
    prefill_why: str
    kv_why: str

    @classmethod
    def resolve(cls, config: EngineConfig, device: torch.device, blocks: dict[str, BlockWeights]) -> Precision:
        """The precision `config`'s flags choose on `device` for a model that comes with `blocks`
        (a GGUF file's block-quantized weights, {} for others), the flags `check`ed before the model
        loaded. Raises ValueError naming the flag where they cannot be followed here."""
        four_bit = config.gguf_blocks == "4bit"
        weights, weights_why = resolve_dtype(config.dtype, device, block_weights=bool(blocks),
                                             four_bit=four_bit and any(fits_four_bits(b) for b in blocks.values()))
        compute = compute_dtype_for(DTYPES[weights], device)
        prefill, prefill_why = resolve_prefill_dtype(config.prefill_dtype, config.dtype, weights, device)
        kv, kv_why = resolve_kv_dtype(config.kv_cache_dtype, compute, DTYPES[prefill], device)
        return cls(DTYPES[weights], compute, DTYPES[prefill], kv, four_bit, weights_why, prefill_why, kv_why)

    @classmethod
    def uniform(cls, dtype: torch.dtype) -> Precision:
        """Everything in `dtype`: a model built from weights in hand (tests, benchmarks) rather than
        loaded from flags."""
        return cls(dtype, dtype, dtype, dtype, True, "given", "given", "given")

    @property
    def narrow_prefill(self) -> torch.dtype | None:
        """The dtype products over many rows narrow to where it is not the weights' (bfloat16 over
        float32 weights on a CPU: `Linear`'s prefill_dtype), else None."""
        return self.prefill if self.prefill != self.weights else None

    def describe(self) -> str:
        """Each choice and why, as the startup log line says them."""
        why = self.weights_why
        if self.compute != self.weights:
            why += f"; float32 math and KV cache: this CPU has no native {dtype_name(self.weights)} instructions"
        return (f"{dtype_name(self.weights)} weights ({why}); batched projections in {dtype_name(self.prefill)} "
                f"({self.prefill_why}); KV cache in {dtype_name(self.kv)} ({self.kv_why})")


def check(config: EngineConfig) -> None:
    """Raise ValueError for a --gguf-blocks or --dtype no precision can follow (before anything loads)."""
    if config.gguf_blocks not in ("4bit", "int8"):
        raise ValueError(f"--gguf-blocks={config.gguf_blocks!r} is invalid: choose 4bit or int8")
    if config.dtype != "auto" and config.dtype not in DTYPES:
        raise ValueError(f"--dtype={config.dtype!r} is invalid: choose auto or one of {', '.join(DTYPES)}")


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
      bfloat16 on an AVX512-BF16 CPU (`tandem bench offline`, docs/performance-log.md), while with AMX
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
    more (2 or more over 4-bit blocks held in stripes: `tandem.kernels.weight_forms`), and the attention of prompt pieces (`TorchAttention`; not decode
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
                             f"dtype, {dtype_name(compute)}")
        if compute not in (torch.float32, torch.bfloat16):
            raise ValueError(f"--kv-cache-dtype={kv_cache_dtype} with {dtype_name(compute)} math: "
                             "a KV cache other than the compute dtype needs float32 or bfloat16 math")
    return kv, "asked for"
