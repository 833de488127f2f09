"""`tandem bench pd`: the `tandem bench serve` workload, run colocated (one server),
disaggregated (one prefill + one decode server, KV over Mooncake), and disaggregated with the
decode's prefix reuse off (`--disable-decode-prefix-reuse`: every prompt page moves), each behind
the smg router, in one run. Prints each result, the KV bytes moved per request and those the
decode's own prefix cache spared, the prefill's KV write time per request (p50/p99) against
TTFT, and Mooncake's TCP throughput against a plain memory copy of the same bytes. One JSON line
per part, then a summary.

`--shared-prefix` swaps the workload for `tandem bench cache-routing`'s: a few long system
prompts, each shared by several users, the case decode-side prefix reuse is for.

`--tls` instead measures what mutual TLS on the servers' gRPC ports costs: two warm prefill + decode
pairs side by side, one plaintext and one with `--tls-cert/--tls-key/--tls-ca`, driven over gRPC
with both legs of each request sent as the router sends them (smg 1.13 speaks no TLS to its
workers, docs/kubernetes.md), in `--rounds` alternating rounds; the ratios are per round, then their
median.

`--compare-kv MODEL` instead runs the workload disaggregated (every prompt page moving) with
`--model` and then with MODEL, and reports what each moves per request and holds per token: a
latent-attention checkpoint beside a multi-head one of the same width
(`python -m tandem.tools.checkpoints`).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from tandem.tools import bench_cache_routing
from tandem.tools.bench_offline import make_workload
from tandem.tools.bench_serve import openai_runner, drive

# mode -> (roles, extra server flags)
MODES = {
    "colocated": (["colocated"], ()),
    "disaggregated": (["prefill", "decode"], ()),
    "disaggregated_no_decode_reuse": (["prefill", "decode"], ("--disable-decode-prefix-reuse",)),
}


def histogram_quantile(text: str, name: str, q: float) -> float:
    """Prometheus' histogram_quantile over one exposition: linear within the bucket."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{name}_bucket":
                buckets.append((float(s.labels["le"]), s.value))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if total == 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def transfer_vs_memcpy(nbytes: int, repeats: int = 20) -> dict:
    """Mooncake TCP write (two engines in this process, over loopback) against torch's memcpy of
    the same bytes, both timed over `repeats` copies."""
    from tandem.server.disagg.transfer import MooncakeTransfer

    src = torch.randn(nbytes // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)
    sender, receiver = MooncakeTransfer("127.0.0.1", "tcp"), MooncakeTransfer("127.0.0.1", "tcp")
    src_addr, dst_addr = sender.register(src), receiver.register(dst)
    size = src.numel() * 4
    sender.write(receiver.session, [src_addr], [dst_addr], [size])  # warm the connection
    start = time.perf_counter()
    for _ in range(repeats):
        sender.write(receiver.session, [src_addr], [dst_addr], [size])
    mooncake_s = (time.perf_counter() - start) / repeats
    assert torch.equal(src, dst), "Mooncake copy differs"
    copy = torch.empty_like(src)
    copy.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        copy.copy_(src)
    memcpy_s = (time.perf_counter() - start) / repeats
    return {"bytes": size, "mooncake_tcp_gb_s": round(size / mooncake_s / 1e9, 2),
            "memcpy_gb_s": round(size / memcpy_s / 1e9, 2), "mooncake_over_memcpy": round(memcpy_s / mooncake_s, 3)}


def compare_kv(args, engine_args: list[str], work) -> int:
    """The workload disaggregated, no decode-side reuse, for --model and for --compare-kv: the KV
    bytes each moves per request (the prefill's counter) and holds per token (GetServerInfo)."""
    from tandem.tools.stack import LocalStack, metric_value

    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-bench-pd-"))
    results = []
    for model in (args.model, args.compare_kv):
        flags = [*_without_model(engine_args), "--model", model, "--disable-decode-prefix-reuse"]
        log_dir = logs / f"compare-kv-{len(results)}"
        log_dir.mkdir(parents=True, exist_ok=True)
        with LocalStack(log_dir, tuple(flags)) as stack:
            prefill, _ = stack.start_servers(["prefill", "decode"])
            stack.wait()
            base = stack.start_router().url
            run_one, _ = openai_runner(base.removeprefix("http://"), stack.model_name, _tokenizer(model))
            served = drive(run_one, work, args.concurrency)
            sent = metric_value(prefill.metrics_text(), "tandem_kv_transfer_bytes_total")
            result = {"bench": "pd", "mode": "compare_kv", "model": model,
                      "kv_bytes_per_token": int(_server_args(prefill.target)["kv_bytes_per_token"]),
                      "kv_bytes_per_request": int(sent / len(work)), "output_tokens_per_s": served["output_tokens_per_s"]}
        results.append(result)
        print(json.dumps(result), flush=True)
    print(json.dumps({"bench": "pd", "mode": "summary",
                      "kv_bytes_per_request_model_over_compare": round(
                          results[0]["kv_bytes_per_request"] / results[1]["kv_bytes_per_request"], 4)}))
    return 0


def compare_tls(args, engine_args: list[str], work) -> int:
    import statistics

    from tandem.tools.bench_serve import pd_grpc_runner
    from tandem.tools.certs import mutual_tls
    from tandem.tools.stack import LocalStack

    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-bench-pd-tls-"))
    modes = ("plaintext", "mutual_tls")
    for mode in modes:
        (logs / mode).mkdir(parents=True, exist_ok=True)
    with LocalStack(logs / "plaintext", tuple(engine_args)) as plain, \
            LocalStack(logs / "mutual_tls", tuple(engine_args), tls=mutual_tls(logs / "certs")) as tls:
        pairs = {"plaintext": plain.start_servers(["prefill", "decode"]), "mutual_tls": tls.start_servers(["prefill", "decode"])}
        plain.wait()
        tls.wait()
        runners = {mode: pd_grpc_runner(p.target, p.bootstrap_port, d.target, p.credentials) for mode, (p, d) in pairs.items()}
        try:
            for mode in modes:  # warm both: first-use costs (handshakes, allocations) stay out of the rounds
                drive(runners[mode][0], work[:args.concurrency], args.concurrency)
            rounds = []
            for r in range(args.rounds):
                results = {}
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    results[mode] = {"bench": "pd", "mode": mode, "round": r, **drive(runners[mode][0], work, args.concurrency)}
                    print(json.dumps(results[mode]), flush=True)
                rounds.append(results)
        finally:
            for _, close in runners.values():
                close()

    def ratio(key: str) -> dict:
        each = [round(r["mutual_tls"][key] / r["plaintext"][key], 3) for r in rounds]
        return {"median": round(statistics.median(each), 3), "rounds": each}

    print(json.dumps({"bench": "pd", "mode": "summary", "rounds": args.rounds,
                      "throughput_tls_over_plaintext": ratio("output_tokens_per_s"),
                      "ttft_p50_tls_over_plaintext": ratio("ttft_p50_s"),
                      "tpot_p50_tls_over_plaintext": ratio("tpot_p50_ms")}))
    return 0


def _without_model(flags: list[str]) -> list[str]:
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag == "--model":
            skip = True
        elif not flag.startswith("--model="):
            out.append(flag)
    return out


def _tokenizer(model: str):
    from tandem.server.model.loader import resolve_model
    from tandem.server.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(model))


