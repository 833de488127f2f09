"""Status as a pure function of the spec and the owned objects' reports."""

from __future__ import annotations

import pytest

from tandem.operator.kube import is_subset
from tandem.operator.render import Instance
from tandem.operator.spec import Drain, PoolSignals, ScalingDecision, parse_spec
from tandem.operator.status import (CONDITION_TYPES, AutoscaledPool, AutoscalerStatus, Observed, compute_status,
                                    invalid_status, with_autoscaler)

T0, T1 = "2026-11-21T10:00:00Z", "2026-11-21T10:05:00Z"


def inst(**spec) -> Instance:
    return Instance(name="svc", namespace="ns", uid="u", spec=parse_spec("svc", {"image": "i", "model": {"name": "m"},
                                                                              **spec}))


def workload(replicas: int, ready: int, updated: int | None = None, generation: int = 1, observed: int = 1) -> dict:
    return {"metadata": {"generation": generation},
            "status": {"replicas": replicas, "readyReplicas": ready, "observedGeneration": observed,
                       "updatedReplicas": ready if updated is None else updated}}


def conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_ready_when_every_pool_and_the_router_is_rolled_out():
    status = compute_status(inst(decode={"replicas": 2}), 3,
                            Observed(workload(1, 1), workload(2, 2), workload(1, 1)), None, T0)
    assert status["phase"] == "Ready" and status["observedGeneration"] == 3
    assert (status["prefill"]["ready"], status["decode"]["ready"]) == ("1/1", "2/2")
    conds = conditions(status)
    assert set(conds) == set(CONDITION_TYPES)
    assert conds["Ready"] == ("True", "AllReady") and conds["Progressing"][0] == "False"
    assert conds["Degraded"] == ("False", "AsExpected") and conds["AutoscalerHealthy"][0] == "Unknown"


@pytest.mark.parametrize("observed,waiting", [
    (Observed(workload(1, 0), workload(1, 1), workload(1, 1)), "PrefillReady"),
    (Observed(workload(1, 1), workload(1, 1, updated=0), workload(1, 1)), "DecodeReady"),  # rolling out
    (Observed(workload(1, 1), workload(1, 1), workload(1, 1, generation=2)), "RouterReady"),  # not observed yet
])
def test_one_part_not_ready_keeps_the_service_progressing(observed, waiting):
    status = compute_status(inst(), 1, observed, None, T0)
    conds = conditions(status)
    assert status["phase"] == "Progressing" and conds["Ready"][0] == "False" and conds[waiting][0] == "False"
    assert conds["Progressing"][0] == "True"
    assert [k for k in ("PrefillReady", "DecodeReady", "RouterReady") if conds[k][0] == "False"] == [waiting]


def test_missing_objects_are_degraded_and_pending():
    status = compute_status(inst(), 1, Observed(), None, T0)
    assert status["phase"] == "Pending" and conditions(status)["Degraded"] == ("True", "ObjectsMissing")


def test_transition_times_only_move_when_a_condition_changes():
    first = compute_status(inst(), 1, Observed(workload(1, 0), workload(1, 1), workload(1, 1)), None, T0)
    second = compute_status(inst(), 1, Observed(workload(1, 1), workload(1, 1), workload(1, 1)), first, T1)
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times["PrefillReady"] == T1 and times["Ready"] == T1
    assert times["DecodeReady"] == T0 and times["Degraded"] == T0


def test_invalid_spec_fails_and_keeps_the_pool_conditions():
    ready = compute_status(inst(), 1, Observed(workload(1, 1), workload(1, 1), workload(1, 1)), None, T0)
    status = invalid_status(2, "spec.decode.minReplicas: 3 is above maxReplicas 2", ready, T1)
    conds = conditions(status)
    assert status["phase"] == "Failed" and status["observedGeneration"] == 2
    assert conds["Degraded"] == ("True", "InvalidSpec") and conds["Ready"] == ("False", "InvalidSpec")
    assert conds["DecodeReady"] == ("True", "ServersReady")  # the last valid spec's pods keep serving


