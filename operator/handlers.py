"""kopf handlers: thin glue between InferenceService events and the pure renderers.

Every handler is synchronous (kopf runs it in a worker thread) and idempotent. Ownership:
the operator owns exactly the objects `render.render_all` names for an InferenceService, finds
them by their controller owner reference (uid), and is the only writer of their rendered fields
and of the InferenceService's status.
"""

from __future__ import annotations

import datetime
import secrets
import threading
import time
from collections import defaultdict
from typing import NoReturn

import kopf

from tandem.operator import render
from tandem.operator.kube import PLURALS, ApiException, Kube, up_to_date
from tandem.operator.metrics import DRIFT_CORRECTIONS, RECONCILE_SECONDS, RECONCILES
from tandem.operator.scaler import Scaler
from tandem.operator.schema import SpecError
from tandem.operator.spec import GROUP, KIND, PLURAL, VERSION, parse_spec
from tandem.operator.status import Observed, compute_status, invalid_status, with_autoscaler

MONITOR_API = "monitoring.coreos.com/v1"
CHILD_KINDS = [(v, k) for (v, k) in PLURALS if v != MONITOR_API]
MANAGED = {"app.kubernetes.io/managed-by": render.MANAGED_BY}

# Operator-wide settings; `tandem operator` replaces them before kopf starts.
DEFAULTS = render.Defaults()

# One writer per InferenceService at a time: kopf runs the reconcile and owned-object handlers in
# parallel threads, and a status computed from a stale read must never overwrite a newer one.
_LOCKS: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)


def configure(defaults: render.Defaults) -> None:
    global DEFAULTS
    DEFAULTS = defaults


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _instance(owner: dict) -> render.Instance:
    """Typed instance of an InferenceService body; SpecError when its spec can never work. With
    autoscaling on, each pool's size and drain are the autoscaler's, kept in status."""
    meta = owner["metadata"]
    spec = parse_spec(meta["name"], dict(owner.get("spec") or {}))
    replicas, draining = {}, set()
    if spec.autoscaling.enabled:
        status = owner.get("status") or {}
        for pool in render.POOLS:
            bounds = getattr(spec, pool)
            pool_status = status.get(pool) or {}
            desired = pool_status.get("desiredReplicas", bounds.replicas) if status.get("observedGeneration") else bounds.replicas
            replicas[pool] = max(bounds.min_replicas, min(bounds.max_replicas, desired))
            if pool_status.get("draining"):
                draining.add(pool)
    return render.Instance(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"], spec=spec,
                           defaults=DEFAULTS, replicas=replicas, draining=frozenset(draining))


def _owned(kube: Kube, inst_ns: str, uid: str, api_version: str, kind: str) -> list[dict]:
    items = kube.list(api_version, kind, inst_ns, ",".join(f"{k}={v}" for k, v in MANAGED.items()))
    return [o for o in items if any(r.get("uid") == uid and r.get("controller")
                                    for r in o.get("metadata", {}).get("ownerReferences", []))]


def _monitor_kinds(kube: Kube) -> list[tuple[str, str]]:
    served = kube.served_kinds(MONITOR_API)
    return [(MONITOR_API, kind) for kind in ("ServiceMonitor", "PodMonitor") if kind in served]


def _observe(kube: Kube, inst: render.Instance) -> Observed:
    return Observed(
        prefill=kube.get("apps/v1", "StatefulSet", inst.namespace, inst.pool_name("prefill")),
        decode=kube.get("apps/v1", "StatefulSet", inst.namespace, inst.pool_name("decode")),
        router=kube.get("apps/v1", "Deployment", inst.namespace, inst.router_name),
    )


def refresh_status(kube: Kube, owner: dict, inst: render.Instance, generation: int) -> dict:
    """Status from the owned objects. `generation` is the spec generation they were rendered
    from: the InferenceService's own after a reconcile, the last reconciled one otherwise."""
    status = compute_status(inst, generation, _observe(kube, inst), owner.get("status"), _now())
    kube.patch_status(GROUP, VERSION, PLURAL, inst.namespace, inst.name, status)
    return status


# --------------------------------------------------------------------------------------------- reconcile


def _fail(kube: Kube, owner: dict, message: str) -> NoReturn:
    """A spec that can never work: phase Failed, Degraded with `message`, a Warning event, and no
    retries until the spec changes."""
    RECONCILES.labels(result="invalid").inc()
    meta = owner["metadata"]
    status = invalid_status(meta.get("generation", 0), message, owner.get("status"), _now())
    kube.patch_status(GROUP, VERSION, PLURAL, meta["namespace"], meta["name"], status)
    kopf.warn(owner, reason="InvalidSpec", message=message)
    raise kopf.PermanentError(message) from None


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(body, **_) -> None:
    """Render everything from the spec and apply it; prune what the spec no longer asks for."""
    meta = body["metadata"]
    with _LOCKS[meta["namespace"], meta["name"]]:
        kube = Kube()
        # Act on the object as it is now (its generation and status included), not on the
        # event's copy: another handler may have written status since the event was sent.
        owner = kube.get_custom(GROUP, VERSION, PLURAL, meta["namespace"], meta["name"])
        if owner is not None:
            _reconcile(kube, owner)


