"""The `tandem` command: the engine (`generate`, `serve`), the operator, and the tools (client,
chat, demo, benchmarks). Engine, serving and sampling flags are generated from their config
dataclasses; subcommands import what they run only when they run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tandem.common.options import add_arguments, flag, from_args
from tandem.server.config import DisaggConfig, EngineConfig, ServeConfig
from tandem.server.scheduling.sampling_params import Constraint, SamplingParams

# On the command line sampling is greedy unless asked otherwise (an API request's default is 1.0).
CLI_SAMPLING_DEFAULTS = {"temperature": 0.0}


def changed_engine_flags(args: argparse.Namespace) -> list[str]:
    """The EngineConfig flags given on this command line, to pass on to `tandem serve`."""
    config, flags = from_args(args, EngineConfig), []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        if isinstance(value, bool):
            flags.append(flag(f.name) if value else flag(f"no_{f.name}"))
        elif isinstance(value, tuple):  # a repeatable flag, once per value
            flags += [f"{flag(f.name)}={v}" for v in value]
        else:
            flags.append(f"{flag(f.name)}={value}")
    return flags


def _sampling_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    add_arguments(parser, SamplingParams, CLI_SAMPLING_DEFAULTS, exclude)


def _constraint_arguments(parser: argparse.ArgumentParser) -> None:
    """Structured output: at most one of --json-schema FILE, --regex PATTERN, --ebnf-grammar FILE."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", help="the output must be JSON matching the schema in FILE")
    group.add_argument("--regex", metavar="PATTERN", help="the output must match the regular expression PATTERN")
    group.add_argument("--ebnf-grammar", metavar="FILE", help="the output must match the EBNF grammar in FILE "
                       "(GBNF syntax, rule `root`)")


def _sampling_params(args) -> SamplingParams:
    """The sampling flags, and the constraint flags where the command has them."""
    constraint = None
    if getattr(args, "regex", None) is not None:
        constraint = Constraint("regex", args.regex)
    for kind in ("json_schema", "ebnf_grammar"):
        if getattr(args, kind, None) is not None:
            try:
                constraint = Constraint(kind, Path(getattr(args, kind)).read_text())
            except OSError as e:
                raise SystemExit(f"error: {flag(kind)}: {e}") from None
    return from_args(args, SamplingParams, seed=None, constraint=constraint)  # --seed is the engine's (or none)


def _read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    prompts = []
    for n, line in enumerate(Path(args.prompts_file).read_text().splitlines(), 1):
        if not line.strip():
            continue
        value = json.loads(line)
        if not isinstance(value, str):
            raise SystemExit(f"--prompts-file line {n}: expected a JSON string, got {type(value).__name__}")
        prompts.append(value)
    return prompts


