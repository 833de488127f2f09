"""`tandem bench offline`: one fixed-seed workload through tandem and, in the same run, through
HF transformers static batches (the baseline), same weights and dtype. Prints output tokens/s
for each and the ratio, as a table and as one JSON line.

`--compare-tp N` runs the workload at --tp-size 1 and N instead (no HF) and reports, per forward
step, what tensor parallelism costs rank 0: time in all-reduces (the transfer and the wait for the
slowest rank) and time handing each pass to the other ranks.

tandem's figures include where its forward passes' time went: the passes that carried prompt pieces
(count, seconds, prompt tokens) and those of decodes alone by batch size (count, mean ms), so that
`--skip-hf --num-requests 32 --max-running-requests 8` shows what a concurrency-8 serving run spends
on prefill and on decode steps.

`--compare-overlap` runs it with the plain loop (--disable-overlap-schedule) and the overlapped
one instead (no HF), checks that both produced the same tokens, and reports the ratio.

Every request generates exactly its drawn output length (greedy, EOS ignored). HF runs batches
of `--hf-batch-size` in arrival order, left-padded, each until its longest request is done; only
the requested tokens count towards its throughput.
"""

from __future__ import annotations

import json
import random
import time

import torch

from tandem.server.config import EngineConfig

# Token ids drawn for prompts: plain vocabulary, clear of the special tokens at the bottom.
VOCAB_RANGE = (100, 49000)


def make_workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int):
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        plen = rng.randint(*prompt_len)
        work.append(([rng.randint(*VOCAB_RANGE) for _ in range(plen)], rng.randint(*output_len)))
    return work


def redrawn(work: list, seed: int) -> list:
    """`work` with new prompt tokens (drawn from `seed`): the same prompt and output lengths, so the
    same work for a server, but nothing a prefix cache holds from `work`."""
    rng = random.Random(seed)
    return [([rng.randint(*VOCAB_RANGE) for _ in prompt], n) for prompt, n in work]


def pass_breakdown(passes: list[tuple[int, int, int, float]]) -> dict:
    """Where the forward passes' time went: the passes with prompt pieces (their count, seconds and
    tokens), and the passes of decodes alone by batch size (count and mean milliseconds)."""
    prompts = [p for p in passes if p[1] > 0]
    decodes: dict[int, list[float]] = {}
    for rows, extends, _, seconds in passes:
        if extends == 0:
            decodes.setdefault(rows, []).append(seconds)
    return {
        "prompt_passes": {"count": len(prompts), "seconds": round(sum(p[3] for p in prompts), 2),
                          "tokens": sum(p[2] for p in prompts)},
        "decode_passes": {rows: {"count": len(times), "ms": round(1000 * sum(times) / len(times), 2)}
                          for rows, times in sorted(decodes.items())},
    }


def run_tandem(config: EngineConfig, work, outputs: list | None = None) -> dict:
    """`outputs`: if given, gets each request's output token ids."""
    from tandem.server.loop.engine import Engine
    from tandem.server.scheduling.sampling_params import SamplingParams

    engine = Engine(config)
    forward = [0.0]  # seconds inside runner.run: the forward passes and sampling
    passes: list[tuple[int, int, int, float]] = []  # per pass: sequences, prompt pieces, tokens, seconds
    run_pass = engine.runner.run

    def timed_run(step):
        start = time.perf_counter()
        try:
            return run_pass(step)
        finally:
            seconds = time.perf_counter() - start
            forward[0] += seconds
            q_lens = step.inputs.q_lens
            passes.append((len(q_lens), step.inputs.num_extends, sum(q_lens), seconds))

    engine.runner.run = timed_run
    with engine:
        warm = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
        engine.generate([work[0][0][:32]], warm)
        engine.flush_cache()
        forward[0] = 0.0
        passes.clear()
        warm_steps = engine.call(lambda: engine.scheduler.stats.forward_steps)
        start = time.perf_counter()
        streams = [engine.submit(p, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)) for p, n in work]
        results = [s.result() for s in streams]
        elapsed = time.perf_counter() - start
        steps = engine.call(lambda: engine.scheduler.stats.forward_steps) - warm_steps
        dtype = str(engine.model.precision.weights).removeprefix("torch.")
        ranks, overlap = engine.ranks, engine.overlap
        tp = None if ranks is None else (ranks.group.calls, ranks.group.seconds, ranks.sends, ranks.send_seconds)
    if outputs is not None:
        outputs.extend(r.output_ids for r in results)
    tokens = sum(len(r.output_ids) for r in results)
    assert tokens == sum(n for _, n in work), "tandem produced the wrong number of tokens"
    ttft = sorted(r.time_to_first_token for r in results)
    result = {
        "tp_size": config.tp_size,
        "overlap": overlap,
        "output_tokens": tokens,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(tokens / elapsed, 1),
        "forward_steps": steps,
        "ms_per_step": round(1000 * elapsed / steps, 2),
        # The plain loop's host work per step (what overlap can hide) is ms_per_step minus this.
        "forward_ms_per_step": round(1000 * forward[0] / steps, 2),
        "ttft_p50_s": round(ttft[len(ttft) // 2], 2),
        "dtype": dtype,
        **pass_breakdown(passes),
    }
    if tp is not None:  # counted since start-up, warm-up included: per step of all of them
        calls, seconds, sends, send_seconds = tp
        result.update(all_reduces_per_step=round(calls / sends, 1), all_reduce_ms_per_step=round(1000 * seconds / sends, 2),
                      send_ms_per_step=round(1000 * send_seconds / sends, 3))
    return result


def run_hf(config: EngineConfig, work, batch_size: int, dtype: str) -> dict:
    """`dtype`: the one tandem's run loaded (what `--dtype auto` resolved to there)."""
    from transformers import AutoModelForCausalLM

    from tandem.server.model.precision import DTYPES
    from tandem.server.model.loader import resolve_model

    source = resolve_model(config.model)
    kwargs = {"gguf_file": source.path.name} if source.kind == "gguf" else {}
    model_dir = source.path.parent if source.kind == "gguf" else source.path
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype], **kwargs).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        n = max(m for _, m in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad
            )
        assert out.shape[1] == width + n

    generate([(work[0][0][:32], 4)])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        generate(work[i : i + batch_size])
    elapsed = time.perf_counter() - start
    tokens = sum(n for _, n in work)
    return {"output_tokens": tokens, "seconds": round(elapsed, 2), "tokens_per_s": round(tokens / elapsed, 1)}


