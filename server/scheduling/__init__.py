"""The scheduling core: which tokens of which requests run in the next forward pass. Pure Python
on ints and lists (no torch, no numpy), so every decision is unit-tested without a model.

    request.py          Request: a request's state inside the engine, and its phases
    sampling_params.py  SamplingParams: per-request sampling and stopping, and their validation
    memory.py           KVMemory: request-level operations over the kvcache/ structures
    policy.py           admission: waiting-queue order (fcfs, lpm), prompt tokens per pass (per
                        device), PrefillBudget, the adaptive new-token ratio
    queues.py           RequestQueues, the Scheduler's base: waiting, chunked, running, handed off;
                        every change of a request's status (add, admit, retract, finish, abort)
    scheduler.py        Scheduler: schedule() -> StepPlan, update(plan, output); retracts under memory
                        pressure
    plan.py             StepPlan and SeqPlan (what the runner runs), StepOutput (what comes back)
"""