def test_autoscaler_fields_are_carried_over_while_autoscaling_is_on():
    scaled = inst(autoscaling={"enabled": True})
    status = compute_status(scaled, 1, Observed(), None, T0)
    assert conditions(status)["AutoscalerHealthy"] == ("Unknown", "Starting")
    assert status["prefill"]["draining"] is None  # explicit null: the merge patch removes an old drain
    last = {"time": T0, "fromReplicas": 1, "toReplicas": 2, "reason": "scale up 1→2: ..."}
    drain = {"pod": "svc-decode-1", "since": T0}
    healthy = {"type": "AutoscalerHealthy", "status": "True", "reason": "MetricsFresh", "message": "",
               "lastTransitionTime": T0, "observedGeneration": 1}
    previous = {**status, "conditions": status["conditions"][:-1] + [healthy],
                "prefill": {**status["prefill"], "lastScaling": last}, "decode": {**status["decode"], "draining": drain}}
    again = compute_status(scaled, 1, Observed(), previous, T1)
    assert again["prefill"]["lastScaling"] == last and again["decode"]["draining"] == drain
    assert conditions(again)["AutoscalerHealthy"] == ("True", "MetricsFresh")
    off = compute_status(inst(), 2, Observed(), again, T1)
    assert off["prefill"]["lastScaling"] == last and off["decode"]["draining"] is None
    assert conditions(off)["AutoscalerHealthy"] == ("Unknown", "AutoscalingDisabled")


def test_an_autoscaler_tick_is_written_in_camel_case_with_explicit_nulls():
    before = compute_status(inst(autoscaling={"enabled": True}), 4, Observed(workload(1, 1), workload(1, 1), None),
                            None, T0)
    last = ScalingDecision(time=T1, from_replicas=1, to_replicas=2, reason="prefill scale up 1→2: ...")
    scaled = AutoscalerStatus(
        T1, AutoscaledPool(2, last, PoolSignals(time=T1, load=1.5, servers=1, values={"waiting": 6.0})),
        AutoscaledPool(1, draining=Drain(pod="svc-decode-1", since=T0)), healthy=False, message="decode: metrics stale")
    after = with_autoscaler(before, scaled)
    assert after["prefill"] == {**before["prefill"], "desiredReplicas": 2, "draining": None,
                                "lastScaling": {"time": T1, "fromReplicas": 1, "toReplicas": 2,
                                                "reason": "prefill scale up 1→2: ..."},
                                "signals": {"time": T1, "load": 1.5, "servers": 1, "values": {"waiting": 6.0}}}
    assert after["decode"] == {**before["decode"], "desiredReplicas": 1, "lastScaling": None, "signals": None,
                               "draining": {"pod": "svc-decode-1", "since": T0}}
    assert [c["type"] for c in after["conditions"]] == [c["type"] for c in before["conditions"]
                                                        if c["type"] != "AutoscalerHealthy"] + ["AutoscalerHealthy"]
    assert after["conditions"][:-1] == before["conditions"][:-1]
    assert after["conditions"][-1] == {"type": "AutoscalerHealthy", "status": "False", "reason": "MetricsStale",
                                       "message": "decode: metrics stale", "lastTransitionTime": T1,
                                       "observedGeneration": 4}
    again = with_autoscaler(after, AutoscalerStatus("2026-11-21T10:06:00Z", scaled.prefill, scaled.decode,
                                                    healthy=False, message="prefill: metrics stale"))
    assert again["conditions"][-1]["lastTransitionTime"] == T1  # still False: the transition time stays


def test_drift_check_ignores_server_defaults_but_not_changed_values():
    desired = {"spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "s", "args": ["a"]}]}}}}
    live = {"spec": {"replicas": 2, "revisionHistoryLimit": 10,
                     "template": {"spec": {"containers": [{"name": "s", "args": ["a"], "terminationMessagePath": "/x"}]}}}}
    assert is_subset(desired, live)
    assert not is_subset(desired, {**live, "spec": {**live["spec"], "replicas": 3}})
    assert not is_subset(desired, {"spec": {"replicas": 2, "template": {"spec": {"containers": []}}}})
