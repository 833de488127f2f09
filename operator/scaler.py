"""The autoscaler's loop: every interval, per pool, read the ready servers' signals, decide, and
drain a server before its pod goes.

One `tick` per InferenceService per interval (handlers.py runs it in a kopf daemon):

    1. list the pool's pods; the routed ones are ordinals below status.<pool>.desiredReplicas
    2. read every ready routed server (and a draining one) from its /metrics or Prometheus
    3. load in replica units (signals.py) -> Sample -> decide() (decision.py)
    4. act: scale up at once; to scale down, take the highest ordinal out of the router's worker
       list (status.<pool>.draining) and lower the StatefulSet only once that server has no
       request left and the router has had time to reread its list, or the drain timeout passed
    5. return the status (desired replicas, signals, last decision, drain, health) typed, as an
       AutoscalerStatus that status.with_autoscaler writes; the changes become events and metrics

The sample history lives in memory (a restarted operator waits a full window before scaling
down again); what must survive a restart (the desired size, the drain) lives in status.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, replace
from typing import Callable

from tandem.operator import render
from tandem.operator.decision import Policy, Sample, decide
from tandem.operator.metrics import (AUTOSCALER_DECISIONS, AUTOSCALER_DESIRED, AUTOSCALER_HEALTHY, AUTOSCALER_LOAD,
                                     AUTOSCALER_REPLICAS)
from tandem.operator.schema import parse
from tandem.operator.signals import PodSignals, PoolTracker
from tandem.operator.sources import Pod, PodScraper, PrometheusSource
from tandem.operator.spec import Drain, PoolSignals, PoolStatus, ScalingDecision
from tandem.operator.status import AutoscaledPool, AutoscalerStatus

STALE_INTERVALS = 3  # a ready server not read for this many intervals makes the pool's metrics stale
UNKNOWN_FRACTION = 0.25  # ... as does more than this fraction of its ready servers unread this time


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc).timestamp()


@dataclass(frozen=True)
class Change:
    """What a tick did to a pool, for the event and the metrics."""

    pool: str
    reason: str  # event reason: ScaledUp, ScalingDown, ScaledDown
    message: str
    direction: str | None  # up|down for a replica decision, None for a finished drain


def _ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def metrics_url(pod: dict) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    ports = [p for c in pod.get("spec", {}).get("containers", []) for p in c.get("ports", []) if p.get("name") == "metrics"]
    port = ports[0]["containerPort"] if ports else render.METRICS_PORT
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/metrics"


class Scaler:
    """Ticks InferenceServices. `list_pods(instance, pool)` returns the pool's pods' bodies."""

    def __init__(self, list_pods: Callable[[render.Instance, str], list[dict]], clock: Callable[[], float]):
        self.list_pods, self.clock = list_pods, clock
        self.trackers: dict[tuple[str, str, str], PoolTracker] = {}
        self.scraper = PodScraper()

    def forget(self, namespace: str, name: str) -> None:
        for key in [k for k in self.trackers if k[:2] == (namespace, name)]:
            del self.trackers[key]

    def tick(self, inst: render.Instance, status: dict) -> tuple[AutoscalerStatus, list[Change]]:
        """One interval for both pools of `inst`, whose status is `status` (only read): the
        autoscaler's part of the new status, and the changes."""
        scaling = inst.spec.autoscaling
        source = PrometheusSource(scaling.prometheus.url) if scaling.prometheus.url else self.scraper
        now = self.clock()
        pools, changes, health = {}, [], []
        for pool in render.POOLS:
            previous = parse(PoolStatus, status.get(pool), f"status.{pool}")
            scaled, change, problem = self._pool(inst, pool, previous, source, now)
            pools[pool] = scaled
            changes += change
            health.append(problem or f"{pool}: {scaled.signals.servers if scaled.signals else 0} server(s) read")
            labels = (inst.namespace, inst.name, pool)
            AUTOSCALER_DESIRED.labels(*labels).set(scaled.desired_replicas)
            AUTOSCALER_REPLICAS.labels(*labels).set(scaled.desired_replicas + bool(scaled.draining))
            AUTOSCALER_HEALTHY.labels(*labels).set(0 if problem else 1)
            for c in change:
                if c.direction:
                    AUTOSCALER_DECISIONS.labels(*labels, c.direction).inc()
        stale = [h for h in health if "stale" in h]
        return AutoscalerStatus(iso(now), **pools, healthy=not stale, message="; ".join(stale or health)), changes

    def _pool(self, inst: render.Instance, pool: str, previous: PoolStatus, source,
              now: float) -> tuple[AutoscaledPool, list[Change], str | None]:
        """One pool's interval: its autoscaler fields after it, its changes, and why its metrics
        can't be trusted (None when they can)."""
        scaling = getattr(inst.spec.autoscaling, pool)
        interval = inst.spec.autoscaling.interval_seconds
        key = (inst.namespace, inst.name, pool)
        tracker = self.trackers.setdefault(key, PoolTracker())
        current = inst.pool_replicas(pool)
        sts = inst.pool_name(pool)
        pods = {p["metadata"]["name"]: p for p in self.list_pods(inst, pool)}
        routed = [f"{sts}-{i}" for i in range(current)]
        ready = {name: pods[name] for name in routed if name in pods and _ready(pods[name])}
        drain = previous.draining
        targets = dict(ready)
        if drain and drain.pod in pods:
            targets[drain.pod] = pods[drain.pod]
        readable = [Pod(name, url) for name, body in targets.items() if (url := metrics_url(body))]
        reads = source.read(inst.namespace, readable)
        tracker.remember(now, list(ready), reads)
        known = [s for name, s in reads.items() if s is not None and name in ready]
        # Nothing known of a pool with ready servers is always stale: they all went unread.
        problem = _staleness(pool, tracker, ready, reads, now, interval)

        settle = inst.spec.autoscaling.router_settle_seconds

        def finish_drain() -> list[Change]:
            why = _drain_finished(drain, reads.get(drain.pod), targets, scaling.drain_timeout_seconds, settle, now)
            if not why:
                return []
            return [Change(pool, "ScaledDown", f"{drain.pod} {why}; StatefulSet {sts} {current + 1}→{current} "
                           "replicas", None)]

        if not known:  # nothing to decide on; a drain still ends
            done = finish_drain() if drain else []
            return AutoscaledPool(current, previous.last_scaling, draining=None if done else drain), done, problem
        load = tracker.load(pool, known, scaling)
        AUTOSCALER_LOAD.labels(*key).set(load.load)
        signals = PoolSignals(time=iso(max(s.time for s in known)), load=round(load.load, 3), servers=len(known),
                              values=load.values)
        unchanged = AutoscaledPool(current, previous.last_scaling, signals, drain)
        policy = Policy.from_spec(inst.pool(pool), scaling)
        keep = max(policy.scale_down_window, policy.stable_window) + policy.stable_window
        history = tracker.add(Sample(now, load.load, current, load.detail), keep)
        decision = decide(history, now, current, current - len(ready), policy, problem)

        if drain:
            if decision.replicas > current:  # load is back: the draining server returns to the router
                scaled, change = _decided(unchanged, pool, decision.replicas,
                                          f"{decision.reason}; {drain.pod} stops draining", now)
                return replace(scaled, draining=None), [change], problem
            done = finish_drain()
            return replace(unchanged, draining=None if done else drain), done, problem
        if decision.replicas < current:
            pod = f"{sts}-{current - 1}"
            scaled, change = _decided(unchanged, pool, decision.replicas,
                                      f"{decision.reason}; draining {pod} (out of the router's worker list)", now,
                                      "ScalingDown")
            return replace(scaled, draining=Drain(pod=pod, since=iso(now))), [change], problem
        if decision.replicas > current:
            scaled, change = _decided(unchanged, pool, decision.replicas, decision.reason, now)
            return scaled, [change], problem
        return unchanged, [], problem