def cmd_generate(args) -> int:
    from tandem.server.loop.engine import Engine
    from tandem.server.model.loader import ModelLoadError
    from tandem.server.scheduling.sampling_params import InvalidRequestError

    prompts = _read_prompts(args)
    params = _sampling_params(args)
    try:
        engine = Engine(from_args(args, EngineConfig))
    except (ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with engine:
        if args.chat:
            prompts = [
                engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                for p in prompts
            ]
        try:
            ids = [engine.tokenizer.encode(p) if p else [] for p in prompts]
            streams = [engine.submit(i, params) for i in ids]
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        results = [s.result() for s in streams]
    for i, r in enumerate(results):
        if args.json:
            print(json.dumps({"index": i, "prompt_tokens": r.prompt_tokens, "output_ids": r.output_ids,
                              "text": r.text, "finish_reason": r.finish_reason}))
        else:
            print(f"--- [{i}] {r.prompt_tokens} prompt tokens, {len(r.output_ids)} generated ({r.finish_reason})")
            print(r.text)
    return 0


def cmd_serve(args) -> int:
    from tandem.server.edge.serve import run

    try:
        return run(from_args(args, EngineConfig), from_args(args, ServeConfig), from_args(args, DisaggConfig))
    except (ValueError, OSError, RuntimeError) as e:  # bad flags, busy ports, Mooncake that cannot start
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_operator(args) -> int:
    from tandem.operator.main import main as operator_main

    return operator_main(args)


def cmd_client_generate(args) -> int:
    from tandem.tools.client import generate

    return generate(args, _sampling_params(args))


def cmd_chat(args) -> int:
    from tandem.tools.client import chat

    return chat(args, from_args(args, SamplingParams, seed=None))


def cmd_bench_serve(args) -> int:
    from tandem.tools.bench_serve import run

    return run(args)


def cmd_demo(args) -> int:
    from tandem.tools.demo import run_offline_demo, run_pd_demo

    if args.offline:
        return run_offline_demo(from_args(args, EngineConfig), args.max_new_tokens)
    engine_args = changed_engine_flags(args)
    if args.max_total_tokens is None:  # two servers on one machine: a modest pool each
        engine_args.append("--max-total-tokens=32768")
    try:
        return run_pd_demo(engine_args, args.max_new_tokens, args.keep_running, args.log_dir)
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def cmd_bench_offline(args) -> int:
    from tandem.tools.bench_offline import run

    return run(from_args(args, EngineConfig), args)


def cmd_bench_cache_routing(args) -> int:
    from tandem.tools.bench_cache_routing import run

    return run(args, changed_engine_flags(args))


def cmd_bench_pd(args) -> int:
    from tandem.tools.bench_pd import run

    engine_args = changed_engine_flags(args)
    return run(args, engine_args)


def cmd_bench_structured(args) -> int:
    from tandem.tools.bench_structured import run

    return run(args, changed_engine_flags(args))


def cmd_bench_kv_transfer(args) -> int:
    from tandem.tools.bench_kv_transfer import run

    return run(from_args(args, EngineConfig), args)


def cmd_bench_linear(args) -> int:
    from tandem.tools.bench_linear import run

    return run(args)


def cmd_bench_step(args) -> int:
    from tandem.tools.bench_step import run

    return run(args)


def cmd_bench_gpu(args) -> int:
    from tandem.tools.bench_gpu import run

    return run(args)


def cmd_bench_peers(args) -> int:
    from tandem.tools.bench_peers import run

    return run(args, changed_engine_flags(args))


def cmd_bench_autoscale(args) -> int:
    from tandem.tools.bench_autoscale import SimConfig, report_dict, report_text, simulate

    try:
        result = simulate(from_args(args, SimConfig))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report_dict(result, args.decisions)) if args.json else report_text(result, args.decisions))
    return 0


def cmd_export_tokenizer(args) -> int:
    from tandem.server.model.loader import resolve_model
    from tandem.server.model.tokenizer import export_tokenizer

    print(export_tokenizer(resolve_model(args.model), Path(args.dir)))
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate for one prompt or a file of prompts, batched together")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (raw text, no chat template unless --chat)")
    src.add_argument("--prompts-file", help="a file with one JSON string per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt, in input order")
    _sampling_arguments(gen, exclude=("seed",))  # --seed: EngineConfig's, for requests that bring none
    _constraint_arguments(gen)
    add_arguments(gen, EngineConfig)
    gen.set_defaults(func=cmd_generate)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve SGLang's gRPC scheduler protocol, health and /metrics")
    add_arguments(serve, ServeConfig)
    add_arguments(serve, DisaggConfig)
    add_arguments(serve, EngineConfig)
    serve.set_defaults(func=cmd_serve)


def _add_operator(sub: argparse._SubParsersAction) -> None:
    from tandem.operator.main import add_arguments as add_operator_arguments

    op = sub.add_parser("operator", help="run the Kubernetes operator (InferenceService -> pools and router)")
    add_operator_arguments(op)
    op.set_defaults(func=cmd_operator)


