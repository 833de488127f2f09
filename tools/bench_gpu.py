"""`tandem bench gpu`: decode steps and prefill of real-size model shapes on one GPU, beside what
that GPU allows, measured in the same run.

Each shape (`random_weights.SHAPES`: a Llama-3-8B, a Llama-3.2-1B) gets random bfloat16 weights
drawn on the device with a fixed seed and loaded through the serving model code
(`LlamaForCausalLM`), with a KV cache of scattered pages as in a server. Then:

- **decode**: one step of `rows` sequences of `--context` cached tokens each, eager (FlashInfer's
  decode plan and every kernel launched from Python) and replaying CUDA graphs (`DecodeGraphs`,
  captured for exactly these batch sizes). A step is what the engine's runner does: plan, forward
  pass, logits, greedy tokens to the host. The median of `--steps` steps. The graphs are captured
  twice, with the layers' small steps as Triton kernels (`kernels.triton_ops`, what the server
  runs) and as torch's ops (the baseline they replaced), and both are timed in the same run.
- **projections**: each distinct projection of the shape alone at `--projection-rows` rows, on
  cuBLAS as the server runs it, as bytes of weight per second beside the copy bandwidth: which
  projection a step loses time in (the profile names kernels, not layers).
- **profile** (`--profile`): one graphed batch-1 step of each form under torch's profiler: how
  many kernels ran, how long the GPU was busy with them, and which took longest.
- **floor**: the fastest a decode step can be: the bytes it must read (every projection's weights
  once, `LlamaForCausalLM.streamed_bytes`, plus each sequence's K and V) over the memory's rate as
  a device-to-device copy measured it here (bytes read plus bytes written per second: what the
  memory moves at full speed).
- **prefill**: one forward pass over `--prefill-tokens` prompt tokens in prompts of
  `--prefill-len`, in tokens per second and as model FLOP/s against the bfloat16 matrix-product
  peak measured here (an 8192-cubed product).

On a CPU (`--device cpu`) the same code runs eagerly with the torch attention backend (no graphs,
no floor against a GPU): a smoke test of the benchmark itself.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F

from tandem.kernels import layer_ops
from tandem.kernels.attention_backends import create_backend
from tandem.kernels.kv_cache import PagedKVCache, flat_slots
from tandem.server.loop.cuda_graphs import DecodeGraphs
from tandem.server.loop.runner import ForwardInputs, forward_pass
from tandem.server.model.llama import LlamaForCausalLM
from tandem.server.model.precision import Precision
from tandem.server.model.random_weights import SHAPES, random_weights, shape_config

PAGE_SIZE = 16
GOAL = 1.3  # batch-1 decode of the 8B shape with graphs, over its floor


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, steps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 31) -> float:
    """Bytes read plus written per second by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), 10, 3, device)
    del src, dst
    return 2 * nbytes / seconds


