"""The autoscaler's decision: a pure function of a pool's load history. No Kubernetes, no I/O.

Load is counted in replica units: 1.0 is one server at its target (signals.py). Every
interval the operator appends a Sample per pool and asks `decide` for the pool's size:

    stable load    time-weighted mean load over the stable window (120 s)       -> desired = ceil(stable load)
    deadband       no change while |stable load - N| <= tolerance x N
    panic          mean load over the panic window (20 s) >= 2 x N: scale up at once, at most
                   doubling, ignoring starting pods; no scale-down until a whole stable window
                   has passed without panic
    pending guard  no (non-panic) scale-up while pods of an earlier scale-up are still starting
    scale-down     one server at a time, only when every recommendation over the scale-down
                   window (300 s prefill, 600 s decode) is below N, the history covers that whole
                   window, the metrics are fresh, and the N-1 survivors would each carry at most
                   80% of their target: peak load / (N-1) <= 0.8
    bounds         clamp to [minReplicas, maxReplicas] (above the maximum: down one at a time)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

SURVIVOR_HEADROOM = 0.8


@dataclass(frozen=True)
class Sample:
    """One interval's reading of a pool."""

    time: float  # seconds (any monotonic clock)
    load: float  # replica units, summed over the servers whose metrics were read
    replicas: int  # the pool's desired size when sampled
    detail: str = ""  # the signals behind `load`, for people: "waiting 19 over target 8"


@dataclass(frozen=True)
class Policy:
    """One pool's windows and bounds (the spec's PoolAutoscaling plus min/max replicas)."""

    min_replicas: int
    max_replicas: int
    stable_window: float = 120.0
    panic_window: float = 20.0
    panic_threshold: float = 2.0
    tolerance: float = 0.1
    scale_down_window: float = 300.0

    @classmethod
    def from_spec(cls, pool_spec, scaling) -> Policy:
        """From a PoolSpec (bounds) and its PoolAutoscaling (windows)."""
        return cls(min_replicas=pool_spec.min_replicas, max_replicas=pool_spec.max_replicas,
                   stable_window=scaling.stable_window_seconds, panic_window=scaling.panic_window_seconds,
                   panic_threshold=scaling.panic_threshold, tolerance=scaling.tolerance,
                   scale_down_window=scaling.scale_down_window_seconds)


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    panicking: bool = False
    stable_load: float = 0.0


def _mean_load(history: Sequence[Sample], end: float, window: float) -> float | None:
    """Time-weighted mean load over (end - window, end]. A reading stands for the interval that
    led up to it (a queue is what arrived since the last reading), so with 15 s samples a 20 s
    window weighs the latest reading 15 and the one before it 5."""
    total = weight = 0.0
    previous = None
    for s in history:
        if s.time > end:
            break
        span_start = previous.time if previous is not None else s.time - (window if len(history) == 1 else
                                                                           history[1].time - history[0].time)
        overlap = s.time - max(span_start, end - window)
        if overlap > 0:
            total, weight = total + s.load * overlap, weight + overlap
        previous = s
    return total / weight if weight else None


def _recommend(load: float, current: int, tolerance: float) -> int:
    """ceil(load), unless load is within the deadband around the current size."""
    if current > 0 and abs(load - current) <= tolerance * current:
        return current
    return math.ceil(load - 1e-9)


def _panic_at(history: Sequence[Sample], sample: Sample, policy: Policy) -> bool:
    load = _mean_load(history, sample.time, policy.panic_window) or 0.0
    return load > 0 and load >= policy.panic_threshold * max(sample.replicas, 0.5)


def decide(history: Sequence[Sample], now: float, current: int, starting: int, policy: Policy,
           stale: str | None = None) -> Decision:
    """The pool's size for the next interval, with the reason in words.

    history: the pool's samples, oldest first (the latest one taken at `now`)
    current: the pool's desired size now; starting: its pods that exist or are asked for but are
             not ready yet; stale: why the metrics can't be trusted (freezes scale-down), or None
    """
    lo, hi = policy.min_replicas, policy.max_replicas

    def clamp(n: int) -> int:
        return max(lo, min(hi, n))

    if current < lo:
        return Decision(lo, f"scale up {current}→{lo}: below minReplicas {lo}")
    if current > hi:
        return Decision(current - 1, f"scale down {current}→{current - 1}: above maxReplicas {hi}")
    if not history:
        return Decision(current, f"holding {current}: no metrics yet")
    latest = history[-1]
    detail = f" ({latest.detail})" if latest.detail else ""
    stable = _mean_load(history, now, policy.stable_window)
    if stable is None:
        return Decision(current, f"holding {current}: no sample in the last {policy.stable_window:g} s")
    panic_load = _mean_load(history, now, policy.panic_window) or 0.0
    recent = [s for s in history if now - policy.stable_window < s.time <= now]
    panicking = any(_panic_at(history, s, policy) for s in recent)
    want = clamp(_recommend(stable, current, policy.tolerance))

    if panicking:
        burst = clamp(max(want, math.ceil(panic_load - 1e-9), current))
        target = min(burst, max(2 * current, 1))
        if target > current:
            return Decision(target, f"scale up {current}→{target}: panic, load {panic_load:.2f} over the last "
                            f"{policy.panic_window:g} s is ≥ {policy.panic_threshold:g}× {current}{detail}",
                            True, stable)
        return Decision(current, f"holding {current}: panic mode (load {panic_load:.2f}), no scale-down until "
                        f"{policy.stable_window:g} s pass without panic{detail}", True, stable)

    if want > current:
        if starting > 0:
            return Decision(current, f"holding {current}: load {stable:.2f} wants {want}, waiting for {starting} "
                            f"starting server(s){detail}", False, stable)
        return Decision(want, f"scale up {current}→{want}: load {stable:.2f} over the last "
                        f"{policy.stable_window:g} s{detail}", False, stable)
    if want == current:
        return Decision(current, f"holding {current}: load {stable:.2f}{detail}", False, stable)

    # Scale-down candidates: every step below needs to agree.
    if stale:
        return Decision(current, f"holding {current}: scale-down frozen, {stale}", False, stable)
    if history[0].time > now - policy.scale_down_window:
        return Decision(current, f"holding {current}: load {stable:.2f} wants {want}, but the history covers "
                        f"{now - history[0].time:.0f} of the {policy.scale_down_window:g} s scale-down window",
                        False, stable)
    window = [s for s in history if now - policy.scale_down_window <= s.time <= now]
    stable_loads = [_mean_load(history, s.time, policy.stable_window) or 0.0 for s in window]
    highest = max(clamp(_recommend(load, current, policy.tolerance)) for load in stable_loads)
    if highest >= current:
        return Decision(current, f"holding {current}: load {stable:.2f}, but it wanted {highest} within the last "
                        f"{policy.scale_down_window:g} s", False, stable)
    peak, survivors = max(stable_loads), current - 1
    if peak > SURVIVOR_HEADROOM * survivors:
        return Decision(current, f"holding {current}: {survivors} server(s) would carry peak load {peak:.2f} of the "
                        f"last {policy.scale_down_window:g} s, above {SURVIVOR_HEADROOM:.0%} of their target",
                        False, stable)
    return Decision(survivors, f"scale down {current}→{survivors}: peak load {peak:.2f} over the last "
                    f"{policy.scale_down_window:g} s fits {survivors} server(s) under {SURVIVOR_HEADROOM:.0%}"
                    f"{detail}", False, stable)