def _server_args(target: str) -> dict:
    import grpc
    from google.protobuf.json_format import MessageToDict
    from smg_grpc_proto import sglang_scheduler_pb2 as pb
    from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        info = pb_grpc.SglangSchedulerStub(channel).GetServerInfo(pb.GetServerInfoRequest())
    return MessageToDict(info.server_args)


def run(args, engine_args: list[str]) -> int:
    from tandem.server.model.loader import resolve_model
    from tandem.tools.stack import LocalStack, metric_value
    from tandem.server.model.tokenizer import load_tokenizer

    if args.compare_kv or args.tls:
        work = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.workload_seed)
        return compare_kv(args, engine_args, work) if args.compare_kv else compare_tls(args, engine_args, work)
    if args.shared_prefix:
        work = bench_cache_routing.make_workload(args.system_prompts, args.users, args.system_len, args.question_len,
                                                 args.output_len[1], args.workload_seed)
    else:
        work = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.workload_seed)
    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-bench-pd-"))
    logs.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode, (roles, flags) in MODES.items():
        (logs / mode).mkdir(exist_ok=True)
        with LocalStack(logs / mode, (*engine_args, *flags)) as stack:
            servers = stack.start_servers(roles)
            stack.wait()
            base = stack.start_router().url
            run_one, _ = openai_runner(base.removeprefix("http://"), stack.model_name, tokenizer)
            result = {"bench": "pd", "mode": mode, **drive(run_one, work, args.concurrency)}
            if len(roles) == 2:
                prefill, decode = servers[0].metrics_text(), servers[1].metrics_text()
                sent = metric_value(prefill, "tandem_kv_transfer_bytes_total")
                skipped = metric_value(decode, "tandem_kv_transfer_skipped_bytes_total")
                hit = metric_value(decode, "tandem_decode_prefix_hit_tokens_total")
                query = metric_value(decode, "tandem_decode_prefix_query_tokens_total")
                write = [histogram_quantile(prefill, "tandem_kv_transfer_latency_seconds", q) for q in (0.5, 0.99)]
                result.update({
                    "kv_bytes_moved": int(sent),
                    "kv_bytes_per_request": int(sent / len(work)),
                    "kv_bytes_skipped_per_request": int(skipped / len(work)),
                    "decode_prefix_hit_rate": round(hit / query, 3) if query else 0.0,
                    "kv_write_p50_ms": round(write[0] * 1000, 2),
                    "kv_write_p99_ms": round(write[1] * 1000, 2),
                    "kv_write_p50_share_of_ttft_p50": round(write[0] / result["ttft_p50_s"], 4),
                    "kv_write_p99_share_of_ttft_p99": round(write[1] / result["ttft_p99_s"], 4),
                    "kv_transfer_failures": int(metric_value(prefill, "tandem_kv_transfer_failures_total")),
                })
            results[mode] = result
            print(json.dumps(result), flush=True)
    copy = {"bench": "pd", "mode": "copy",
            **transfer_vs_memcpy(results["disaggregated_no_decode_reuse"]["kv_bytes_per_request"])}
    print(json.dumps(copy), flush=True)
    colo, pd, whole = results["colocated"], results["disaggregated"], results["disaggregated_no_decode_reuse"]
    print(json.dumps({
        "bench": "pd", "mode": "summary",
        "throughput_pd_over_colocated": round(pd["output_tokens_per_s"] / colo["output_tokens_per_s"], 3),
        "ttft_p50_pd_over_colocated": round(pd["ttft_p50_s"] / colo["ttft_p50_s"], 3),
        "tpot_p50_pd_over_colocated": round(pd["tpot_p50_ms"] / colo["tpot_p50_ms"], 3),
        "kv_bytes_per_request_reuse_over_no_reuse": round(pd["kv_bytes_per_request"] / whole["kv_bytes_per_request"], 3),
        "ttft_p50_reuse_over_no_reuse": round(pd["ttft_p50_s"] / whole["ttft_p50_s"], 3),
    }))
    return 0
