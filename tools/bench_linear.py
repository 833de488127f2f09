"""`tandem bench linear`: the model's projections, one at a time, in every form a weight can be
held in, at the batch sizes a step runs: `F.linear` on the [out, in] weight, `x @ W` on the
transposed weight, `tandem.kernels.linear.Linear` (oneDNN-packed on CPU where it can take
the dtype), in float32 and bfloat16, and in float32 also tandem's block kernels over GGUF-style
blocks, in 4 bits (`block_gemm_q4`, what decode steps of up to 8 rows use for GGUF's Q4 tensors whose rows do not make whole stripes of 16),
in 8 bits with float16 scales (`block_gemm_q8`, what they use for Q8_0 tensors, the LM head of the
built-in model) and as int8 (`block_gemm`), and torch's weight-only int8 kernel (`_weight_int8pack_mm`, per-channel scales). Prints milliseconds per
product and each form's time over `F.linear`'s, as one JSON line per shape and batch size. Small
projections stay in cache between repeats here; a decode step streams them all from memory.

`--whole-model` times what a step does instead: one pass over all of the model's projections, each
layer's own weights (so they stream from memory), per batch size, in the forms a float32 model on
a CPU can use: the 4-bit blocks (`block_gemm_q4`; with AVX-512 also its AVX2 functions), the
8-bit blocks (`block_gemm_q8`, Q8_0-like values), the int8
blocks in float32 (`block_gemm`), all three block forms in bfloat16 where the CPU has AVX512-BF16
(`block_gemm_bf16`), the 4-bit blocks in stripes (`block_gemm_q4_stripes` in float32, with AVX-512 also
its AVX2 form, with AVX512-BF16 also its bfloat16 one), and oneDNN over float32 and bfloat16 weights; also the float32 blocks with tiles of 8 rows of x
whatever the projection's width (`8-row tiles`), against the default, which fits each tile of x
in L1. The forms are timed in turn (median of 15 rounds); each form's time over the float32
blocks'.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.nn.functional as F

from tandem.kernels.block_linear import (BlockWeights, Bytes, Nibbles, NibbleStripes, bfloat16_blocks_unavailable,
                                         block_gemm, block_gemm_bf16, block_gemm_q4, block_gemm_q4_stripes,
                                         block_gemm_q8)
from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.kernels.linear import Linear
from tandem.kernels.weight_forms import onednn_supports


def projection_shapes(model: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each fused projection of one layer, and of the lm_head."""
    from tandem.server.model.loader import load_weights, resolve_model

    config, _ = load_weights(resolve_model(model))
    h, i = config.hidden_size, config.intermediate_size
    return {"qkv": (config.q_size + 2 * config.kv_size, h), "o": (h, config.q_size), "gate_up": (2 * i, h),
            "down": (h, i), "lm_head": (config.vocab_size, h)}


def seconds_per_call(fn, min_seconds: float = 0.2) -> float:
    fn()
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or calls < 5:
        fn()
        calls += 1
    return elapsed / calls


