"""The engine loop: one thread that owns the model, the KV pool and the scheduler, and turns
requests into tokens. Other threads talk to it through the inbox only.

    engine.py            Engine: construction, start and shutdown, the API any thread calls
    engine_thread.py     EngineThread, Engine's base: building the parts, the loop, closing
    failure.py           why the engine failed, recorded once; the server told before any request ends
    steps.py             one step (poll, schedule, execute, update, publish), plain or overlapped: then
                         (CUDA's and a decode's default) the forward passes, and all torch work, run on
                         a runner thread one step ahead while the loop goes on applying the inbox
    inbox.py             what other threads ask of the loop, as typed messages (Add, Abort, Call, Wake,
                         Stop)
    intake.py            on the caller's thread: tokenization, validation (constraints compiled here),
                         request ids, the bound on requests in flight; RequestStream, the caller's side
    runner.py            ModelRunner: prepare (a StepPlan -> a plain-Python copy) and run (future tokens
                         filled in -> tensors -> forward pass -> grammar bitmasks -> sampled tokens,
                         matchers advanced)
    cuda_graphs.py       decode steps captured once per batch size, replayed with padded inputs and
                         FlashInfer's plan written into the graphs' buffers
    grammar.py           structured output: constraints compiled with xgrammar (time limit, cache),
                         each request's Matcher, the batch's token bitmask
    output_processor.py  detokenize, stop strings, token timings and observer calls, stream or complete
    stop_strings.py      stop strings over streamed text
    outputs.py           StreamOutput, CompletedOutput: what the engine gives back
    kv_pool.py           the KV pool's size, and the KV layout a disaggregated peer must share
    stats.py             EngineSnapshot and StatsObserver: plain engine statistics (no prometheus), for
                         edge/metrics.py
"""