def _add_client(sub: argparse._SubParsersAction) -> None:
    client = sub.add_parser("client", help="talk to a running server")
    client_sub = client.add_subparsers(dest="client", required=True)
    cgen = client_sub.add_parser("generate", help="tokenize locally, stream the answer, print TTFT and tokens/s")
    cgen.add_argument("--target", default="127.0.0.1:30000", help="HOST:PORT of a tandem server")
    cgen.add_argument("--prompt", required=True)
    cgen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    cgen.add_argument("--model", default=EngineConfig.model, help="where the tokenizer comes from")
    cgen.add_argument("--prefill-target", help="HOST:PORT of a prefill server: send a disaggregated request "
                      "(prefill leg there, decode leg to --target)")
    cgen.add_argument("--bootstrap-port", type=int, default=8998, help="the prefill server's bootstrap port")
    _sampling_arguments(cgen, exclude=("seed",))  # the wire has no seed
    _constraint_arguments(cgen)
    cgen.set_defaults(func=cmd_client_generate)


def _add_chat(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="chat with a running server (one line per turn; empty line or EOF ends)")
    chat.add_argument("--target", default="127.0.0.1:30000")
    chat.add_argument("--model", default=EngineConfig.model)
    _sampling_arguments(chat, exclude=("seed",))
    chat.set_defaults(func=cmd_chat)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="prefill + decode servers and the smg router on 127.0.0.1; stream a few chat answers")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--keep-running", action="store_true", help="leave the stack up and print how to call it")
    demo.add_argument("--offline", action="store_true", help="no servers: run the engine in this process")
    demo.add_argument("--log-dir", help="where the servers and the router log (default: a new temporary directory)")
    add_arguments(demo, EngineConfig)
    demo.set_defaults(func=cmd_demo)


def _add_bench_offline(bench_sub: argparse._SubParsersAction) -> None:
    off = bench_sub.add_parser("offline", help="tandem vs HF transformers static batches, same workload")
    off.add_argument("--num-requests", type=int, default=64)
    off.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    off.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    off.add_argument("--hf-batch-size", type=int, default=16)
    off.add_argument("--workload-seed", type=int, default=1)
    off.add_argument("--skip-hf", action="store_true", help="run tandem only")
    off.add_argument("--compare-tp", type=int, metavar="N", help="run tandem at --tp-size 1 and N instead of HF, and "
                     "report the collectives' cost per step")
    off.add_argument("--compare-overlap", action="store_true", help="run tandem with and without overlap scheduling "
                     "instead of HF, and check that both give the same tokens")
    add_arguments(off, EngineConfig)
    off.set_defaults(func=cmd_bench_offline)


def _add_bench_serve(bench_sub: argparse._SubParsersAction) -> None:
    bserve = bench_sub.add_parser("serve", help="drive a running server with a fixed-seed streaming workload")
    bserve.add_argument("--target", default="127.0.0.1:30000", help="HOST:PORT: a tandem gRPC server, or the router with --openai")
    bserve.add_argument("--openai", action="store_true", help="target is an OpenAI-compatible HTTP endpoint (the router)")
    bserve.add_argument("--model", default=EngineConfig.model, help="tokenizer source (and the model name for --openai)")
    bserve.add_argument("--num-requests", type=int, default=32)
    bserve.add_argument("--concurrency", type=int, default=8)
    bserve.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    bserve.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    bserve.add_argument("--workload-seed", type=int, default=1)
    bserve.set_defaults(func=cmd_bench_serve)


