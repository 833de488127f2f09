"""The serving edge: the process around the engine. The only package that imports grpc or
protobuf.

    serve.py           `tandem serve`: the gRPC server, health service, metrics endpoint, shutdown
    grpc_servicer.py   SGLang's scheduler protocol over the Engine (generate, abort, KV events)
    metrics.py         every Prometheus object of the server, fed from loop/stats.py
"""
