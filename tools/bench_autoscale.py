"""`tandem bench autoscale`: the operator's real scaling decision driving a simulated cluster.

No Kubernetes, no GPU, no model. A seeded arrival trace (quiet, ramp, plateau, spike, plateau,
quiet) runs through a queueing model of a prefill pool and a decode pool. Every interval the
model reports what each routable server's /metrics would say (a PodSignals), the pool's load
comes from the operator's `signals.PoolTracker.load`, and `decision.decide` sets the
pool's size, as the operator's loop does. The same trace then runs on a fixed deployment sized
for the peak, for comparison.

The model: event-driven in continuous time; the trace and the router's choices come from two
random.Random seeded from `seed`, so a run is reproducible and both setups see the same trace.

    trace     Poisson arrivals, the rate piecewise linear in time (thinning); prompt and output
              lengths uniform over [min, max] tokens
    router    power of two choices (the router's default policy): of two random routable
              servers, the one with fewer requests outstanding. Routable = ready, not draining.
              A request stays where it was sent: a backlog drains at its own server's pace, also
              once new servers are ready.
    prefill   one FIFO per server, computing prompt tokens at prefill_tokens_per_second, one request
              after another (batching decides who counts as running, not the throughput). A
              server reports as running the requests started or starting within one forward
              pass (prefill_batch_tokens of work), as waiting the rest, the prompt tokens still to
              compute, and its computed prompt tokens (a counter). Its bootstrap queue stays 0:
              a request goes to decode when its prefill ends (the real legs pair up first).
    decode    per server a KV cache of decode_kv_tokens; a request reserves prompt + output tokens
              for output / decode_tokens_per_second seconds; requests that do not fit wait in FIFO
              order and are reported as the prealloc queue; KV pages are 16 tokens.
    pods      both pools start at 1 ready server (replicas and minReplicas 1); a pod is asked
              for at a decision and ready startup_seconds later (pod time from the ask). Pod
              time is clipped at the trace's end; requests still in flight then finish for the
              latency figures.
    operator  scaler.py's loop, every 15 s per pool: one PodSignals per routable server into a
              signals.PoolTracker (history, measured prefill tokens/s), the pool's load, a Sample
              with the desired size, decide(history, now, desired, starting = desired - ready,
              Policy.from_spec(PoolSpec, the spec's default PrefillAutoscaling /
              DecodeAutoscaling)). A scale-up is applied at once and takes back a draining pod.
              A scale-down takes the highest ordinal out of routing and drains it; while a drain
              runs no other scale-down applies; the pod goes at the first tick where it has no
              request left and routerSettleSeconds have passed, or at the drain timeout (its
              requests then count as dropped). Unlike the loop, a pod still starting is removed
              at once instead of drained; metrics are never stale (every routable server is read).

Figures:
    needed        servers that keep up with the spike's expected work, each at 100%: prefill
                  ceil(rate x E[prompt] / prefill tokens/s), decode ceil(rate x E[(prompt +
                  output) x output] / decode tokens/s / KV tokens per server)
    to capacity   seconds from the spike's start until the pool's routable servers >= needed
                  (None: not before the spike ended)
    TTFT          arrival to prefill done (queue + prefill); decode wait: prefill done to KV
                  reserved
    fixed         each pool sized for the spike by hand: as `needed`, with each server at 80%
                  (decode's kvUsagePerReplica, the autoscaler's survivor headroom), all ready
                  from the start
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field

from tandem.common.options import opt
from tandem.common.stats import percentile
from tandem.operator.decision import Policy, Sample, decide
from tandem.operator.signals import PodSignals, PoolLoad, PoolTracker
from tandem.operator.spec import POOLS, AutoscalingSpec, PoolSpec, PrefillAutoscaling

PAGE_SIZE = 16  # tokens per KV page, for the decode servers' page gauges
MINUTE = 60.0
FIXED_UTILIZATION = 0.8  # the fixed deployment's sizing target per server


@dataclass(frozen=True)
class SimConfig:
    """The simulated cluster and trace. `tandem bench autoscale` flags are generated from it."""

    seed: int = opt(1, "seed of the arrival trace and of the router's choices")
    peak_rate: float = opt(40.0, "requests/s during the spike; the plateau is 1/3.5 of it, the quiet periods 1/20")
    startup_seconds: float = opt(120.0, "seconds from asking for a pod to its server being ready")
    max_replicas: int = opt(16, "maxReplicas of both pools (minReplicas and starting replicas: 1)")
    prefill_tokens_per_second: float = opt(10_000.0, "prompt tokens one prefill server computes per second")
    prefill_batch_tokens: int = opt(8192, "prompt tokens in one prefill forward pass (its requests count as running)")
    decode_kv_tokens: int = opt(65_536, "KV cache of one decode server, in tokens")
    decode_tokens_per_second: float = opt(30.0, "output tokens/s of one decoding request")
    prompt_min: int = opt(256, "shortest prompt, tokens")
    prompt_max: int = opt(2048, "longest prompt, tokens")
    output_min: int = opt(32, "shortest output, tokens")
    output_max: int = opt(512, "longest output, tokens")
    prefill_queue_seconds: float | None = opt(
        None, "the prefill pool's queueSecondsPerReplica (default: unset, sized by waiting requests)")

    def check(self) -> None:
        """ValueError naming the first field out of range."""
        longest = self.prompt_max + self.output_max
        limits = [("peak_rate", self.peak_rate > 0, "> 0"),
                  ("startup_seconds", self.startup_seconds >= 0, ">= 0"),
                  ("max_replicas", self.max_replicas >= 1, ">= 1"),
                  ("prefill_tokens_per_second", self.prefill_tokens_per_second > 0, "> 0"),
                  ("prefill_batch_tokens", self.prefill_batch_tokens >= 1, ">= 1"),
                  ("decode_tokens_per_second", self.decode_tokens_per_second > 0, "> 0"),
                  ("prompt_min", 1 <= self.prompt_min <= self.prompt_max, f">= 1 and <= prompt_max {self.prompt_max}"),
                  ("output_min", 1 <= self.output_min <= self.output_max, f">= 1 and <= output_max {self.output_max}"),
                  ("decode_kv_tokens", self.decode_kv_tokens >= longest,
                   f">= prompt_max + output_max ({longest}), or the longest request never fits"),
                  ("prefill_queue_seconds", self.prefill_queue_seconds is None or self.prefill_queue_seconds > 0,
                   "> 0 or unset")]
        for name, ok, limit in limits:
            if not ok:
                raise ValueError(f"{name} = {getattr(self, name)}: must be {limit}")


@dataclass(frozen=True)
class Phase:
    """A stretch of the trace whose arrival rate goes linearly from rate_from to rate_to."""

    name: str
    start: float  # seconds
    end: float
    rate_from: float  # requests/s
    rate_to: float

    def rate(self, t: float) -> float:
        return self.rate_from + (self.rate_to - self.rate_from) * (t - self.start) / (self.end - self.start)


def trace_phases(peak_rate: float) -> tuple[Phase, ...]:
    """70 minutes: quiet 5, ramp 10, plateau 20, spike 5, plateau 5, quiet 25. The plateau is long
    enough for the pools to come most of the way down from the ramp (scale-downs drain one pod at
    a time) before the spike, so the spike finds them sized for the plateau."""
    quiet, plateau, m = peak_rate / 20, peak_rate / 3.5, MINUTE
    return (Phase("quiet", 0, 5 * m, quiet, quiet), Phase("ramp", 5 * m, 15 * m, quiet, plateau),
            Phase("plateau", 15 * m, 35 * m, plateau, plateau), Phase("spike", 35 * m, 40 * m, peak_rate, peak_rate),
            Phase("plateau", 40 * m, 45 * m, plateau, plateau), Phase("quiet", 45 * m, 70 * m, quiet, quiet))


def make_trace(config: SimConfig) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens), in arrival order."""
    rng = random.Random(config.seed)
    trace = []
    for phase in trace_phases(config.peak_rate):  # arrivals are memoryless: each phase starts afresh
        top, t = max(phase.rate_from, phase.rate_to), phase.start
        while (t := t + rng.expovariate(top)) < phase.end:
            if phase.rate_from == phase.rate_to or rng.random() < phase.rate(t) / top:
                trace.append((t, rng.randint(config.prompt_min, config.prompt_max),
                              rng.randint(config.output_min, config.output_max)))
    return trace


