"""`tandem bench step`: one decode step of the real model (forward pass and logits), per batch size,
in two forms alternated within one run so both see the same machine:

- `--compare layer-ops` (default): the layers' small steps as tandem's native calls
  (`tandem.kernels.layer_ops`) against the torch ops they replace;
- `--compare kv-pages`: the KV cache on transparent huge pages against 4 KiB pages (two caches;
  where /sys/kernel/mm/transparent_hugepage/enabled is `always`, both get huge pages);
- `--compare decode-attention`: decode attention read in place from the pages
  (`paged_decode_attention`) against gathering them for torch's SDPA;
- `--compare fused-layer`: the decoder layers as native calls (`kernels.fused_decode`: all of them in
  one) against the same kernels called op by op from Python;
- `--compare fused-stack`: all layers in one native call against one call per layer;
- `--compare stripes`: the 4-bit blocks regrouped in stripes (`NibbleStripes`) against the same model
  loaded with them kept as `Nibbles`;
- `--compare weight-prefetch`: the block kernels asking for weight rows ahead of use (4 rows, the
  default) against the hardware's prefetcher alone;
- `--compare prompt-attention`: a prefill pass instead (`rows` prompts of `--context` tokens), its
  prompt attention in the bfloat16 of a float32 model's prompt products (`--prefill-dtype`) against
  float32;
- `--compare weights`: the GGUF file's weights as a decode step reads them: float32 with the
  Q4 blocks in 4 bits (`--gguf-blocks 4bit`, the default), the same widened to int8, and bfloat16
  weights where the CPU multiplies bfloat16 natively (`--dtype` is ignored).

The model computes in its own dtype (`--dtype`; auto as a server picks it), the KV cache too.

The batch is `rows` sequences of `--context` tokens each on scattered pages of a KV cache as large
as a serving engine's, so the weights and the KV stream from memory as they do in a server. Prints
one JSON line per batch size: median milliseconds per step of each form and the first's over each
other's.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.kernels import fused_decode, layer_ops
from tandem.kernels.attention import AttentionBatch
from tandem.kernels.block_linear import NibbleStripes
from tandem.kernels.cpu_ops import cpu_ops_unavailable
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.kernels.linear import use_stripes
from tandem.kernels.torch_attention import TorchAttention
from tandem.server.config import EngineConfig

if TYPE_CHECKING:
    from tandem.server.model.load import LoadedModel

PAGE_SIZE = 16


def decode_batch(rows: int, context: int, num_pages: int, rng: random.Random) -> AttentionBatch:
    """`rows` sequences of `context` cached tokens, each decoding one more, on random pages."""
    per_seq = -(-(context + 1) // PAGE_SIZE)
    pages = rng.sample(range(num_pages), rows * per_seq)
    tables = [pages[i * per_seq : (i + 1) * per_seq] for i in range(rows)]
    slots = [s for t in tables for s in flat_slots(t, context, context + 1, PAGE_SIZE)]
    return AttentionBatch(q_lens=[1] * rows, kv_lens=[context + 1] * rows, page_tables=tables, num_extends=0,
                          out_slots=torch.tensor(slots))


def prefill_batch(rows: int, length: int, num_pages: int, rng: random.Random) -> AttentionBatch:
    """`rows` prompts of `length` tokens each, nothing cached, on random pages."""
    per_seq = -(-length // PAGE_SIZE)
    pages = rng.sample(range(num_pages), rows * per_seq)
    tables = [pages[i * per_seq : (i + 1) * per_seq] for i in range(rows)]
    slots = [s for t in tables for s in flat_slots(t, 0, length, PAGE_SIZE)]
    return AttentionBatch(q_lens=[length] * rows, kv_lens=[length] * rows, page_tables=tables, num_extends=rows,
                          out_slots=torch.tensor(slots))


# (model, its attention backend, whether the layers' small steps run as tandem's native calls)
Form = tuple[torch.nn.Module, TorchAttention, bool]


@dataclass
class Setup:
    """What `run` times, built once for every batch size."""

    loaded: LoadedModel  # the model of the first form (and of the others unless they load their own)
    forms: dict[str, Form]  # alternated within each step; the first is reported over each other
    stack: fused_decode.FusedDecodeStack | None  # the model's fused stack as loaded, set back after each batch size
    prefetch_rows: int  # the library's own weight prefetch distance (`--compare weight-prefetch`; else 0)


def attention(args, loaded: LoadedModel, huge_pages: bool, cache: PagedKVCache | None = None,
              dtype: torch.dtype | None = None, prompt_dtype: torch.dtype | None = None) -> TorchAttention:
    """An attention backend over `cache`, or over a new one as large as `--kv-tokens` (in `dtype`, the
    model's compute dtype by default) filled with noise."""
    c = loaded.config
    if cache is None:
        cache = PagedKVCache(c.num_layers, args.kv_tokens // PAGE_SIZE, PAGE_SIZE, c.kv_heads, c.kv_dim,
                             dtype or loaded.precision.compute, torch.device("cpu"), huge_pages=huge_pages,
                             value_dim=c.kv_value_dim)
        cache.buffer.normal_()
    return TorchAttention(cache, c.num_heads, c.head_dim, c.softmax_scale, c.layer_windows, prompt_dtype=prompt_dtype)


def compared_forms(args, loaded: LoadedModel, native: bool) -> dict[str, Form]:
    """The two (or three) forms `--compare` names, by the names their figures are printed under."""
    from tandem.server.model.load import load_model

    model = loaded.module
    if args.compare == "kv-pages":
        huge, small = attention(args, loaded, True), attention(args, loaded, False)
        if not huge.kv_cache.huge_pages:
            raise SystemExit("Linux refused the huge-page advice here (a kernel without transparent huge pages?)")
        return {"huge_pages": (model, huge, native), "4k_pages": (model, small, native)}
    if args.compare == "decode-attention":
        in_place = attention(args, loaded, True)
        gathered = attention(args, loaded, True, in_place.kv_cache)  # the same pages, read the other way
        gathered.in_place_decode = False
        return {"in_place": (model, in_place, True), "gathered": (model, gathered, True)}
    if args.compare == "weights":
        from tandem.kernels.isa import runnable_flags
        from tandem.server.model.precision import _native_bf16_flags

        int8 = EngineConfig(model=args.model, dtype="float32", device="cpu", gguf_blocks="int8")
        forms = {"4bit": (model, attention(args, loaded, True), True),
                 "int8": (load_model(int8).module, attention(args, loaded, True), True)}
        if _native_bf16_flags(runnable_flags()):
            forms["bfloat16"] = (load_model(EngineConfig(model=args.model, dtype="bfloat16", device="cpu")).module,
                                 attention(args, loaded, True, dtype=torch.bfloat16), True)
        return forms
    if args.compare == "prompt-attention":
        if model.prefill_dtype is None:
            raise SystemExit(f"--compare prompt-attention needs a float32 model with bfloat16 prompt products "
                             f"(--prefill-dtype); this one computes in {loaded.precision.compute} throughout")
        bf16 = attention(args, loaded, True, prompt_dtype=model.prefill_dtype)
        return {"bfloat16": (model, bf16, True), "float32": (model, attention(args, loaded, True, bf16.kv_cache), True)}
    if args.compare == "fused-layer":
        attn = attention(args, loaded, True)
        return {"fused": (model, attn, True), "op_by_op": (model, attn, True)}
    if args.compare == "fused-stack":
        if model.fused_stack is None:
            raise SystemExit("--compare fused-stack needs a model whose layers all take the fused call "
                             "(float32, 4-bit blocks, plain Llama layers, one rank)")
        attn = attention(args, loaded, True)
        return {"stack": (model, attn, True), "layers": (model, attn, True)}
    if args.compare == "stripes":
        if not any(isinstance(layer.qkv.blocks, NibbleStripes) for layer in model.layers):
            raise SystemExit("--compare stripes needs a float32 model whose 4-bit blocks are held in stripes "
                             "(a GGUF file's Q4 blocks, with tandem's CPU kernels)")
        use_stripes(False)
        try:
            nibbles = load_model(EngineConfig(model=args.model, dtype=args.dtype, device="cpu")).module
        finally:
            use_stripes(True)
        attn = attention(args, loaded, True)
        return {"stripes": (model, attn, True), "nibbles": (nibbles, attn, True)}
    if args.compare == "weight-prefetch":
        attn = attention(args, loaded, True)
        return {"prefetch": (model, attn, True), "none": (model, attn, True)}
    attn = attention(args, loaded, True)
    return {"native": (model, attn, True), "torch": (model, attn, False)}


def set_up(args) -> Setup:
    """The model loaded as `--dtype` asks (float32 for `--compare weights`) and the forms to compare."""
    from tandem.server.model.load import load_model

    native = cpu_ops_unavailable() is None
    if args.compare != "kv-pages" and not native:
        raise SystemExit(f"bench step compares tandem's native kernels, which cannot run here: {cpu_ops_unavailable()}")
    loaded = load_model(EngineConfig(model=args.model, dtype="float32" if args.compare == "weights" else args.dtype,
                                     device="cpu"))
    if loaded.precision.compute not in (torch.float32, torch.bfloat16):
        raise SystemExit(f"tandem's native kernels take float32 or bfloat16; this model computes in {loaded.precision.compute}")
    forms = compared_forms(args, loaded, native)
    prefetch_rows = torch.ops.tandem.weight_prefetch() if args.compare == "weight-prefetch" else 0
    return Setup(loaded, forms, loaded.module.fused_stack, prefetch_rows)


def time_forms(args, setup: Setup, rows: int, rng: random.Random) -> dict[str, float]:
    """Median milliseconds of each form's step on one batch of `rows` (`--steps` timed after two
    warm-up rounds, the forms alternated step by step); the library's switches set back after."""
    model, c = setup.loaded.module, setup.loaded.config
    num_pages = args.kv_tokens // PAGE_SIZE
    if args.compare == "prompt-attention":
        batch = prefill_batch(rows, args.context, num_pages, rng)
        ids = torch.tensor([rng.randrange(c.vocab_size) for _ in range(rows * args.context)])
        positions = torch.arange(args.context).repeat(rows)
        sampled = torch.arange(1, rows + 1) * args.context - 1  # each prompt's last token, as a server samples
    else:
        batch = decode_batch(rows, args.context, num_pages, rng)
        ids = torch.tensor([rng.randrange(c.vocab_size) for _ in range(rows)])
        positions = torch.full((rows,), args.context)
        sampled = torch.arange(rows)
    times: dict[str, list[float]] = {name: [] for name in setup.forms}
    for i in range(args.steps + 2):
        for name, (form, attn, native) in setup.forms.items():
            layer_ops._kernels_ready[:] = [native]
            fused_decode.use_fused_decode(name != "op_by_op")
            if args.compare == "fused-stack":
                model.fused_stack = setup.stack if name == "stack" else None
            if args.compare == "weight-prefetch":
                torch.ops.tandem.set_weight_prefetch(0 if name == "none" else setup.prefetch_rows)
            start = time.perf_counter()
            attn.prepare(batch)
            form.logits(form(ids, positions, attn)[sampled])
            if i >= 2:  # the first two are warm-up
                times[name].append(time.perf_counter() - start)
    layer_ops._kernels_ready[:] = [True]
    fused_decode.use_fused_decode(True)
    model.fused_stack = setup.stack
    if args.compare == "weight-prefetch":
        torch.ops.tandem.set_weight_prefetch(setup.prefetch_rows)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def report(args, setup: Setup, rows: int, ms: dict[str, float]) -> None:
    """One JSON line: each form's milliseconds and the first's over each other's."""
    first, *others = ms
    print(json.dumps({
        "bench": "step", "compare": args.compare, "model": args.model, "rows": rows, "context": args.context,
        "steps": args.steps, "dtype": str(setup.loaded.precision.compute).removeprefix("torch."), "threads": torch.get_num_threads(), **{f"{name}_ms": round(v, 2) for name, v in ms.items()},
        **{f"{first}_vs_{other}": round(ms[first] / ms[other], 3) for other in others},
    }), flush=True)


def run(args) -> int:
    setup = set_up(args)
    rng = random.Random(0)
    for rows in args.rows:
        report(args, setup, rows, time_forms(args, setup, rows, rng))
    return 0