def _add_bench_pd(bench_sub: argparse._SubParsersAction) -> None:
    bpd = bench_sub.add_parser("pd", help="the serve workload colocated vs prefill+decode (Mooncake), behind the router, in one run")
    bpd.add_argument("--num-requests", type=int, default=32)
    bpd.add_argument("--concurrency", type=int, default=8)
    bpd.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    bpd.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    bpd.add_argument("--workload-seed", type=int, default=1)
    bpd.add_argument("--shared-prefix", action="store_true", help="instead: system prompts each shared by several users "
                     "(--system-prompts, --users, --system-len, --question-len; outputs of --output-len MAX tokens)")
    bpd.add_argument("--system-prompts", type=int, default=4, help="with --shared-prefix: distinct system prompts")
    bpd.add_argument("--users", type=int, default=8, help="with --shared-prefix: requests per system prompt")
    bpd.add_argument("--system-len", type=int, default=320, help="with --shared-prefix: tokens per system prompt")
    bpd.add_argument("--question-len", type=int, default=24, help="with --shared-prefix: tokens per question")
    bpd.add_argument("--log-dir", help="server and router logs (default: a new temporary directory)")
    bpd.add_argument("--compare-kv", metavar="MODEL", help="instead: the KV bytes moved per request and held per token "
                     "with --model and with MODEL, disaggregated")
    bpd.add_argument("--tls", action="store_true", help="instead: a prefill + decode pair over gRPC, plaintext vs "
                     "mutual TLS, alternating --rounds")
    bpd.add_argument("--rounds", type=int, default=3, help="with --tls: rounds of each")
    add_arguments(bpd, EngineConfig)
    bpd.set_defaults(func=cmd_bench_pd)


def _add_bench_structured(bench_sub: argparse._SubParsersAction) -> None:
    bst = bench_sub.add_parser("structured", help="the serve workload with every other request constrained by a JSON "
                               "schema vs none, alternating rounds on one server; and the schema's compile times")
    bst.add_argument("--num-requests", type=int, default=32)
    bst.add_argument("--concurrency", type=int, default=8)
    bst.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    bst.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    bst.add_argument("--workload-seed", type=int, default=1)
    bst.add_argument("--rounds", type=int, default=2, help="rounds of each arm, alternated")
    bst.add_argument("--json-schema", metavar="FILE", help="the constraint (default: 40 records, longer than any "
                     "output, so no constrained request ends early)")
    bst.add_argument("--log-dir", help="the server's log (default: a new temporary directory)")
    add_arguments(bst, EngineConfig)
    bst.set_defaults(func=cmd_bench_structured)


def _add_bench_cache_routing(bench_sub: argparse._SubParsersAction) -> None:
    bcr = bench_sub.add_parser("cache-routing", help="smg's cache-aware policy over two colocated servers, told "
                               "where prefixes are cached (KV events) vs guessing, on a shared-system-prompt workload")
    bcr.add_argument("--system-prompts", type=int, default=6, help="distinct system prompts")
    bcr.add_argument("--users", type=int, default=6, help="requests per system prompt, each with its own question")
    bcr.add_argument("--system-len", type=int, default=320, help="tokens per system prompt")
    bcr.add_argument("--question-len", type=int, default=24, help="tokens per question")
    bcr.add_argument("--output-len", type=int, default=8)
    bcr.add_argument("--concurrency", type=int, default=4)
    bcr.add_argument("--workload-seeds", type=int, nargs="+", default=[1, 2, 3, 4], help="one workload per seed")
    bcr.add_argument("--pd", action="store_true", help="instead: 1 prefill + 2 decode servers, the decodes picked "
                     "cache_aware vs power_of_two (what their caches spare in KV transfer)")
    bcr.add_argument("--log-dir", help="server and router logs (default: a new temporary directory)")
    add_arguments(bcr, EngineConfig)
    bcr.set_defaults(func=cmd_bench_cache_routing, max_total_tokens=1536)


def _add_bench_kv_transfer(bench_sub: argparse._SubParsersAction) -> None:
    bkv = bench_sub.add_parser("kv-transfer", help="prefill -> decode KV writes between engines of given tensor-parallel "
                               "sizes, in this process, one pair after the other")
    bkv.add_argument("--pairs", nargs="+", default=["1:1", "3:1", "1:3", "3:3"], metavar="PREFILL:DECODE")
    bkv.add_argument("--prompt-len", type=int, default=1200)
    bkv.add_argument("--requests", type=int, default=4)
    add_arguments(bkv, EngineConfig)
    bkv.set_defaults(func=cmd_bench_kv_transfer, max_total_tokens=8192)