def matmul_peak(device: torch.device, n: int = 8192) -> float:
    """FLOP/s of an n-cubed bfloat16 matrix product."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    seconds = _median_seconds(lambda: a @ b, 10, 3, device)
    return 2 * n**3 / seconds


def decode_inputs(rows: int, context: int, pages: list[int]) -> ForwardInputs:
    """`rows` sequences of `context` cached tokens, each decoding one more, on `pages` (shuffled)."""
    per_seq = -(-(context + 1) // PAGE_SIZE)
    tables = [pages[i * per_seq : (i + 1) * per_seq] for i in range(rows)]
    rng = random.Random(rows)
    return ForwardInputs(
        input_ids=[rng.randrange(1000) for _ in range(rows)], positions=[context] * rows,
        slots=[s for t in tables for s in flat_slots(t, context, context + 1, PAGE_SIZE)], q_lens=[1] * rows,
        kv_lens=[context + 1] * rows, page_tables=tables, num_extends=0)


def prefill_inputs(num_prompts: int, length: int, pages: list[int]) -> ForwardInputs:
    per_seq = -(-length // PAGE_SIZE)
    tables = [pages[i * per_seq : (i + 1) * per_seq] for i in range(num_prompts)]
    rng = random.Random(length)
    return ForwardInputs(
        input_ids=[rng.randrange(1000) for _ in range(num_prompts * length)],
        positions=[p for _ in range(num_prompts) for p in range(length)],
        slots=[s for t in tables for s in flat_slots(t, 0, length, PAGE_SIZE)], q_lens=[length] * num_prompts,
        kv_lens=[length] * num_prompts, page_tables=tables, num_extends=num_prompts)


def prefill_flops(c, num_prompts: int, length: int) -> float:
    """Model FLOPs of a prefill pass: 2 per weight per token through the projections, and causal
    attention's two products (QK^T and PV) over half of each prompt's square."""
    per_token = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    attention = 2 * 2 * c.num_heads * c.head_dim * (length * (length + 1) // 2)
    return num_prompts * c.num_layers * (2 * per_token * length + attention)


def _gpu_seconds(fn, reps: int = 50) -> float:
    """Seconds per call of `fn` over `reps` calls back to back, from CUDA events (a kernel of a few
    microseconds is shorter than a host synchronization)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


@torch.inference_mode()
def bench_projections(name: str, model: LlamaForCausalLM, rows_list: list[int], copy_bw: float | None,
                      results: list[dict]) -> None:
    """Each distinct projection of the shape (layer 0's and the LM head) alone at `rows_list` rows,
    as the server runs it (cuBLAS): the weight's bytes over the time, beside the copy bandwidth.
    Which projection a decode step loses time in, which the profile's kernel names do not say."""
    layer = model.layers[0]
    for label, proj in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up), ("down", layer.down),
                        ("lm_head", model.lm_head)):
        w = proj.weight
        for rows in rows_list:
            x = torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device)
            seconds = _gpu_seconds(lambda: F.linear(x, w))
            tb_s = w.numel() * w.element_size() / seconds / 1e12
            results.append(dict(shape=name, kind="projection", name=label, weight=list(w.shape), rows=rows,
                                us=seconds * 1e6, tb_s=tb_s, of_copy=tb_s * 1e12 / copy_bw if copy_bw else None))
            print(json.dumps(results[-1]), flush=True)


