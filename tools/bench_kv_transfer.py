"""`tandem bench kv-transfer`: a prefill and a decode engine in this process, KV over Mooncake TCP
on 127.0.0.1, for each pair of tensor-parallel sizes asked (`--pairs 1:1 3:1 1:3 3:3`), one pair
after the other in one run. Per pair: the prefill's KV write time per request (all of its ranks'
writes, then the arrival record) and the whole request (prefill, writes, first decode step), as
medians over `--requests` prompts of `--prompt-len` tokens; and the write time as a ratio to the
first pair's. Pairs whose head splits differ move pages packed head-major (disagg/layout.py).
"""

from __future__ import annotations

import json
import statistics
import time

from tandem.server.config import DisaggConfig, EngineConfig


def run_pair(config: EngineConfig, prefill_tp: int, decode_tp: int, prompt_len: int, requests: int) -> dict:
    from dataclasses import replace

    from tandem.server.loop.engine import Engine
    from tandem.server.scheduling.request import Bootstrap
    from tandem.server.scheduling.sampling_params import SamplingParams
    from tandem.server.loop.stats import StatsObserver
    from tandem.tools.stack import free_port

    class Writes(StatsObserver):
        def __init__(self):
            self.seconds: list[float] = []

        def on_kv_transfer(self, seconds: float) -> None:
            self.seconds.append(seconds)

    writes, port = Writes(), free_port()
    prefill = Engine(replace(config, tp_size=prefill_tp), observer=writes,
                     disagg=DisaggConfig(role="prefill", bootstrap_port=port)).start()
    decode = Engine(replace(config, tp_size=decode_tp), disagg=DisaggConfig(role="decode")).start()
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    whole = []
    try:
        for room in range(requests + 1):  # the first one warms up (handshake, first registration)
            prompt = [100 + (room * 7919 + i * 31) % 48000 for i in range(prompt_len)]
            b = Bootstrap("127.0.0.1", port, room)
            start = time.perf_counter()
            legs = prefill.submit(prompt, params, bootstrap=b), decode.submit(prompt, params, bootstrap=b)
            for leg in legs:
                out = leg.result()
                assert out.finish_reason == "length", (out.finish_reason, out.error)
            whole.append(time.perf_counter() - start)
        moved = decode.snapshot.kv_transfer_bytes
    finally:
        decode.shutdown()  # first: it takes leave of the prefill
        prefill.shutdown()
    return {"prefill_tp": prefill_tp, "decode_tp": decode_tp,
            "kv_write_s_p50": round(statistics.median(writes.seconds[1:]), 3),
            "request_s_p50": round(statistics.median(whole[1:]), 2), "kv_bytes_per_request": moved // (requests + 1)}


def run(config: EngineConfig, args) -> int:
    results = []
    for pair in args.pairs:
        prefill_tp, decode_tp = (int(x) for x in pair.split(":"))
        result = run_pair(config, prefill_tp, decode_tp, args.prompt_len, args.requests)
        result["kv_write_ratio"] = round(result["kv_write_s_p50"] / results[0]["kv_write_s_p50"], 2) if results else 1.0
        results.append(result)
        print(json.dumps(result), flush=True)
    print(json.dumps({"bench": "kv-transfer", "prompt_len": args.prompt_len, "requests": args.requests,
                      "pairs": results}))
    return 0