def _ensure_bootstrap_secret(kube: Kube, owner: dict, inst: render.Instance) -> None:
    """Create the pools' bootstrap-token Secret with a fresh random token if it is missing; never
    write it otherwise (see `render.render_bootstrap_secret`). Its owner reference lets the garbage
    collector remove it with the InferenceService."""
    if not kube.exists("v1", "Secret", inst.namespace, inst.bootstrap_secret):
        if kube.create(render.render_bootstrap_secret(inst, secrets.token_urlsafe(32))):
            kopf.info(owner, reason="Created", message=f"Secret/{inst.bootstrap_secret}: the pools' bootstrap token")


def _reconcile(kube: Kube, owner: dict) -> None:
    started = time.monotonic()
    try:
        inst = _instance(owner)
    except SpecError as e:
        _fail(kube, owner, f"{e}. Fix the spec; nothing was applied.")

    _ensure_bootstrap_secret(kube, owner, inst)
    monitor_kinds = _monitor_kinds(kube)
    wants_monitor = inst.spec.monitoring.service_monitor or inst.spec.monitoring.pod_monitor
    objects = render.render_all(inst, monitoring_available=bool(monitor_kinds))
    if wants_monitor and not monitor_kinds:
        kopf.warn(owner, reason="MonitoringUnavailable",
                  message="spec.monitoring asks for a monitor but the cluster serves no monitoring.coreos.com/v1 "
                          "ServiceMonitor/PodMonitor (install the Prometheus Operator CRDs)")
    results = []
    for obj in objects:
        try:
            results.append(kube.apply(obj))
        except ApiException as e:
            if e.status not in (400, 422):
                raise  # conflicts, throttling, RBAC, outages: kopf retries with backoff
            # The API server refuses what the spec renders (e.g. a malformed affinity): retrying
            # the same spec cannot help.
            _fail(kube, owner, f"the API server rejected {obj['kind']}/{obj['metadata']['name']}: {e.reason}: "
                               f"{(e.body or '')[:500]}")
    wanted = {(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in objects}
    for api_version, kind in CHILD_KINDS + monitor_kinds:
        for live in _owned(kube, inst.namespace, inst.uid, api_version, kind):
            if (api_version, kind, live["metadata"]["name"]) not in wanted:
                kube.delete(api_version, kind, inst.namespace, live["metadata"]["name"])
    refresh_status(kube, owner, inst, owner["metadata"].get("generation", 0))
    RECONCILES.labels(result="applied").inc()
    RECONCILE_SECONDS.observe(time.monotonic() - started)
    changed = [f"{o['kind']}/{o['metadata']['name']} {r}" for o, r in zip(objects, results) if r != "unchanged"]
    if changed:
        kopf.info(owner, reason="Applied", message="; ".join(changed))
    if "terminating" in results:
        raise kopf.TemporaryError("an owned object is still being deleted; applying again", delay=5)


# --------------------------------------------------------------------------------------------- owned objects


def _owner_of(kube: Kube, body) -> dict | None:
    """The live InferenceService controlling `body`, unless it is gone or being deleted."""
    for ref in body.get("metadata", {}).get("ownerReferences", []):
        if ref.get("kind") == KIND and ref.get("controller") and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
            owner = kube.get_custom(GROUP, VERSION, PLURAL, body["metadata"]["namespace"], ref["name"])
            if owner and owner["metadata"].get("uid") == ref.get("uid") and not owner["metadata"].get("deletionTimestamp"):
                return owner
    return None


def on_owned_event(type, body, **_) -> None:
    """A change to an owned object: undo deletions and edits of rendered fields, keep status fresh."""
    owner_refs = [r for r in body.get("metadata", {}).get("ownerReferences", []) if r.get("kind") == KIND]
    if not owner_refs:
        return
    with _LOCKS[body["metadata"]["namespace"], owner_refs[0]["name"]]:
        _on_owned_event(type, body)


def _on_owned_event(type, body) -> None:
    kube = Kube()
    owner = _owner_of(kube, body)
    if owner is None:
        return
    status = owner.get("status") or {}
    reconciled = status.get("observedGeneration", 0)
    if reconciled != owner["metadata"].get("generation"):
        return  # a newer spec is waiting for its reconcile, which applies it and writes status
    if status.get("phase") == "Failed":
        return  # this spec failed: keep its Failed status and don't re-apply what was refused
    try:
        inst = _instance(owner)
    except SpecError:
        return  # the InferenceService's own handler reports it; keep the last good objects
    meta = body["metadata"]
    key = (body.get("apiVersion"), body.get("kind"), meta["name"])
    desired = next((o for o in render.render_all(inst) if (o["apiVersion"], o["kind"], o["metadata"]["name"]) == key), None)
    if desired is not None and (type == "DELETED" or not up_to_date(desired, body)):
        result = kube.apply(desired)
        if result in ("created", "patched"):
            DRIFT_CORRECTIONS.labels(kind=body["kind"]).inc()
            what = "deleted" if type == "DELETED" else "edited"
            kopf.info(owner, reason="DriftCorrected", message=f"{body['kind']}/{meta['name']} was {what}; {result} it")
    if body.get("kind") in ("StatefulSet", "Deployment"):
        refresh_status(kube, owner, inst, reconciled)


for _api_version, _kind in CHILD_KINDS:
    kopf.on.event(_api_version, PLURALS[_api_version, _kind], labels=MANAGED,
                  id=f"owned-{PLURALS[_api_version, _kind]}")(on_owned_event)


# --------------------------------------------------------------------------------------------- autoscaler


def _list_pods(inst: render.Instance, pool: str) -> list[dict]:
    selector = render.selector_labels(inst, pool)
    return Kube().list_pods(inst.namespace, ",".join(f"{k}={v}" for k, v in selector.items()))


AUTOSCALER = Scaler(_list_pods, time.time)


def _autoscaling_on(spec, **_) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


@kopf.daemon(GROUP, VERSION, PLURAL, id="autoscaler", when=_autoscaling_on, cancellation_timeout=30)
def autoscale(stopped, meta, **_) -> None:
    """Every spec.autoscaling.intervalSeconds: sample both pools, decide, apply the new sizes.
    kopf stops this when autoscaling is turned off or the InferenceService goes."""
    namespace, name = meta["namespace"], meta["name"]
    try:
        while not stopped:
            interval = autoscale_once(namespace, name)
            stopped.wait(interval)
    finally:
        AUTOSCALER.forget(namespace, name)


def autoscale_once(namespace: str, name: str) -> float:
    """One autoscaler tick for one InferenceService; returns the seconds until the next."""
    with _LOCKS[namespace, name]:
        kube = Kube()
        owner = kube.get_custom(GROUP, VERSION, PLURAL, namespace, name)
        status = (owner or {}).get("status") or {}
        if owner is None or status.get("phase") == "Failed" or not status.get("observedGeneration"):
            return 5.0  # gone, failed or not reconciled yet: nothing to scale
        if status.get("observedGeneration") != owner["metadata"].get("generation"):
            return 1.0  # a newer spec is waiting for its reconcile
        try:
            inst = _instance(owner)
        except SpecError:
            return 5.0
        if not inst.spec.autoscaling.enabled:
            return 5.0
        try:
            scaled, changes = AUTOSCALER.tick(inst, status)
        except SpecError as e:  # a status edited into a shape the operator never writes
            kopf.warn(owner, reason="AutoscalerStatusInvalid", message=f"not autoscaling: {e}")
            return 5.0
        owner["status"] = status = with_autoscaler(status, scaled)
        for change in changes:
            kopf.info(owner, reason=change.reason, message=change.message)
        if changes:
            _reconcile(kube, owner)  # new sizes: the worker list and the StatefulSets
        else:
            refresh_status(kube, owner, inst, status["observedGeneration"])
        return float(inst.spec.autoscaling.interval_seconds)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def cleanup(body, **_) -> None:
    """Delete every owned object. A real cluster's garbage collector would too (owner
    references); doing it here makes deletion complete even where no collector runs."""
    kube = Kube()
    meta = body["metadata"]
    for api_version, kind in CHILD_KINDS + _monitor_kinds(kube):
        for live in _owned(kube, meta["namespace"], meta["uid"], api_version, kind):
            kube.delete(api_version, kind, meta["namespace"], live["metadata"]["name"])
    kube.delete("v1", "Secret", meta["namespace"], f"{meta['name']}-bootstrap-token")  # render.Instance.bootstrap_secret


@kopf.on.startup()
def _settings(settings: kopf.OperatorSettings, **_) -> None:
    configure_settings(settings)


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """Handler progress in annotations (status belongs to the CRD's schema); owned kinds are
    watched through a label selector, not every object of the kind in the cluster."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="tandem.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="tandem.dev",
                                                                          key="last-handled-configuration")
    settings.persistence.finalizer = "tandem.dev/cleanup"
    selector = ",".join(f"{k}={v}" for k, v in MANAGED.items())
    for api_version, kind in CHILD_KINDS:
        group = api_version.rpartition("/")[0]
        settings.watching.label_selectors[group, PLURALS[api_version, kind]] = selector