def bench_shape(name: str, args, device: torch.device, copy_bw: float | None, peak: float | None,
                results: list[dict]) -> None:
    """Measure shape `name`, appending each figure to `results` (and printing it) as it is taken."""
    overrides = {"num_layers": args.layers} if args.layers else {}
    c = shape_config(name, **overrides)
    dtype = torch.bfloat16
    model = LlamaForCausalLM(c, random_weights(c, dtype, device), Precision.uniform(dtype), device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows_max = max(args.rows)
    per_seq = -(-(args.context + 1) // PAGE_SIZE)
    prompts = max(1, args.prefill_tokens // args.prefill_len)
    num_pages = max(rows_max * per_seq, prompts * -(-args.prefill_len // PAGE_SIZE)) + 1  # + the graphs' scratch page
    cache = PagedKVCache(c.num_layers, num_pages, PAGE_SIZE, c.kv_heads, c.kv_dim, dtype, device, value_dim=c.kv_value_dim)
    attn = create_backend("auto", cache, c.num_heads, c.head_dim, c.softmax_scale, c.layer_windows)
    graphs, torch_ops_graphs, capture_s = None, None, None
    if device.type == "cuda" and not args.no_graphs:
        graphs = DecodeGraphs(model, cache, sorted(set(args.rows)), scratch_page=num_pages - 1)
        capture_s = graphs.capture()
        layer_ops.use_fused_cuda_ops(False)
        try:
            torch_ops_graphs = DecodeGraphs(model, cache, sorted(set(args.rows)), scratch_page=num_pages - 1)
            torch_ops_graphs.capture()
        finally:
            layer_ops.use_fused_cuda_ops(True)
        if args.projections:
            bench_projections(name, model, args.projection_rows, copy_bw, results)
    wbytes = model.streamed_bytes(1)
    kv_token = PagedKVCache.bytes_per_token(c.num_layers, c.kv_heads, c.kv_dim, dtype, cache.parts)
    pages = random.Random(0).sample(range(num_pages - 1), num_pages - 1)

    @torch.inference_mode()
    def step(inputs: ForwardInputs, replay: DecodeGraphs | None) -> list[int]:
        if replay is not None:
            hidden = replay.run(inputs.input_ids, inputs.positions, inputs.slots, inputs.kv_lens, inputs.page_tables)
        else:
            hidden = forward_pass(model, attn, inputs, device)
        return model.logits(hidden).argmax(-1).tolist()

    for rows in args.rows:
        inputs = decode_inputs(rows, args.context, pages)
        eager = _median_seconds(lambda: step(inputs, None), args.steps, 3, device)
        graphed = _median_seconds(lambda: step(inputs, graphs), args.steps, 3, device) if graphs else None
        torch_ops = _median_seconds(lambda: step(inputs, torch_ops_graphs), args.steps, 3, device) if graphs else None
        # the host's part of a graphed step (inputs copied in, attention planned), during which the GPU waits
        host = _median_seconds(lambda: graphs.load(inputs.input_ids, inputs.positions, inputs.slots, inputs.kv_lens,
                                                   inputs.page_tables), args.steps, 3, device) if graphs else None
        read = wbytes + rows * (args.context + 1) * kv_token
        floor = read / copy_bw if copy_bw else None  # the memory's rate, as a copy drives it (reads and writes)
        results.append(dict(
            shape=name, kind="decode", rows=rows, context=args.context, eager_ms=eager * 1e3,
            graph_ms=graphed * 1e3 if graphed else None, torch_ops_graph_ms=torch_ops * 1e3 if torch_ops else None,
            torch_ops_over_fused=torch_ops / graphed if graphed else None, host_ms=host * 1e3 if host else None,
            floor_ms=floor * 1e3 if floor else None,
            graph_over_floor=graphed / floor if graphed and floor else None,
            eager_over_graph=eager / graphed if graphed else None, bytes_read=read,
            capture_s=capture_s))
        print(json.dumps(results[-1]), flush=True)
        if args.profile and graphs and rows == min(args.rows):
            for form, replay in (("Triton", graphs), ("torch ops", torch_ops_graphs)):
                try:
                    profiled = profile_step(lambda: step(inputs, replay), device)
                except Exception as e:  # the profiler is a diagnosis: the figures above stand without it
                    print(f"profile of {name} with {form} failed: {type(e).__name__}: {e}", flush=True)
                    continue
                results.append(dict(shape=name, kind="profile", rows=rows, form=form, **profiled))
                print(json.dumps(results[-1]), flush=True)
    with torch.inference_mode():
        inputs = prefill_inputs(prompts, args.prefill_len, pages)
        seconds = _median_seconds(lambda: forward_pass(model, attn, inputs, device), max(3, args.steps // 5), 1, device)
    tokens = prompts * args.prefill_len
    flops = prefill_flops(c, prompts, args.prefill_len)
    results.append(dict(shape=name, kind="prefill", tokens=tokens, prompt_len=args.prefill_len, ms=seconds * 1e3,
                        tokens_per_s=tokens / seconds, tflops=flops / seconds / 1e12,
                        of_peak=flops / seconds / peak if peak else None))
    print(json.dumps(results[-1]), flush=True)
    del model, cache, attn, graphs, torch_ops_graphs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profile_step(fn, device: torch.device, top: int = 8) -> dict:
    """One call of `fn` (after two unprofiled ones) under torch's profiler: the GPU kernels it ran,
    their summed time against the call's wall time, and the `top` kernels by summed time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - start
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            kernels.setdefault(event.name[:90], []).append(event.device_time_total)
    busy_us = sum(sum(times) for times in kernels.values())
    ranked = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:top]
    return dict(wall_ms=wall * 1e3, kernels=sum(len(t) for t in kernels.values()), kernel_ms=busy_us / 1e3,
                top=[dict(name=k, calls=len(t), ms=sum(t) / 1e3) for k, t in ranked])


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(header: dict, results: list[dict]) -> str:
    lines = [f"device: {header['device']}; torch {header['torch']}; copy bandwidth "
             f"{_fmt(header['copy_tb_s'], '.2f')} TB/s (read + written); bf16 matmul peak "
             f"{_fmt(header['matmul_tflops'], '.0f')} TFLOP/s", "",
             "| shape | batch | context | eager ms | graphs ms | HBM floor ms | graphs / floor | eager / graphs "
             "| graphs, torch ops ms | torch ops / Triton | host's part ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["kind"] == "decode":
            lines.append(f"| {r['shape']} | {r['rows']} | {r['context']} | {r['eager_ms']:.2f} | {_fmt(r['graph_ms'], '.2f')} | "
                         f"{_fmt(r['floor_ms'], '.2f')} | {_fmt(r['graph_over_floor'], '.2f')} | "
                         f"{_fmt(r['eager_over_graph'], '.2f')} | {_fmt(r['torch_ops_graph_ms'], '.2f')} | "
                         f"{_fmt(r['torch_ops_over_fused'], '.2f')} | {_fmt(r['host_ms'], '.2f')} |")
    projections = [r for r in results if r["kind"] == "projection"]
    if projections:
        lines += ["", "| shape | projection | weight | rows | us | TB/s | of the copy bandwidth |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['name']} | {'x'.join(map(str, r['weight']))} | {r['rows']} | {r['us']:.1f} | "
                  f"{r['tb_s']:.2f} | {_fmt(r['of_copy'], '.0%')} |" for r in projections]
    for r in results:
        if r["kind"] == "profile":
            lines += ["", f"profile, {r['shape']} batch {r['rows']}, graphs with {r['form']}: {r['kernels']} kernels, "
                          f"{r['kernel_ms']:.2f} ms of kernel time in a {r['wall_ms']:.2f} ms step"]
            lines += [f"  {k['ms']:7.3f} ms {k['calls']:5d}x {k['name']}" for k in r["top"]]
    lines += ["", "| shape | prefill tokens | prompt length | ms | tokens/s | TFLOP/s | of the matmul peak |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        if r["kind"] == "prefill":
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['prompt_len']} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | "
                         f"{r['tflops']:.1f} | {_fmt(r['of_peak'], '.0%')} |")
    goal = [r for r in results if r["kind"] == "decode" and r["shape"] == "llama3-8b" and r["rows"] == 1]
    if goal and goal[0]["graph_over_floor"]:
        ratio = goal[0]["graph_over_floor"]
        lines += ["", f"goal: batch-1 decode of llama3-8b with graphs within {GOAL}x of its floor: {ratio:.2f}x "
                      f"({'met' if ratio <= GOAL else 'not met'})"]
    return "\n".join(lines)


def run(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench gpu: no CUDA device here (--device cpu runs the benchmark's own code eagerly)")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown shape {unknown[0]!r}; known: {', '.join(SHAPES)}")
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    header = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__,
                  copy_tb_s=None, matmul_tflops=None)
    copy_bw = copy_bandwidth(device) if cuda else None
    peak = matmul_peak(device) if cuda else None
    if cuda:
        header.update(copy_tb_s=copy_bw / 1e12, matmul_tflops=peak / 1e12)
    results: list[dict] = []
    interrupted = False
    try:
        for shape in args.shapes:
            bench_shape(shape, args, device, copy_bw, peak, results)
    except KeyboardInterrupt:  # stopped (a time limit): report what was measured
        interrupted = True
    print(report(header, results) + ("\n\n(interrupted: the figures above are all that was measured)" if interrupted else ""))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(header=header, args={k: v for k, v in vars(args).items() if k != "func"}, results=results,
                           interrupted=interrupted), f, indent=1)
    return 130 if interrupted else 0
