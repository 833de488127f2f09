"""Projections over block-quantized weights: the form a GGUF file stores them in, streamed as int8.

GGUF's Q8_0, Q4_0 and Q4_1 tensors hold each run of 32 weights as small integers with a 16-bit
scale (and, for Q4_1, a 16-bit offset): `w = q * scale + offset`. The loader keeps them as
`BlockWeights` (q widened to int8, scale and offset widened to float32) next to the dequantized
float32 weights. `block_gemm` (a C++ operator, csrc/block_gemm.cpp, built by cpu_ops.py) rebuilds
each weight in float32 with one fused multiply-add, which gives the dequantized value bit for bit,
and multiplies in float32: the arithmetic is float32's, the bytes streamed per weight are 1.25
instead of 4.

Where the values fit, the file's own forms are kept instead (`Linear` packs them, through the block
forms of weight_forms.py): `Nibbles` for Q4_0 and Q4_1 (`block_gemm_q4`, 0.625 bytes a weight),
`Bytes` for Q8_0 (`block_gemm_q8`, 1.0625), rebuilding the same values.

It pays where decoding is bound by weight bandwidth, a few rows at a time; larger batches go to
oneDNN (`Linear` picks per call; `BLOCK_MAX_ROWS`). `tandem bench linear` measures both.

`block_gemm_bf16` (csrc/block_gemm_bf16.cpp) streams the same blocks, in any of the three forms, but
rounds the rebuilt weights and x to bfloat16 and multiplies with AVX512-BF16's dot products (float32
sums): where several rows make the float32 kernels bound by arithmetic, not bytes, it does the same
product in less time. It is not exact: `Linear` uses it only where products are asked to run in
bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.kernels.isa import runnable_flags

BLOCK = 32
# Up to this many rows the int8 blocks beat oneDNN's float32 (measured on a 2-core AVX2 EPYC over
# all of SmolLM2's projections: ~2x at 1-4 rows, 1.2-1.4x at 8, 0.8-0.9x at 16).
BLOCK_MAX_ROWS = 8


@dataclass
class BlockWeights:
    """A [N, K] weight as `q * scale + offset` over 32-wide blocks of each row."""

    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K // 32] float32
    offset: torch.Tensor  # [N, K // 32] float32

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        blocks = torch.addcmul(self.offset[..., None], self.q.view(n, k // BLOCK, BLOCK).float(), self.scale[..., None])
        return blocks.view(n, k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset))

    def rows(self, index) -> BlockWeights:
        return BlockWeights(self.q[index].contiguous(), self.scale[index].contiguous(), self.offset[index].contiguous())

    def columns(self, first: int, last: int) -> BlockWeights:
        """Columns [first * 32, last * 32): whole blocks [first, last) of every row."""
        return BlockWeights(self.q[:, first * BLOCK : last * BLOCK].contiguous(), self.scale[:, first:last].contiguous(),
                            self.offset[:, first:last].contiguous())

    @staticmethod
    def cat(parts: list[BlockWeights]) -> BlockWeights:
        return BlockWeights(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "offset")))


@dataclass
class Nibbles:
    """Blocks whose values fit 4 bits (GGUF's Q4_0 and Q4_1) as the file keeps them: two values to a
    byte (block byte j: element j low, element 16 + j high), a float16 scale and offset per block,
    0.625 bytes a weight. `w = nibble * scale + offset`, the same values as the BlockWeights they
    were packed from (`pack`)."""

    q: torch.Tensor  # [N, K // 2] uint8
    scale: torch.Tensor  # [N, K // 32] float16
    offset: torch.Tensor  # [N, K // 32] float16

    @staticmethod
    def pack(w: BlockWeights) -> Nibbles | None:
        """`w` in 4 bits, or None where it does not fit: a block's values must span 0..15 (Q4_1), or
        -8..7 with no offset (Q4_0, stored as nibble - 8: offset -8 * scale, exact), and every scale
        and offset must be a float16 (as GGUF's are)."""
        n, k = w.q.shape
        blocks = w.q.view(n, k // BLOCK, BLOCK)
        low, high = blocks.amin(-1), blocks.amax(-1)
        as_is = (low >= 0) & (high <= 15)
        shifted = ~as_is & (low >= -8) & (high <= 7) & (w.offset == 0)
        if not bool((as_is | shifted).all()):
            return None
        shift = shifted.to(torch.int8) * 8
        offset = w.offset - shift.float() * w.scale
        scale16, offset16 = w.scale.half(), offset.half()
        if not (torch.equal(scale16.float(), w.scale) and torch.equal(offset16.float(), offset)):
            return None
        packed = _pack_nibbles((blocks + shift[..., None]).to(torch.uint8))
        return Nibbles(packed.reshape(n, k // 2).contiguous(), scale16.contiguous(), offset16.contiguous())

    def dequantize(self) -> torch.Tensor:
        n, half = self.q.shape
        nibbles = _nibbles(self.q).float()
        return torch.addcmul(self.offset.float()[..., None], nibbles, self.scale.float()[..., None]).view(n, half * 2)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset))


@dataclass
class NibbleStripes:
    """The same 4-bit blocks regrouped for `block_gemm_q4_stripes` in stripes of 16 weight rows, so that
    a vector holds 16 rows side by side and the nibbles are multiplied as they are: per stripe and block,
    eight column quads of 32 bytes (row j's two: columns 4c and 4c + 2 in one byte's low and high
    nibble, 4c + 1 and 4c + 3 in the next), then the block's 16 scales and 16 offsets. The bytes and
    values of the Nibbles they come from (`from_nibbles`), in another order."""

    q: torch.Tensor  # [N // 16, K // 32, 8, 32] uint8
    scale: torch.Tensor  # [N // 16, K // 32, 16] float16
    offset: torch.Tensor  # [N // 16, K // 32, 16] float16

    STRIPE = 16

    @staticmethod
    def from_nibbles(w: Nibbles) -> NibbleStripes | None:
        """`w` in stripes, or None where its rows are not a whole number of stripes."""
        n, half = w.q.shape
        if n % NibbleStripes.STRIPE:
            return None
        s, nb = n // NibbleStripes.STRIPE, half * 2 // BLOCK
        # [stripe, block, quad, row, 4 columns]: each row's quad as two bytes, columns (0, 2) and (1, 3)
        quads = _nibbles(w.q).view(s, NibbleStripes.STRIPE, nb, BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
        regroup = lambda t: t.view(s, NibbleStripes.STRIPE, nb).transpose(1, 2).contiguous()
        return NibbleStripes(_pack_nibbles(quads).reshape(s, nb, BLOCK // 4, 2 * NibbleStripes.STRIPE).contiguous(),
                             regroup(w.scale), regroup(w.offset))

    def to_nibbles(self) -> Nibbles:
        s, nb = self.q.shape[:2]
        n = s * NibbleStripes.STRIPE
        quads = _unpack_nibbles(self.q.view(s, nb, BLOCK // 4, NibbleStripes.STRIPE, 2))
        nibbles = quads.permute(0, 3, 1, 2, 4).reshape(n, nb, BLOCK)
        ungroup = lambda t: t.transpose(1, 2).reshape(n, nb).contiguous()
        return Nibbles(_pack_nibbles(nibbles).reshape(n, -1).contiguous(), ungroup(self.scale), ungroup(self.offset))

    def dequantize(self) -> torch.Tensor:
        return self.to_nibbles().dequantize()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset))


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """m bytes [..., m] as 2m values (uint8, 0..15): each byte's low halves, then its high halves."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """`_unpack_nibbles`' inverse: values [..., 2m] (0..15) as m bytes, value j in byte j's low half
    and value m + j in its high half."""
    half = values.shape[-1] // 2
    return values[..., :half] | (values[..., half:] << 4)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Nibbles' bytes [N, K // 2] as their values [N, K // 32, 32], in column order."""
    n, half = q.shape
    return _unpack_nibbles(q.view(n, half * 2 // BLOCK, BLOCK // 2))


@dataclass
class Bytes:
    """Blocks of int8 values with a float16 scale and no offset (GGUF's Q8_0) as the file keeps them:
    1.0625 bytes a weight against BlockWeights' 1.25. `w = q * scale`, the same values as the
    BlockWeights they were packed from (`pack`)."""

    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K // 32] float16

    @staticmethod
    def pack(w: BlockWeights) -> Bytes | None:
        """`w` with float16 scales, or None where it does not fit: an offset that is not 0, or a
        scale float16 cannot hold."""
        scale16 = w.scale.half()
        if not (bool((w.offset == 0).all()) and torch.equal(scale16.float(), w.scale)):
            return None
        return Bytes(w.q, scale16.contiguous())

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.view(n, k // BLOCK, BLOCK).float() * self.scale.float()[..., None]).view(n, k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale))


def fits_four_bits(w: BlockWeights) -> bool:
    """Whether `w`'s values span 4 bits (Q4_0 or Q4_1): what `Nibbles.pack` needs first."""
    return bool(w.q.min() >= -8) and bool(w.q.max() <= 15)


def block_gemm(x: torch.Tensor, w: BlockWeights, tile_rows: int = 0) -> torch.Tensor:
    """x [M, K] float32 @ w.T -> [M, N] float32. The kernel streams the weight once per tile of
    `tile_rows` rows of x (1-8), by default (0) as many as stay in L1 cache (8 at K = 576, 4 at
    K = 1536)."""
    return torch.ops.tandem.block_gemm(x, w.q, w.scale, w.offset, tile_rows)


def block_gemm_q4(x: torch.Tensor, w: Nibbles, tile_rows: int = 0, avx512: int = -1) -> torch.Tensor:
    """x [M, K] float32 @ w.T -> [M, N] float32, exactly as block_gemm over the blocks `w` was packed
    from. `avx512`: -1 where the CPU has AVX-512, 0 the AVX2 functions, 1 the AVX-512 ones."""
    return torch.ops.tandem.block_gemm_q4(x, w.q, w.scale, w.offset, tile_rows, avx512)


def block_gemm_q4_stripes(x: torch.Tensor, w: NibbleStripes, exact: bool, avx512: int = -1) -> torch.Tensor:
    """x [M, K] float32 @ w.T -> [M, N] float32 over the 4-bit values as they are: float32's product
    where `exact`, else with x rounded to bfloat16 (AVX512-BF16 only). `avx512`: -1 the AVX-512 forms
    where they run, else AVX2's; 0 AVX2's (float32 only); 1 the AVX-512 ones."""
    return torch.ops.tandem.block_gemm_q4_stripes(x, w.q, w.scale, w.offset, exact, avx512)


def block_gemm_q8(x: torch.Tensor, w: Bytes, tile_rows: int = 0, avx512: int = -1) -> torch.Tensor:
    """x [M, K] float32 @ w.T -> [M, N] float32, exactly as block_gemm over the blocks `w` was packed
    from (AVX2: bit for bit). `avx512` as for block_gemm_q4."""
    return torch.ops.tandem.block_gemm_q8(x, w.q, w.scale, tile_rows, avx512)


def block_gemm_bf16(x: torch.Tensor, w: BlockWeights | Nibbles | NibbleStripes | Bytes) -> torch.Tensor:
    """x [M, K] float32 @ w.T -> [M, N] float32 with x rounded to bfloat16, for blocks in any of the
    four forms: the weight too rounded as its dequantized float32 values would be, but for stripes,
    whose 4-bit values are multiplied as they are (`block_gemm_q4_stripes`)."""
    if isinstance(w, NibbleStripes):
        return block_gemm_q4_stripes(x, w, exact=False)
    if isinstance(w, Nibbles):
        return torch.ops.tandem.block_gemm_q4_bf16(x, w.q, w.scale, w.offset)
    if isinstance(w, Bytes):
        return torch.ops.tandem.block_gemm_q8_bf16(x, w.q, w.scale)
    return torch.ops.tandem.block_gemm_bf16(x, w.q, w.scale, w.offset)


def bfloat16_blocks_unavailable() -> str | None:
    """None when `block_gemm_bf16` can run here, else why not."""
    if (why := cpu_ops_unavailable()) is not None:
        return f"tandem's CPU kernels are unavailable: {why}"
    return None if "avx512_bf16" in runnable_flags() else "this CPU lacks AVX512-BF16, or faults on it"
