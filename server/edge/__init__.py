"""The serving edge: the process around the engine. The only package that imports grpc or
protobuf.

    serve.py           `tandem serve`: the engine, the gRPC server, health service, metrics endpoint;
                       on SIGTERM a drain
    grpc_servicer.py   SGLang's scheduler protocol over the Engine: generate, abort; messages <-> token
                       lists and SamplingParams (tools/client.py sends its SamplingParams through it)
    grpc_status.py     its read side: health, model and server info, loads, tokenizer, KV events,
                       FlushCache (StatusServicer, SchedulerServicer's base)
    metrics.py         every Prometheus object of the server, fed from loop/stats.py
    crashes.py         engine failures counted across container restarts (TANDEM_CRASH_LOG)
    tls.py             the gRPC port over TLS or mutual TLS (--tls-cert/--tls-key/--tls-ca), the files
                       reloaded for new handshakes when renewed
    allocator.py       the process's malloc (--allocator): tcmalloc preloaded on a CPU server, by
                       `tandem serve` re-executing itself once before torch is imported
"""