def needed_servers(config: SimConfig, rate: float, utilization: float = 1.0) -> dict[str, int]:
    """Servers that carry `rate` requests/s of the trace's expected request, each at `utilization`."""
    mean_prompt = (config.prompt_min + config.prompt_max) / 2
    mean_output = (config.output_min + config.output_max) / 2
    output_var = ((config.output_max - config.output_min + 1) ** 2 - 1) / 12  # discrete uniform
    kv_token_seconds = (mean_prompt * mean_output + output_var + mean_output ** 2) / config.decode_tokens_per_second
    return {"prefill": math.ceil(rate * mean_prompt / (utilization * config.prefill_tokens_per_second) - 1e-9),
            "decode": math.ceil(rate * kv_token_seconds / (utilization * config.decode_kv_tokens) - 1e-9)}


# --------------------------------------------------------------------------------------------- model


@dataclass(eq=False)
class _Server:
    """One pod. Prefill servers use queue/free_at/computed, decode servers kv_used/running/prealloc."""

    pool: str
    ordinal: int
    asked: float  # when the pod was asked for: pod time counts from here
    ready_at: float
    removed: float | None = None
    draining: bool = False
    queue: deque = field(default_factory=deque)  # prefill: (request index, start, finish), unfinished, FIFO
    free_at: float = 0.0  # prefill: when the last queued request finishes
    computed: float = 0.0  # prefill: prompt tokens computed (counter)
    kv_used: int = 0  # decode: tokens reserved by running requests
    running: set = field(default_factory=set)  # decode: request indices holding KV
    prealloc: deque = field(default_factory=deque)  # decode: request indices waiting for KV, FIFO

    @property
    def outstanding(self) -> int:
        return len(self.queue) + len(self.running) + len(self.prealloc)