def _add_bench_linear(bench_sub: argparse._SubParsersAction) -> None:
    blin = bench_sub.add_parser("linear", help="the model's projections in each form a weight can be held in "
                                "(F.linear, x @ W, oneDNN-packed), per batch size and dtype")
    blin.add_argument("--model", default=EngineConfig.model)
    blin.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256], help="batch sizes (rows of x)")
    blin.add_argument("--dtype", action="append", choices=["float32", "bfloat16"], help="default: both")
    blin.add_argument("--num-threads", type=int, help="torch CPU threads (default: all cores)")
    blin.add_argument("--whole-model", action="store_true", help="one pass over all of the model's projections "
                      "per batch size, as a step streams them, in each form a float32 model on a CPU can use")
    blin.set_defaults(func=cmd_bench_linear)


def _add_bench_step(bench_sub: argparse._SubParsersAction) -> None:
    bstep = bench_sub.add_parser("step", help="one decode step of the model per batch size in two forms, alternated "
                                 "in one run: native layer ops vs torch's, the KV cache on huge vs 4 KiB pages, or decode "
                                 "attention read in place vs gathered, the layers as native calls vs op by op, all layers in one "
                                 "call vs one per layer, weights prefetched vs not, the "
                                 "weights' forms, or (a prefill pass) prompt attention in bfloat16 vs float32")
    bstep.add_argument("--compare", choices=["layer-ops", "kv-pages", "decode-attention", "fused-layer", "fused-stack", "stripes",
                                             "weight-prefetch",
                                             "prompt-attention", "weights"],
                       default="layer-ops")
    bstep.add_argument("--model", default=EngineConfig.model)
    bstep.add_argument("--dtype", default="auto", help="weights' dtype (as --dtype; auto: what a server picks here)")
    bstep.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="sequences decoding in the step")
    bstep.add_argument("--context", type=int, default=350, help="tokens already in each sequence's KV")
    bstep.add_argument("--steps", type=int, default=30, help="timed steps per form and batch size")
    bstep.add_argument("--kv-tokens", type=int, default=65536, help="KV cache size in tokens (the pages are scattered)")
    bstep.set_defaults(func=cmd_bench_step)


def _add_bench_gpu(bench_sub: argparse._SubParsersAction) -> None:
    bgpu = bench_sub.add_parser("gpu", help="decode steps (eager and CUDA graphs) and prefill of real-size model "
                                "shapes with random weights, beside the GPU's memory floor and matmul peak measured "
                                "in the same run")
    bgpu.add_argument("--shapes", nargs="+", default=["llama3-8b", "llama3.2-1b"], help="model shapes (random weights)")
    bgpu.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256], help="decode batch sizes")
    bgpu.add_argument("--context", type=int, default=512, help="tokens already in each decoding sequence's KV")
    bgpu.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size and form")
    bgpu.add_argument("--prefill-len", type=int, default=2048, help="tokens per prompt in the prefill pass")
    bgpu.add_argument("--prefill-tokens", type=int, default=8192, help="prompt tokens in the prefill pass")
    bgpu.add_argument("--layers", type=int, help="fewer layers than the shape has (a quicker smoke run)")
    bgpu.add_argument("--no-graphs", action="store_true", help="eager decode only")
    bgpu.add_argument("--no-projections", dest="projections", action="store_false",
                      help="skip timing each projection alone (cuBLAS, against the copy bandwidth)")
    bgpu.add_argument("--projection-rows", type=int, nargs="+", default=[1, 8],
                      help="rows of the projections timed alone")
    bgpu.add_argument("--profile", action="store_true",
                      help="also profile one graphed step at the smallest batch: kernels run, GPU busy time, the longest")
    bgpu.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (eager, torch attention: a smoke test)")
    bgpu.add_argument("--json-out", help="also write the figures as JSON to this file")
    bgpu.set_defaults(func=cmd_bench_gpu)


