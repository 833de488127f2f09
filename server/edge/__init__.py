"""The serving edge: the process around the engine. The only package that imports grpc or
protobuf.

    serve.py           `tandem serve`: the gRPC server, health service, metrics endpoint, shutdown
    grpc_servicer.py   SGLang's scheduler protocol over the Engine: generate, abort
    grpc_status.py     its read side: health, info, loads, tokenizer, KV events, flushing the cache
    metrics.py         every Prometheus object of the server, fed from loop/stats.py
"""
