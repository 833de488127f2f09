"""InferenceService status as a pure function of the spec and what the owned objects report.

Condition semantics (each keeps its lastTransitionTime while its status does not change):

    PrefillReady / DecodeReady   every desired pod of the pool is ready and runs the current template
    RouterReady                  as many router pods are ready as asked (a ready router has at least
                                 one ready prefill and one ready decode server behind it)
    Ready                        all three of the above
    Progressing                  something is still rolling out or starting
    Degraded                     the spec can never work (phase Failed) or an owned object is missing
    AutoscalerHealthy            from the autoscaler's tick (`with_autoscaler`): False while a pool's
                                 metrics are stale; Unknown while autoscaling is off or before its
                                 first sample

The autoscaler's per-pool fields (lastScaling, signals, draining) are its own: its tick returns
them typed (AutoscalerStatus), `with_autoscaler` writes them into status, and `compute_status`
carries them over from the previous status; `desiredReplicas` is the Instance's routed size.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.operator.render import Instance
from tandem.operator.schema import to_wire
from tandem.operator.spec import POOLS, Condition, Drain, PoolSignals, PoolStatus, RouterStatus, ScalingDecision

CONDITION_TYPES = ("Ready", "PrefillReady", "DecodeReady", "RouterReady", "Progressing", "Degraded",
                   "AutoscalerHealthy")


@dataclass(frozen=True)
class Observed:
    """The live StatefulSets and router Deployment (None when absent)."""

    prefill: dict | None = None
    decode: dict | None = None
    router: dict | None = None


def _rollout(obj: dict | None, desired: int) -> tuple[int, int, bool]:
    """(pods, ready pods, rolled out) of a StatefulSet or Deployment."""
    if obj is None:
        return 0, 0, False
    status = obj.get("status") or {}
    current = status.get("observedGeneration", 0) >= obj.get("metadata", {}).get("generation", 0)
    pods, ready, updated = status.get("replicas", 0), status.get("readyReplicas", 0), status.get("updatedReplicas", 0)
    # No pod of an older template is left (a surge pod may be ready while a new one is not).
    return pods, ready, current and ready >= desired and updated >= desired and pods == updated


@dataclass(frozen=True)
class AutoscaledPool:
    """The autoscaler's fields of status.<pool> (spec.PoolStatus) after a tick."""

    desired_replicas: int
    last_scaling: ScalingDecision | None = None  # this tick's change or an earlier one
    signals: PoolSignals | None = None  # None when no ready server could be read
    draining: Drain | None = None


@dataclass(frozen=True)
class AutoscalerStatus:
    """The autoscaler's part of an InferenceService's status after a tick."""

    time: str  # when the tick ran
    prefill: AutoscaledPool
    decode: AutoscaledPool
    healthy: bool  # every pool's metrics are fresh
    message: str  # per pool: the servers read, or why its metrics are stale


AUTOSCALER_FIELDS = ("lastScaling", "signals", "draining")


def _pool_status(obj: dict | None, desired: int, autoscaler: dict) -> tuple[dict, bool, str]:
    pods, ready, rolled_out = _rollout(obj, desired)
    status = to_wire(PoolStatus(desired_replicas=desired, replicas=pods, ready_replicas=ready,
                                ready=f"{ready}/{desired}"))
    # Explicit nulls: status is merge-patched, and a field the autoscaler dropped must go.
    status.update({key: autoscaler.get(key) for key in AUTOSCALER_FIELDS})
    if obj is None:
        return status, False, "StatefulSet missing"
    if desired == 0:
        return status, False, "scaled to zero replicas"
    return status, rolled_out, f"{ready}/{desired} servers ready"


class _Conditions:
    """Builds every condition tandem writes, carrying lastTransitionTime over from the previous
    status. `items` holds the conditions set or kept here, in that order."""

    def __init__(self, previous: list[dict] | None, generation: int, now: str):
        self.listed = previous or []
        self.previous = {c.get("type"): c for c in self.listed}
        self.generation, self.now = generation, now
        self.items: list[dict] = []

    def set(self, type_: str, status: bool | None, reason: str, message: str) -> None:
        value = "Unknown" if status is None else ("True" if status else "False")
        old = self.previous.get(type_, {})
        since = old.get("lastTransitionTime") if old.get("status") == value else None
        self.items.append(to_wire(Condition(type=type_, status=value, reason=reason, message=message,
                                            last_transition_time=since or self.now,
                                            observed_generation=self.generation)))

    def keep(self, type_: str) -> None:
        """Carry the previous condition of this type over unchanged."""
        self.items.append(self.previous[type_])

    def others(self) -> list[dict]:
        """The previous conditions of the types not set or kept here, in their order."""
        mine = {c["type"] for c in self.items}
        return [c for c in self.listed if c.get("type") not in mine]