@dataclass(frozen=True)
class Tick:
    """Both pools at one operator interval. ready: routable servers; desired: the pool's size."""

    time: float
    prefill_ready: int
    prefill_desired: int
    prefill_waiting: float
    prefill_load: float
    decode_ready: int
    decode_desired: int
    decode_kv_usage: float  # KV in use over the routable servers' KV
    decode_queue: float  # waiting + prealloc queue
    decode_load: float


@dataclass(frozen=True)
class ScalingEvent:
    time: float
    pool: str
    from_replicas: int
    to_replicas: int
    reason: str


@dataclass(frozen=True)
class SetupResult:
    """One setup (autoscaled or fixed) run over the trace."""

    name: str
    pod_minutes: dict[str, float]  # prefill, decode, total
    max_ready: dict[str, int]  # most routable servers per pool (the fixed size, for the fixed setup)
    latency: dict[str, float]  # ttft_p50_s, ttft_p99_s, ttft_spike_p99_s, decode_wait_p50_s, decode_wait_p99_s
    dropped: int  # requests a drain timeout cut off
    to_capacity_s: dict[str, float | None]  # per pool: spike start to routable >= needed
    ticks: tuple[Tick, ...]
    decisions: tuple[ScalingEvent, ...]


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    phases: tuple[Phase, ...]
    requests: int
    arrivals_per_minute: tuple[int, ...]
    needed: dict[str, int]  # servers the spike needs per pool (see the module docstring)
    autoscaled: SetupResult
    fixed: SetupResult

    @property
    def pod_minutes_ratio(self) -> float:
        """Autoscaled over fixed total pod-minutes."""
        return self.autoscaled.pod_minutes["total"] / self.fixed.pod_minutes["total"]


