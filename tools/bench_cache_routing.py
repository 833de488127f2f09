"""`tandem bench cache-routing`: the `smg` router's cache-aware policy in front of two colocated
servers, told where prefixes are cached by the servers' KV events, against the same router left to
guess (the servers started with `--disable-kv-events`: smg then keeps an approximate tree of what it
sent where), and against `power_of_two` (the operator's default policy, which ignores prefixes).
One run, one stack after the other.

Workload: a few long system prompts, each shared by many users who each add a short question;
requests in a fixed-seed shuffled order at a fixed concurrency, over the router's OpenAI HTTP API.
Each server's KV pool holds only some of the system prompts, so where a request lands decides
whether its prefix is cached. Reported per arm: the prefix-cache hit rate across both servers
(prompt tokens served from cache over prompt tokens looked up, from their /metrics), TTFT and
TPOT, how the requests split between the servers, and the KV events the router applied. Results
vary much from one workload to the next (which server a burst lands on), so the run repeats over
several workload seeds, each arm first every other seed, and sums up over all of them.

`--pd`: the same workload through one prefill server and two decode servers, the prefill servers
picked `cache_aware` (the operator's default) and the decode servers `cache_aware` against
`power_of_two` (the operator's default for them). What a decode's cache is worth there is the
KV it need not be sent (decode-side prefix reuse): reported per arm are the decodes' prefix hit
rate before transfer and the KV bytes moved per request, with TTFT and TPOT.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
from pathlib import Path

from tandem.tools.bench_offline import VOCAB_RANGE
from tandem.tools.bench_serve import drive, openai_runner

# The servers, and per arm (server flags, router flags): colocated, and with --pd.
ROLES = ["colocated", "colocated"]
ARMS = {"kv_events": ((), ()), "no_kv_events": (("--disable-kv-events",), ()),
        "power_of_two": ((), ("--policy", "power_of_two"))}
PD_ROLES = ["prefill", "decode", "decode"]
PD_ARMS = {f"decode_{policy}": ((), ("--prefill-policy", "cache_aware", "--decode-policy", policy))
           for policy in ("cache_aware", "power_of_two")}


def make_workload(system_prompts: int, users: int, system_len: int, question_len: int, output_len: int,
                  seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    systems = [[rng.randint(*VOCAB_RANGE) for _ in range(system_len)] for _ in range(system_prompts)]
    work = [(system + [rng.randint(*VOCAB_RANGE) for _ in range(question_len)], output_len)
            for system in systems for _ in range(users)]
    rng.shuffle(work)
    return work


def router_count(text: str, name: str, **labels: str) -> int:
    """A counter of smg's /metrics; 0 when smg never created it (no KV events arrived)."""
    from tandem.tools.stack import metric_value

    try:
        return int(metric_value(text, name, **labels))
    except KeyError:
        return 0


def run(args, engine_args: list[str]) -> int:
    from tandem.server.model.loader import resolve_model
    from tandem.server.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(args.model))
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-bench-cache-routing-"))
    arms, roles = (PD_ARMS, PD_ROLES) if args.pd else (ARMS, ROLES)
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for i, seed in enumerate(args.workload_seeds):
        work = make_workload(args.system_prompts, args.users, args.system_len, args.question_len, args.output_len, seed)
        for arm in (list(arms) if i % 2 == 0 else list(arms)[::-1]):  # each arm first and last as often
            server_flags, router_flags = arms[arm]
            result = run_arm(logs / f"{arm}-seed{seed}", roles, (*engine_args, *server_flags), router_flags, tokenizer,
                             work, args.concurrency)
            result = {"bench": "cache-routing", "arm": arm, "workload_seed": seed, **result}
            results[arm].append(result)
            print(json.dumps(result), flush=True)
    summarize = pd_summary if args.pd else colocated_summary
    print(json.dumps(summarize(results, args.workload_seeds)))
    return 0