def compute_status(inst: Instance, generation: int, observed: Observed, previous: dict | None, now: str) -> dict:
    """The full status of a valid InferenceService."""
    previous = previous or {}
    conds = _Conditions(previous.get("conditions", []), generation, now)
    out: dict = {"observedGeneration": generation}
    ready = {}
    scaling = inst.spec.autoscaling.enabled
    for pool in POOLS:
        kept = previous.get(pool) or {}
        autoscaler = {k: kept.get(k) for k in AUTOSCALER_FIELDS if scaling or k == "lastScaling"}
        out[pool], ready[pool], message = _pool_status(getattr(observed, pool), inst.pool_replicas(pool), autoscaler)
        conds.set(f"{pool.capitalize()}Ready", ready[pool], "ServersReady" if ready[pool] else "ServersNotReady",
                  message)
    want = inst.spec.router.replicas
    pods, router_ready, router_ok = _rollout(observed.router, want)
    out["router"] = to_wire(RouterStatus(replicas=pods, ready_replicas=router_ready, endpoint=inst.router_endpoint))
    conds.set("RouterReady", router_ok, "RouterReady" if router_ok else "RouterNotReady",
              f"{router_ready}/{want} router pods ready" + ("" if router_ok else
              " (a router turns ready once it sees a ready prefill and a ready decode server)"))
    all_ready = router_ok and all(ready.values())
    conds.set("Ready", all_ready, "AllReady" if all_ready else "NotReady",
              f"serving {inst.spec.model.name} at {inst.router_endpoint}" if all_ready else
              "waiting for " + ", ".join(k for k, v in (*ready.items(), ("router", router_ok)) if not v))
    conds.set("Progressing", not all_ready, "RollingOut" if not all_ready else "Settled",
              "pods are starting or being updated" if not all_ready else "every pod runs the current spec")
    missing = [k for k in (*POOLS, "router") if getattr(observed, k) is None]
    conds.set("Degraded", bool(missing), "ObjectsMissing" if missing else "AsExpected",
              f"missing: {', '.join(missing)} (being recreated)" if missing else "")
    health = conds.previous.get("AutoscalerHealthy")
    if scaling and health and health.get("reason") != "AutoscalingDisabled":
        conds.keep("AutoscalerHealthy")
    elif scaling:
        conds.set("AutoscalerHealthy", None, "Starting", "waiting for the first sample of the pools' metrics")
    else:
        conds.set("AutoscalerHealthy", None, "AutoscalingDisabled", "spec.autoscaling.enabled is false")
    out["conditions"] = conds.items
    any_ready = any(v["readyReplicas"] for v in (out["prefill"], out["decode"], out["router"]))
    out["phase"] = "Ready" if all_ready else ("Progressing" if any_ready or not missing else "Pending")
    return out


def invalid_status(generation: int, message: str, previous: dict | None, now: str) -> dict:
    """Status of a spec that can never work: phase Failed, Degraded with the reason. The pools
    and router keep whatever the last valid spec gave them."""
    previous = previous or {}
    conds = _Conditions(previous.get("conditions", []), generation, now)
    conds.set("Ready", False, "InvalidSpec", message)
    conds.set("Progressing", False, "InvalidSpec", "waiting for a spec that can be applied")
    conds.set("Degraded", True, "InvalidSpec", message)
    return {"observedGeneration": generation, "phase": "Failed", "conditions": conds.items + conds.others()}


def with_autoscaler(status: dict, scaled: AutoscalerStatus) -> dict:
    """`status` with an autoscaler tick written in: each pool's desiredReplicas and autoscaler
    fields, and the AutoscalerHealthy condition. The only place they are serialized."""
    out = dict(status)
    for pool in POOLS:
        wire = to_wire(getattr(scaled, pool))
        # Explicit nulls: status is merge-patched, and a field the autoscaler dropped must go.
        out[pool] = {**(status.get(pool) or {}),
                     **{key: wire.get(key) for key in ("desiredReplicas", *AUTOSCALER_FIELDS)}}
    conds = _Conditions(status.get("conditions"), status.get("observedGeneration") or 0, scaled.time)
    conds.set("AutoscalerHealthy", scaled.healthy, "MetricsFresh" if scaled.healthy else "MetricsStale",
              scaled.message)
    out["conditions"] = conds.others() + conds.items
    return out