class _Cluster:
    """Both pools, the router and (unless fixed) the operator's loop over one trace."""

    def __init__(self, config: SimConfig, trace: list[tuple[float, int, int]], fixed: dict[str, int] | None):
        self.config, self.trace, self.fixed = config, trace, fixed
        self.end = trace_phases(config.peak_rate)[-1].end
        self.rng = random.Random(f"router-{config.seed}")
        self.events: list[tuple] = []
        self.seq = 0
        self.prefilled = [math.nan] * len(trace)
        self.admitted = [math.nan] * len(trace)
        self.dropped: set[int] = set()
        self.servers: list[_Server] = []  # every pod ever asked for
        self.live: dict[str, dict[int, _Server]] = {p: {} for p in POOLS}  # ordinal -> pod not yet removed
        self.desired = {p: fixed[p] if fixed else PoolSpec().replicas for p in POOLS}
        self.routable_changes: dict[str, list[tuple[float, int]]] = {p: [] for p in POOLS}
        self.routed: dict[str, list[_Server] | None] = {p: None for p in POOLS}  # cache, reset on any change
        scaling = AutoscalingSpec()
        self.interval = float(scaling.interval_seconds)
        self.scaling = {"prefill": PrefillAutoscaling(queue_seconds_per_replica=config.prefill_queue_seconds),
                        "decode": scaling.decode}
        bounds = PoolSpec(min_replicas=1, max_replicas=config.max_replicas)
        self.policy = {p: Policy.from_spec(bounds, self.scaling[p]) for p in POOLS}
        self.settle = float(scaling.router_settle_seconds)
        self.keep = {p: max(pol.scale_down_window, pol.stable_window) + pol.stable_window  # history, as scaler.py
                     for p, pol in self.policy.items()}
        self.trackers = {p: PoolTracker() for p in POOLS}
        self.draining: dict[str, tuple[_Server, float] | None] = {p: None for p in POOLS}  # pod, since
        self.ticks: list[Tick] = []
        self.decisions: list[ScalingEvent] = []
        for pool in POOLS:
            for ordinal in range(self.desired[pool]):
                self._add_pod(pool, ordinal, 0.0, ready_at=0.0)
            self._routable_changed(pool, 0.0)

    # events: (time, seq, handler, *args); seq keeps equal times in push order
    def _push(self, time: float, handler, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, self.seq, handler, args))

    def run(self) -> None:
        for i, (arrival, _, _) in enumerate(self.trace):
            self._push(arrival, self._arrive, i)
        self._push(self.interval, self._tick)
        while self.events:
            now, _, handler, args = heapq.heappop(self.events)
            handler(now, *args)

    # ----------------------------------------------------------------------------------------- pods

    def _add_pod(self, pool: str, ordinal: int, now: float, ready_at: float) -> None:
        pod = _Server(pool, ordinal, asked=now, ready_at=ready_at)
        self.servers.append(pod)
        self.live[pool][ordinal] = pod
        if ready_at > now:
            self._push(ready_at, self._ready, pod)

    def _ready(self, now: float, pod: _Server) -> None:
        if pod.removed is None:
            self._routable_changed(pod.pool, now)

    def _remove(self, pod: _Server, now: float) -> None:
        pod.removed = now
        del self.live[pod.pool][pod.ordinal]

    def _routable(self, pool: str, now: float) -> list[_Server]:
        if self.routed[pool] is None:
            self.routed[pool] = [s for s in self.live[pool].values() if s.ready_at <= now and not s.draining]
        return self.routed[pool]

    def _routable_changed(self, pool: str, now: float) -> None:
        """Every change of a pod's readiness, draining or existence comes through here."""
        self.routed[pool] = None
        self.routable_changes[pool].append((now, len(self._routable(pool, now))))

    def _resize(self, pool: str, now: float, replicas: int) -> None:
        """Ordinals [0, desired) are routed or starting; a draining pod is the one ordinal above."""
        before, self.desired[pool] = self.desired[pool], replicas
        for ordinal in range(before, replicas):  # up: take back the draining pod, else ask for one
            pod = self.live[pool].get(ordinal)
            if pod is not None:
                pod.draining, self.draining[pool] = False, None
            else:
                self._add_pod(pool, ordinal, now, now + self.config.startup_seconds)
        for ordinal in range(replicas, before):  # down (one at a time): out of routing, drained at ticks
            pod = self.live[pool][ordinal]
            if pod.ready_at > now:
                self._remove(pod, now)
            else:
                pod.draining, self.draining[pool] = True, (pod, now)
        self._routable_changed(pool, now)

    def _end_drain(self, pool: str, now: float) -> None:
        """scaler.py's rule: the pod goes once idle after the router's settle time, or at the timeout."""
        pod, since = self.draining[pool]
        idle = pod.outstanding == 0 and now - since >= self.settle
        if idle or now - since >= self.scaling[pool].drain_timeout_seconds:
            self.dropped.update(i for i, _, _ in pod.queue)
            self.dropped.update(pod.running, pod.prealloc)
            self._remove(pod, now)
            self.draining[pool] = None

    def _pick(self, pool: str, now: float) -> _Server:
        servers = self._routable(pool, now)  # never empty: ordinal 0 is ready from the start and never drained
        if len(servers) == 1:
            return servers[0]
        n, random_ = len(servers), self.rng.random
        first, second = int(random_() * n), int(random_() * (n - 1))
        a, b = servers[first], servers[second + (second >= first)]
        return b if b.outstanding < a.outstanding else a

    # ----------------------------------------------------------------------------------------- requests

    def _arrive(self, now: float, i: int) -> None:
        pod = self._pick("prefill", now)
        start = max(now, pod.free_at)
        pod.free_at = start + self.trace[i][1] / self.config.prefill_tokens_per_second
        pod.queue.append((i, start, pod.free_at))
        self._push(pod.free_at, self._prefill_done, pod, i)

    def _prefill_done(self, now: float, pod: _Server, i: int) -> None:
        if pod.removed is not None:  # cut off by a drain timeout
            return
        done, _, _ = pod.queue.popleft()
        assert done == i, "prefill queues finish in FIFO order"
        pod.computed += self.trace[i][1]
        self.prefilled[i] = now
        decode = self._pick("decode", now)
        decode.prealloc.append(i)
        self._admit(decode, now)

    def _admit(self, pod: _Server, now: float) -> None:
        while pod.prealloc:
            i = pod.prealloc[0]
            need = self.trace[i][1] + self.trace[i][2]
            if pod.kv_used + need > self.config.decode_kv_tokens:
                return
            pod.prealloc.popleft()
            pod.kv_used += need
            pod.running.add(i)
            self.admitted[i] = now
            self._push(now + self.trace[i][2] / self.config.decode_tokens_per_second, self._decode_done, pod, i)

    def _decode_done(self, now: float, pod: _Server, i: int) -> None:
        if pod.removed is not None:
            return
        pod.kv_used -= self.trace[i][1] + self.trace[i][2]
        pod.running.remove(i)
        self._admit(pod, now)

    # ----------------------------------------------------------------------------------------- operator

    def _prefill_signals(self, pod: _Server, now: float) -> PodSignals:
        rate = self.config.prefill_tokens_per_second
        horizon = now + self.config.prefill_batch_tokens / rate
        running = waiting = 0
        queued = 0.0
        for i, start, finish in pod.queue:
            running, waiting = (running + 1, waiting) if start < horizon else (running, waiting + 1)
            queued += self.trace[i][1] if start >= now else (finish - now) * rate
        return PodSignals(f"prefill-{pod.ordinal}", now, running=running, waiting=waiting,
                          queued_prompt_tokens=queued, prompt_tokens=pod.computed)

    def _decode_signals(self, pod: _Server, now: float) -> PodSignals:
        return PodSignals(f"decode-{pod.ordinal}", now, running=len(pod.running), prealloc_queue=len(pod.prealloc),
                          kv_pages_used=pod.kv_used / PAGE_SIZE,
                          kv_pages_total=self.config.decode_kv_tokens / PAGE_SIZE)

    def _tick(self, now: float) -> None:
        row = {"time": now}
        for pool in POOLS:
            pods, tracker = self._routable(pool, now), self.trackers[pool]
            read = self._prefill_signals if pool == "prefill" else self._decode_signals
            signals = [read(p, now) for p in pods]
            tracker.remember(now, [s.pod for s in signals], {s.pod: s for s in signals})
            load = tracker.load(pool, signals, self.scaling[pool])
            if pool == "prefill":
                row.update(prefill_waiting=load.values["waiting"], prefill_load=load.load)
            else:
                total = sum(s.kv_pages_total for s in signals)
                row.update(decode_kv_usage=sum(s.kv_pages_used for s in signals) / total if total else 0.0,
                           decode_queue=load.values["waiting"] + load.values["preallocQueue"], decode_load=load.load)
            if self.fixed is None:
                self._operate(pool, now, len(pods), load)
            row.update({f"{pool}_ready": len(self._routable(pool, now)), f"{pool}_desired": self.desired[pool]})
        self.ticks.append(Tick(**row))
        if now + self.interval <= self.end:
            self._push(now + self.interval, self._tick)

    def _operate(self, pool: str, now: float, ready: int, load: PoolLoad) -> None:
        """One pool's step of scaler.py's loop: decide, then scale up, drain, or start a drain."""
        current = self.desired[pool]
        history = self.trackers[pool].add(Sample(now, load.load, current, load.detail), self.keep[pool])
        decision = decide(history, now, current, current - ready, self.policy[pool])
        if decision.replicas > current or (decision.replicas < current and self.draining[pool] is None):
            self.decisions.append(ScalingEvent(now, pool, current, decision.replicas, decision.reason))
            self._resize(pool, now, decision.replicas)
        elif self.draining[pool] is not None:
            self._end_drain(pool, now)

    # ----------------------------------------------------------------------------------------- results

    def result(self, name: str, spike: Phase, needed: dict[str, int]) -> SetupResult:
        pod_minutes = {p: sum(min(s.removed if s.removed is not None else self.end, self.end) - s.asked
                              for s in self.servers if s.pool == p) / MINUTE for p in POOLS}
        pod_minutes["total"] = pod_minutes["prefill"] + pod_minutes["decode"]
        done = [i for i in range(len(self.trace)) if not math.isnan(self.prefilled[i])]
        ttft = [self.prefilled[i] - self.trace[i][0] for i in done]
        spike_ttft = [self.prefilled[i] - self.trace[i][0] for i in done if spike.start <= self.trace[i][0] < spike.end]
        wait = [self.admitted[i] - self.prefilled[i] for i in done if not math.isnan(self.admitted[i])]
        latency = {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
                   "ttft_spike_p99_s": percentile(spike_ttft, 99),
                   "decode_wait_p50_s": percentile(wait, 50), "decode_wait_p99_s": percentile(wait, 99)}
        return SetupResult(name, pod_minutes, {p: max(n for _, n in self.routable_changes[p]) for p in POOLS},
                           latency, len(self.dropped), {p: self._to_capacity(p, spike, needed[p]) for p in POOLS},
                           tuple(self.ticks), tuple(self.decisions))

    def _to_capacity(self, pool: str, spike: Phase, needed: int) -> float | None:
        at_start = [n for t, n in self.routable_changes[pool] if t <= spike.start][-1]
        if at_start >= needed:
            return 0.0
        return next((t - spike.start for t, n in self.routable_changes[pool] if spike.start < t <= spike.end
                     and n >= needed), None)


