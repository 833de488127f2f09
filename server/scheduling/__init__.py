"""The scheduling core: which tokens of which requests run in the next forward pass. Pure Python
on ints and lists (no torch, no numpy), so every decision is unit-tested without a model.

    request.py          Request: a request's state inside the engine, and its phases
    sampling_params.py  SamplingParams: per-request sampling and stopping, and their validation
    memory.py           KVMemory: request-level operations over the kvcache/ structures
    policy.py           admission: waiting-queue order, the per-step prefill budget, new-token ratio
    scheduler.py        Scheduler: builds each step's StepPlan, retracts under memory pressure
    plan.py             StepPlan (what the runner runs) and StepResult (what comes back)
"""