def alternated_medians(calls: dict, rounds: int = 15) -> dict[str, float]:
    """Seconds per call of each of `calls`, timed in turn for `rounds` rounds (after one warm-up
    round), median of each: forms compared on a busy machine all see the same minutes."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(rounds + 1):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def random_blocks(n_out: int, n_in: int) -> BlockWeights:
    """Q4_1-like blocks: values 0..15, float16 scales and offsets (so that they pack into 4 bits)."""
    return BlockWeights(torch.randint(0, 16, (n_out, n_in), dtype=torch.int8),
                        (torch.rand(n_out, n_in // 32) * 0.01).half().float(),
                        (torch.rand(n_out, n_in // 32) * -0.05).half().float())


def random_q8_blocks(n_out: int, n_in: int) -> Bytes:
    """Q8_0-like blocks: values -128..127, float16 scales, no offset."""
    return Bytes(torch.randint(-128, 128, (n_out, n_in), dtype=torch.int8), (torch.rand(n_out, n_in // 32) * 0.01).half())


def run_whole_model(args) -> int:
    from tandem.server.model.loader import load_weights, resolve_model

    per_layer = projection_shapes(args.model)
    num_layers = load_weights(resolve_model(args.model))[0].num_layers
    shapes = [per_layer[p] for _ in range(num_layers) for p in ("qkv", "o", "gate_up", "down")] + [per_layer["lm_head"]]
    if (why := cpu_ops_unavailable()) is not None:
        raise SystemExit(f"--whole-model compares tandem's block kernels, which cannot run here: {why}")
    blocks = [random_blocks(*shape) for shape in shapes]
    nibbles = [Nibbles.pack(b) for b in blocks]
    eight_bit = [random_q8_blocks(*shape) for shape in shapes]
    avx512 = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
    forms = {"int8 blocks": lambda x: [block_gemm(x[b.q.shape[1]], b) for b in blocks],
             "4-bit blocks": lambda x: [block_gemm_q4(x[2 * n.q.shape[1]], n) for n in nibbles],
             "8-bit blocks": lambda x: [block_gemm_q8(x[b.q.shape[1]], b) for b in eight_bit]}
    if avx512:
        forms["4-bit blocks, AVX2"] = lambda x: [block_gemm_q4(x[2 * n.q.shape[1]], n, avx512=0) for n in nibbles]
    forms.update({
             "int8 blocks, 8-row tiles": lambda x: [block_gemm(x[b.q.shape[1]], b, tile_rows=8) for b in blocks]})
    if bfloat16_blocks_unavailable() is None:
        forms["int8 blocks, bfloat16"] = lambda x: [block_gemm_bf16(x[b.q.shape[1]], b) for b in blocks]
        forms["4-bit blocks, bfloat16"] = lambda x: [block_gemm_bf16(x[2 * n.q.shape[1]], n) for n in nibbles]
        forms["8-bit blocks, bfloat16"] = lambda x: [block_gemm_bf16(x[b.q.shape[1]], b) for b in eight_bit]
    stripes = [NibbleStripes.from_nibbles(n) for n in nibbles]
    if all(s is not None for s in stripes):
        forms["4-bit stripes"] = lambda x: [block_gemm_q4_stripes(x[2 * n.q.shape[1]], s, exact=True)
                                            for n, s in zip(nibbles, stripes)]
        if avx512:
            forms["4-bit stripes, AVX2"] = lambda x: [block_gemm_q4_stripes(x[2 * n.q.shape[1]], s, True, avx512=0)
                                                      for n, s in zip(nibbles, stripes)]
        if bfloat16_blocks_unavailable() is None:
            forms["4-bit stripes, bfloat16"] = lambda x: [block_gemm_q4_stripes(x[2 * n.q.shape[1]], s, exact=False)
                                                          for n, s in zip(nibbles, stripes)]
    for dtype in (torch.float32, torch.bfloat16):
        if onednn_supports(dtype):
            linears = [(Linear(b.dequantize().to(dtype)), b.q.shape[1]) for b in blocks]
            forms[f"oneDNN {str(dtype).removeprefix('torch.')}"] = (
                lambda x, linears=linears, dtype=dtype: [lin(x[k].to(dtype)) for lin, k in linears])
    for rows in args.rows:
        x = {k: torch.randn(rows, k) for _, k in shapes}
        times = alternated_medians({name: (lambda form=form: form(x)) for name, form in forms.items()})
        base = times["int8 blocks"]
        print(json.dumps({
            "bench": "linear", "whole_model": args.model, "projections": len(shapes), "rows": rows,
            "threads": torch.get_num_threads(),
            **{k: {"ms": round(t * 1e3, 2), "vs_int8_blocks": round(t / base, 2)} for k, t in times.items()},
        }), flush=True)
    return 0


def run(args) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.whole_model:
        return run_whole_model(args)
    shapes = projection_shapes(args.model)
    for dtype_name in args.dtype or ["float32", "bfloat16"]:
        dtype = getattr(torch, dtype_name)
        for name, (n_out, n_in) in shapes.items():
            weight = (torch.randn(n_out, n_in) * 0.02).to(dtype)
            transposed = weight.t().contiguous()
            linear = Linear(weight)
            for rows in args.rows:
                x = torch.randn(rows, n_in).to(dtype)
                times = {
                    "F.linear": seconds_per_call(lambda: F.linear(x, weight)),
                    "x @ W": seconds_per_call(lambda: x @ transposed),
                    f"Linear ({linear.kind})": seconds_per_call(lambda: linear(x)),
                }
                if dtype == torch.float32:
                    scales = weight.abs().amax(1) / 127
                    q8 = (weight / scales[:, None]).round().to(torch.int8)
                    times["int8 weight-only"] = seconds_per_call(lambda: torch.ops.aten._weight_int8pack_mm(x, q8, scales))
                    if cpu_ops_unavailable() is None:
                        blocks = random_blocks(n_out, n_in)
                        nibbles = Nibbles.pack(blocks)
                        times["4-bit blocks"] = seconds_per_call(lambda: block_gemm_q4(x, nibbles))
                        times["int8 blocks"] = seconds_per_call(lambda: block_gemm(x, blocks))
                        eight_bit = random_q8_blocks(n_out, n_in)
                        times["8-bit blocks"] = seconds_per_call(lambda: block_gemm_q8(x, eight_bit))
                    if bfloat16_blocks_unavailable() is None:
                        times["int8 blocks, bfloat16"] = seconds_per_call(lambda: block_gemm_bf16(x, blocks))
                base = times["F.linear"]
                print(json.dumps({
                    "bench": "linear", "dtype": dtype_name, "projection": name, "shape": [n_out, n_in], "rows": rows,
                    "threads": torch.get_num_threads(),
                    **{k: {"ms": round(t * 1e3, 3), "vs_F.linear": round(t / base, 2)} for k, t in times.items()},
                }), flush=True)
    return 0