def arm_summary(runs: list[dict]) -> dict:
    """One arm over every seed: the hit rate of all its lookups, the medians of its latency and speed."""
    hit, query = sum(r["prefix_hit_tokens"] for r in runs), sum(r["prefix_query_tokens"] for r in runs)
    return {"prefix_hit_rate": round(hit / query, 3) if query else 0.0,
            "ttft_p50_s_median_over_seeds": statistics.median(r["ttft_p50_s"] for r in runs),
            "output_tokens_per_s_median_over_seeds": statistics.median(r["output_tokens_per_s"] for r in runs)}


def colocated_summary(results: dict[str, list[dict]], seeds: list[int]) -> dict:
    summary = {"bench": "cache-routing", "arm": "summary", "seeds": list(seeds)}
    summary.update((arm, arm_summary(runs)) for arm, runs in results.items())
    on = summary["kv_events"]
    for other in ("no_kv_events", "power_of_two"):
        off = summary[other]
        summary[f"prefix_hit_rate_kv_events_over_{other}"] = (round(on["prefix_hit_rate"] / off["prefix_hit_rate"], 3)
                                                              if off["prefix_hit_rate"] else None)
        summary[f"ttft_p50_kv_events_over_{other}"] = round(
            on["ttft_p50_s_median_over_seeds"] / off["ttft_p50_s_median_over_seeds"], 3)
    return summary


def pd_summary(results: dict[str, list[dict]], seeds: list[int]) -> dict:
    summary = {"bench": "cache-routing", "arm": "summary", "pd": True, "seeds": list(seeds)}
    for arm, runs in results.items():  # the hit rate is the decodes' (before transfer)
        summary[arm] = {**arm_summary(runs),
                        "kv_bytes_per_request": int(statistics.mean(r["kv_bytes_per_request"] for r in runs))}
    on, off = summary["decode_cache_aware"], summary["decode_power_of_two"]
    summary["kv_bytes_per_request_cache_aware_over_power_of_two"] = round(
        on["kv_bytes_per_request"] / off["kv_bytes_per_request"], 3)
    summary["ttft_p50_cache_aware_over_power_of_two"] = round(
        on["ttft_p50_s_median_over_seeds"] / off["ttft_p50_s_median_over_seeds"], 3)
    return summary


def run_arm(log_dir: Path, roles: list[str], engine_args: tuple[str, ...], router_args: tuple[str, ...], tokenizer,
            work, concurrency: int) -> dict:
    """Servers of `roles` and smg over them: the workload's latencies and the prefix caches that
    decide routing (the colocated servers', or the decodes' before transfer)."""
    from tandem.tools.stack import LocalStack, metric_value, metrics_text

    log_dir.mkdir(parents=True, exist_ok=True)
    with LocalStack(log_dir, engine_args) as stack:
        servers = stack.start_servers(roles)
        stack.wait()
        base = stack.start_router(*router_args).url
        run_one, _ = openai_runner(base.removeprefix("http://"), stack.model_name, tokenizer)
        result = drive(run_one, work, concurrency)
        texts = {s.role: [] for s in servers}
        for s in servers:
            texts[s.role].append(s.metrics_text())
        router = metrics_text(stack.routers[0].metrics_port)
    if "decode" in texts:
        counted, prefix = texts["decode"], "tandem_decode_prefix"
        sent = sum(metric_value(t, "tandem_kv_transfer_bytes_total") for t in texts["prefill"])
        extra = {"kv_bytes_per_request": int(sent / len(work))}
    else:
        counted, prefix, extra = texts["colocated"], "tandem_prefix_cache", {}
    query = [metric_value(t, f"{prefix}_query_tokens_total") for t in counted]
    hit = [metric_value(t, f"{prefix}_hit_tokens_total") for t in counted]
    return {
        **result,
        "prefix_hit_rate": round(sum(hit) / sum(query), 3) if sum(query) else 0.0,
        "prefix_hit_tokens": int(sum(hit)),
        "prefix_query_tokens": int(sum(query)),
        "prompt_tokens_per_server": [int(q) for q in query],
        **extra,
        "router_kv_event_batches_applied": router_count(router, "smg_kv_event_batches_total", disposition="applied"),
        "router_kv_index_blocks": router_count(router, "smg_kv_index_blocks"),
    }