def compare_tp(config: EngineConfig, work, size: int, result: dict) -> int:
    """The workload at --tp-size 1 and `size`, one after the other in this run."""
    from dataclasses import replace

    for tp in (1, size):
        result[f"tp{tp}"] = run_tandem(replace(config, tp_size=tp), work)
        print(f"tp {tp}: {result[f'tp{tp}']}", flush=True)
    one, many = result["tp1"], result[f"tp{size}"]
    result["step_time_ratio"] = round(many["ms_per_step"] / one["ms_per_step"], 2)
    print(f"tp {size} / tp 1 step time = {result['step_time_ratio']}x; rank 0 spends "
          f"{many['all_reduce_ms_per_step']} ms per step in {many['all_reduces_per_step']} all-reduces and "
          f"{many['send_ms_per_step']} ms handing the step to the other ranks", flush=True)
    print(json.dumps(result))
    return 0


def compare_overlap(config: EngineConfig, work, result: dict) -> int:
    """The workload with the plain loop, then overlapped, in this run."""
    from dataclasses import replace

    outputs = {}
    for name, disable in (("plain", True), ("overlap", False)):
        outputs[name] = []
        result[name] = run_tandem(replace(config, disable_overlap_schedule=disable), work, outputs[name])
        print(f"{name}: {result[name]}", flush=True)
    plain = result["plain"]
    result["plain_host_ms_per_step"] = round(plain["ms_per_step"] - plain["forward_ms_per_step"], 2)
    result["same_tokens"] = outputs["plain"] == outputs["overlap"]
    result["ratio"] = round(result["overlap"]["tokens_per_s"] / result["plain"]["tokens_per_s"], 3)
    print(f"overlap / plain = {result['ratio']}x tokens/s; same tokens: {result['same_tokens']}; the plain loop "
          f"spends {result['plain_host_ms_per_step']} ms per step outside the forward pass (what overlap can hide) "
          f"and {plain['forward_ms_per_step']} ms in it", flush=True)
    print(json.dumps(result))
    return 0 if result["same_tokens"] else 1


def run(config: EngineConfig, args) -> int:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    work = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.workload_seed)
    print(
        f"workload: {len(work)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens "
        f"(total {sum(len(p) for p, _ in work)}), outputs {args.output_len[0]}-{args.output_len[1]} "
        f"(total {sum(n for _, n in work)}), seed {args.workload_seed}, dtype {config.dtype}, "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    result = {"bench": "offline", "dtype": config.dtype, "num_requests": len(work)}
    if args.compare_tp:
        return compare_tp(config, work, args.compare_tp, result)
    if args.compare_overlap:
        return compare_overlap(config, work, result)
    result["tandem"] = run_tandem(config, work)
    print(f"tandem: {result['tandem']}", flush=True)
    if not args.skip_hf:
        result["hf_static_batches"] = run_hf(config, work, args.hf_batch_size, result["tandem"]["dtype"])
        print(f"HF transformers, static batches of {args.hf_batch_size}: {result['hf_static_batches']}", flush=True)
        result["ratio"] = round(result["tandem"]["tokens_per_s"] / result["hf_static_batches"]["tokens_per_s"], 2)
        print(f"tandem / HF = {result['ratio']}x", flush=True)
    print(json.dumps(result))
    return 0
