"""The serving engine, one package per subsystem. Lower packages never import higher ones
(pyproject.toml's import contracts, checked by tests/unit/test_layers.py):

    edge/         the serving edge: `tandem serve`, the gRPC servicer, Prometheus metrics
    loop/         the engine loop: Engine, its inbox and intake, the runner, output processing
    disagg/       prefill/decode disaggregation: the KV connectors a role plugs into the loop
    parallel/     tensor parallelism: the ranks of one server and their collectives
    model/        loading a model: weights, the torch module, the tokenizer
    scheduling/   the scheduling core: requests, the scheduler, its policy and KV memory (no torch)
    kvcache/      KV-cache bookkeeping: page ids, request slots, the prefix cache, KV events (no torch)

    config.py     the server's configuration (frozen dataclasses, every default)
    env.py        every environment variable tandem reads
    cgroup.py     what this process may use of the machine (memory, CPUs)

Only edge/ speaks gRPC or protobuf; scheduling/ and kvcache/ work on ints and lists.
"""