def _decided(scaled: AutoscaledPool, pool: str, after: int, reason: str, now: float,
             event: str = "ScaledUp") -> tuple[AutoscaledPool, Change]:
    """The pool resized to `after`: its fields with the new size and decision, and the change."""
    before = scaled.desired_replicas
    decision = ScalingDecision(time=iso(now), from_replicas=before, to_replicas=after, reason=f"{pool} {reason}")
    return (replace(scaled, desired_replicas=after, last_scaling=decision),
            Change(pool, event, decision.reason, "up" if after > before else "down"))


def _staleness(pool: str, tracker: PoolTracker, ready: dict, reads: dict, now: float, interval: float) -> str | None:
    """Why the pool's metrics can't be trusted for a scale-down, or None."""
    silent = sorted((now - tracker.read_at[p], p) for p in ready if now - tracker.read_at[p] >= STALE_INTERVALS * interval)
    if silent:
        age, pod = silent[-1]
        return f"{pool}: metrics stale, {pod} not read for {age:.0f} s"
    unknown = [p for p in ready if reads.get(p) is None]
    if len(unknown) > UNKNOWN_FRACTION * len(ready):
        return f"{pool}: metrics stale, {len(unknown)} of {len(ready)} ready servers unreadable"
    return None


def _drain_finished(drain: Drain, signals: PodSignals | None, targets: dict, timeout: float, settle: float,
                    now: float) -> str | None:
    """Why the draining server may go now, or None to keep waiting."""
    elapsed = now - parse_iso(drain.since)
    if drain.pod not in targets:
        return "is gone"
    if not _ready(targets[drain.pod]):
        return "was not ready (no requests routed to it)"
    if signals is not None and signals.in_flight == 0 and elapsed >= settle:
        return f"drained after {elapsed:.0f} s"
    if elapsed >= timeout:
        left = "unknown" if signals is None else f"{signals.in_flight:g}"
        return f"drain timed out after {elapsed:.0f} s ({left} requests left)"
    return None

