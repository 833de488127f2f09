"""The engine loop: one thread that owns the model, the KV pool and the scheduler, and turns
requests into tokens. Other threads talk to it through the inbox only.

    engine.py            Engine: construction, start and shutdown, the API any thread calls
    engine_thread.py     EngineThread, Engine's base: building the parts, the loop, closing
    failure.py           why the engine failed, recorded once
    steps.py             one step (poll, schedule, execute, update, publish), plain or overlapped
    inbox.py             what other threads ask of the loop, as typed messages
    intake.py            validation and tokenization on the caller's thread
    runner.py            ModelRunner: a StepPlan -> tensors -> forward pass -> sampled tokens
    cuda_graphs.py       decode steps captured once per batch size, replayed
    grammar.py           structured output: xgrammar matchers and token bitmasks
    output_processor.py  detokenize, stop strings, stream or complete
    stop_strings.py      stop strings over streamed text
    outputs.py           StreamOutput, CompletedOutput: what the engine gives back
    kv_pool.py           the KV pool's size and its tensors
    stats.py             plain engine statistics, for edge/metrics.py
"""