def _add_bench_peers(bench_sub: argparse._SubParsersAction) -> None:
    bpeers = bench_sub.add_parser("peers", help="tandem (colocated and 1 prefill + 1 decode) against vLLM's CPU build "
                                  "and llama.cpp's server on this machine, the serve workload, one server at a time, "
                                  "in one run")
    bpeers.add_argument("--num-requests", type=int, default=32)
    bpeers.add_argument("--concurrency", type=int, default=8)
    bpeers.add_argument("--c1-requests", type=int, default=8, help="requests then run one at a time")
    bpeers.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    bpeers.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    bpeers.add_argument("--workload-seed", type=int, default=1)
    bpeers.add_argument("--rounds", type=int, default=1,
                        help="runs of the loaded workload per system, each with new prompts (seeds +1000, +2000, ...: "
                             "no prefix cache hits); the figures cover them all")
    bpeers.add_argument("--vllm-dtype", action="append", choices=["bfloat16", "float32"],
                        help="vLLM dtypes to run, each its own server (default: both; its best counts)")
    bpeers.add_argument("--repeats", type=int, default=1,
                        help="runs of the whole workload per system, back to back on one server, each of the same "
                             "prompt and output lengths with new prompt tokens: the table gives their medians and "
                             "their spread")
    bpeers.add_argument("--interleave", action="store_true",
                        help="start every server first, then run the systems in turn, repeat by repeat: each "
                             "repeat's figures from the same minutes of the machine")
    bpeers.add_argument("--variant", action="append", metavar="LABEL=FLAGS",
                        help="also tandem colocated with these serve flags, as 'tandem LABEL' (repeatable)")
    bpeers.add_argument("--skip-vllm", action="store_true", help="no vLLM runs")
    bpeers.add_argument("--skip-llama-cpp", action="store_true", help="no llama.cpp run")
    bpeers.add_argument("--skip-pd", action="store_true", help="no 1 prefill + 1 decode run")
    bpeers.add_argument("--home", default="~/.cache/tandem/peers", help="where vLLM's venv, the exported model and llama.cpp's build live")
    bpeers.add_argument("--log-dir", help="server logs (default: a new temporary directory)")
    add_arguments(bpeers, EngineConfig)
    bpeers.set_defaults(func=cmd_bench_peers)


def _add_bench_autoscale(bench_sub: argparse._SubParsersAction) -> None:
    from tandem.tools.bench_autoscale import SimConfig

    bauto = bench_sub.add_parser("autoscale", help="simulate a ramp, a spike and a quiet period through the "
                                 "operator's real scaling decision; autoscaled vs fixed pod-minutes and latency")
    bauto.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    bauto.add_argument("--decisions", action="store_true", help="also list every scaling decision with its reason")
    add_arguments(bauto, SimConfig)
    bauto.set_defaults(func=cmd_bench_autoscale)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for add in (_add_bench_offline, _add_bench_serve, _add_bench_pd, _add_bench_structured, _add_bench_cache_routing,
                _add_bench_kv_transfer, _add_bench_linear, _add_bench_step, _add_bench_gpu, _add_bench_peers,
                _add_bench_autoscale):
        add(bench_sub)


def _add_export_tokenizer(sub: argparse._SubParsersAction) -> None:
    exp = sub.add_parser("export-tokenizer", help="write the model's tokenizer files into DIR")
    exp.add_argument("dir")
    exp.add_argument("--model", default=EngineConfig.model)
    exp.set_defaults(func=cmd_export_tokenizer)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="LLM serving with prefill/decode disaggregation")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_serve, _add_operator, _add_client, _add_chat, _add_demo, _add_bench,
                _add_export_tokenizer):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tandem.common.cpu import apply_isa_cap

    try:
        apply_isa_cap()  # before torch computes anything, in this process and those it starts
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    if argv is None and args.command == "serve":  # this process's own command line, so it may re-execute
        from tandem.server.edge.allocator import preload

        try:
            preload(args.allocator, args.device)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
