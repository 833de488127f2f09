"""`tandem bench structured`: what structured output costs a server. One `tandem serve`, the serve
workload (`tandem bench serve`'s) run in alternating rounds over gRPC: every request free, then
every other request constrained by a JSON schema. Prints one JSON line per round, then the ratios
of the means, the schema's compile times (the tokenizer's vocabulary read once, a first compile, a
cached one) and the runner's grammar work per step (bitmask rows filled, logits rows masked), both
measured in this process on the same tokenizer.

Every request is greedy and asks for exactly its drawn output length (`ignore_eos`). The default
schema asks for 40 records, more than any output length here allows, so a constrained request never
completes its grammar early and both arms generate the same tokens.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from tandem.server.scheduling.sampling_params import Constraint, SamplingParams
from tandem.tools.bench_offline import make_workload
from tandem.tools.bench_serve import Sample, drive

RECORDS = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 40, "maxItems": 40, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                       "name": {"type": "string", "maxLength": 16},
                       "tags": {"type": "array", "items": {"enum": ["new", "sale", "gift"]}, "maxItems": 3},
                       "price": {"type": "number", "minimum": 0}},
        "required": ["id", "name", "tags", "price"]}}},
    "required": ["records"],
}
ARMS = ("none", "half")


def compile_times(compiler, schema: str) -> dict:
    """Milliseconds, on a fresh GrammarCompiler: reading the tokenizer's vocabulary, the first compile
    of `schema`, a cached one."""
    start = time.perf_counter()
    compiler.prepare()
    vocab = time.perf_counter() - start
    times = []
    for _ in range(2):
        start = time.perf_counter()
        compiler.matcher(Constraint("json_schema", schema))
        times.append(time.perf_counter() - start)
    return {"tokenizer_info_ms": round(vocab * 1e3, 1), "first_compile_ms": round(times[0] * 1e3, 2),
            "cached_compile_ms": round(times[1] * 1e3, 3)}


def mask_cost(compiler, schema: str, rows: int = 4, batch: int = 8) -> dict:
    """Milliseconds per step of the runner's grammar work for `rows` constrained requests in a batch
    of `batch`: filling their bitmask rows (matchers walked 24 tokens into the schema, each taking
    the lowest token allowed) and masking their logits rows."""
    import torch

    from tandem.kernels.sampling import apply_token_bitmask
    from tandem.server.loop.grammar import token_bitmask

    vocab_size = compiler.vocab_size
    matchers = [compiler.matcher(Constraint("json_schema", schema)) for _ in range(rows)]
    for step in range(24):
        for i, matcher in enumerate(matchers[: rows - step % rows]):  # a few states, not one
            words = token_bitmask([matcher], vocab_size)[0].tolist()
            matcher.accept(next(32 * w + b for w, word in enumerate(words) for b in range(32) if word >> b & 1))
    logits, masked, repeats = torch.randn(batch, vocab_size), list(range(0, batch, batch // rows))[:rows], 50
    fill = mask = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        bitmask = token_bitmask(matchers, vocab_size)
        middle = time.perf_counter()
        apply_token_bitmask(logits.clone(), masked, bitmask)
        fill, mask = fill + middle - start, mask + time.perf_counter() - middle
    return {"bitmask_fill_ms_per_step": round(fill / repeats * 1e3, 3), "mask_ms_per_step": round(mask / repeats * 1e3, 3)}


def run(args, engine_args: list[str]) -> int:
    from smg_grpc_proto import sglang_scheduler_pb2 as pb

    from tandem.server.loop.grammar import GrammarCompiler
    from tandem.server.model.loader import resolve_model
    from tandem.server.model.tokenizer import load_tokenizer
    from tandem.tools.client import Client, request_message
    from tandem.tools.stack import LocalStack

    schema = Path(args.json_schema).read_text() if args.json_schema else json.dumps(RECORDS)
    constraint = Constraint("json_schema", schema)
    work = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.workload_seed)
    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-bench-structured-"))
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with LocalStack(logs, tuple(engine_args)) as stack:
        server = stack.start_server("colocated")
        stack.wait()
        client = Client(server.target)
        info = client.stub.GetModelInfo(pb.GetModelInfoRequest())

        def run_one(prompt: list[int], n: int, constrained: bool) -> Sample:
            params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True,
                                    constraint=constraint if constrained else None)
            result = client.stream(request_message(prompt, params))
            return Sample(len(result.output_ids), result.ttft or result.latency, result.latency)

        # Warm-up: the workload's prompts with short outputs, half constrained (the server's one
        # compile of the schema), counted in no round.
        drive(run_one, [(p, 8, i % 2 == 1) for i, (p, _) in enumerate(work)], args.concurrency)
        for round_ in range(args.rounds):
            for arm in ARMS if round_ % 2 == 0 else ARMS[::-1]:  # none, half, half, none, ...: drift cancels
                arm_work = [(p, n, arm == "half" and i % 2 == 1) for i, (p, n) in enumerate(work)]
                result = {"bench": "structured", "arm": arm, "round": round_,
                          **drive(run_one, arm_work, args.concurrency)}
                results[arm].append(result)
                print(json.dumps(result), flush=True)
        client.close()
    mean = {arm: {k: statistics.mean(r[k] for r in rs) for k in ("output_tokens_per_s", "ttft_p50_s", "tpot_p50_ms")}
            for arm, rs in results.items()}
    none, half = mean["none"], mean["half"]
    compiler = GrammarCompiler(tokenizer, info.vocab_size, frozenset(info.eos_token_ids), timeout=600)
    grammar_costs = {**compile_times(compiler, schema), **mask_cost(compiler, schema)}
    compiler.close()
    print(json.dumps({
        "bench": "structured", "arm": "summary", "rounds": args.rounds,
        "output_tokens_none": results["none"][0]["output_tokens"], "output_tokens_half": results["half"][0]["output_tokens"],
        "throughput_half_over_none": round(half["output_tokens_per_s"] / none["output_tokens_per_s"], 3),
        "ttft_p50_half_over_none": round(half["ttft_p50_s"] / none["ttft_p50_s"], 3),
        "tpot_p50_half_over_none": round(half["tpot_p50_ms"] / none["tpot_p50_ms"], 3),
        **grammar_costs,
    }))
    return 0