def simulate(config: SimConfig = SimConfig()) -> SimResult:
    """The trace on the autoscaled cluster and on a fixed one sized for the spike."""
    config.check()
    phases = trace_phases(config.peak_rate)
    spike = next(p for p in phases if p.name == "spike")
    trace = make_trace(config)
    needed = needed_servers(config, spike.rate_from)
    auto = _Cluster(config, trace, fixed=None)
    auto.run()
    autoscaled = auto.result("autoscaled", spike, needed)
    fixed_cluster = _Cluster(config, trace, fixed=needed_servers(config, spike.rate_from, FIXED_UTILIZATION))
    fixed_cluster.run()
    per_minute = [0] * int(phases[-1].end // MINUTE)
    for arrival, _, _ in trace:
        per_minute[int(arrival // MINUTE)] += 1
    return SimResult(config, phases, len(trace), tuple(per_minute), needed, autoscaled,
                     fixed_cluster.result("fixed", spike, needed))


# --------------------------------------------------------------------------------------------- report


def minute_rows(result: SimResult) -> list[dict]:
    """One row per minute of the trace: its arrivals/s and the autoscaled pools at the minute's end."""
    at = {round(t.time): t for t in result.autoscaled.ticks}
    rows = []
    for minute, arrivals in enumerate(result.arrivals_per_minute):
        tick = at[round((minute + 1) * MINUTE)]
        rows.append({"minute": minute, "arrivals_per_s": round(arrivals / MINUTE, 2),
                     "prefill_ready": tick.prefill_ready, "prefill_desired": tick.prefill_desired,
                     "decode_ready": tick.decode_ready, "decode_desired": tick.decode_desired,
                     "prefill_waiting": tick.prefill_waiting, "decode_kv_usage": round(tick.decode_kv_usage, 3)})
    return rows


def _setup_dict(setup: SetupResult) -> dict:
    return {"most_ready": dict(setup.max_ready), "pod_minutes": {k: round(v, 1) for k, v in setup.pod_minutes.items()},
            **{k: round(v, 3) for k, v in setup.latency.items()}, "dropped_requests": setup.dropped,
            "to_capacity_s": {p: None if v is None else round(v, 1) for p, v in setup.to_capacity_s.items()}}


def report_dict(result: SimResult, decisions: bool = False) -> dict:
    """bench, config, trace (requests, phases), needed, autoscaled and fixed (most_ready, pod_minutes,
    ttft_p50_s, ttft_p99_s, ttft_spike_p99_s, decode_wait_p50_s, decode_wait_p99_s, dropped_requests,
    to_capacity_s),
    pod_minutes_ratio, minutes (minute_rows), and with `decisions` the autoscaler's changes."""
    out = {"bench": "autoscale", "config": asdict(result.config),
           "trace": {"requests": result.requests, "phases": [asdict(p) for p in result.phases]},
           "needed": dict(result.needed), "autoscaled": _setup_dict(result.autoscaled),
           "fixed": _setup_dict(result.fixed), "pod_minutes_ratio": round(result.pod_minutes_ratio, 3),
           "minutes": minute_rows(result)}
    if decisions:
        out["decisions"] = [asdict(d) for d in result.autoscaled.decisions]
    return out


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60):2d}:{int(seconds % 60):02d}"


def _seconds(value: float | None) -> str:
    return "not during the spike" if value is None else f"{value:.0f} s"


def report_text(result: SimResult, decisions: bool = False) -> str:
    c, auto, fixed = result.config, result.autoscaled, result.fixed
    phases = ", ".join(f"{p.name} {p.rate_from:.1f}" + (f"→{p.rate_to:.1f}" if p.rate_to != p.rate_from else "")
                       + f" req/s ({p.start / MINUTE:g}-{p.end / MINUTE:g} min)" for p in result.phases)
    lines = [f"tandem bench autoscale (simulated, seed {c.seed}): {result.requests} requests",
             f"trace: {phases}",
             f"prefill: {c.prefill_tokens_per_second:g} prompt tokens/s per server, {c.prefill_batch_tokens}-token "
             f"batches; decode: {c.decode_kv_tokens} KV tokens per server, {c.decode_tokens_per_second:g} tokens/s "
             f"per request; prompts {c.prompt_min}-{c.prompt_max}, outputs {c.output_min}-{c.output_max} tokens",
             f"pods ready {c.startup_seconds:g} s after they are asked for; replicas 1..{c.max_replicas}, "
             "the spec's default autoscaling, decisions every 15 s",
             "",
             "minute  req/s  prefill ready/desired  waiting  decode ready/desired  KV usage   (at the minute's end)"]
    for r in minute_rows(result):
        lines.append(f"{r['minute']:6d}  {r['arrivals_per_s']:5.1f}  {r['prefill_ready']:>9d}/"
                     f"{r['prefill_desired']:<11d}  {r['prefill_waiting']:7g}  {r['decode_ready']:>8d}/"
                     f"{r['decode_desired']:<11d}  {r['decode_kv_usage']:8.2f}")
    size = f"fixed (prefill {fixed.max_ready['prefill']}, decode {fixed.max_ready['decode']})"
    rows = [("most ready, prefill / decode", lambda s: f"{s.max_ready['prefill']} / {s.max_ready['decode']}"),
            ("pod-minutes prefill", lambda s: f"{s.pod_minutes['prefill']:.1f}"),
            ("pod-minutes decode", lambda s: f"{s.pod_minutes['decode']:.1f}"),
            ("pod-minutes total", lambda s: f"{s.pod_minutes['total']:.1f}"),
            ("TTFT p50 / p99", lambda s: f"{s.latency['ttft_p50_s']:.2f} / {s.latency['ttft_p99_s']:.2f} s"),
            ("TTFT p99, spike arrivals", lambda s: f"{s.latency['ttft_spike_p99_s']:.2f} s"),
            ("decode wait p50 / p99",
             lambda s: f"{s.latency['decode_wait_p50_s']:.2f} / {s.latency['decode_wait_p99_s']:.2f} s"),
            ("requests cut by a drain timeout", lambda s: f"{s.dropped}"),
            ("spike to capacity, prefill", lambda s: _seconds(s.to_capacity_s["prefill"])),
            ("spike to capacity, decode", lambda s: _seconds(s.to_capacity_s["decode"]))]
    lines += ["", f"{'':28s}{'autoscaled':>22s}  {size:>34s}"]
    lines += [f"{label:28s}{show(auto):>22s}  {show(fixed):>34s}" for label, show in rows]
    lines += ["",
              f"capacity the spike needs (every server at 100%): prefill {result.needed['prefill']}, "
              f"decode {result.needed['decode']} servers",
              f"fixed: sized for the spike at {FIXED_UTILIZATION:.0%} per server, ready from the start",
              f"autoscaled / fixed pod-minutes: {result.pod_minutes_ratio:.2f}"]
    if decisions:
        lines += ["", "decisions:"]
        lines += [f"  {_clock(d.time)}  {d.pool:7s} {d.from_replicas}→{d.to_replicas}  {d.reason}"
                  for d in auto.decisions]
    return "\n".join(lines)
