"""`tandem bench autoscale`: the real decision function driving the simulated pools."""

import json

import pytest

from tandem.cli.main import build_parser, cmd_bench_autoscale, main
from tandem.tools import bench_autoscale as sim
from tandem.tools.bench_autoscale import POOLS, SimConfig, make_trace, minute_rows, report_dict, report_text, simulate


@pytest.fixture(scope="module")
def result():
    return simulate(SimConfig())


def phase(result, name):
    return next(p for p in result.phases if p.name == name)


def ready(tick, pool):
    return getattr(tick, f"{pool}_ready")


def test_trace_has_its_shape_and_is_reproducible(result):
    trace = make_trace(SimConfig())
    assert trace == make_trace(SimConfig()) and trace != make_trace(SimConfig(seed=2))
    assert [p.name for p in result.phases] == ["quiet", "ramp", "plateau", "spike", "plateau", "quiet"]
    assert result.phases[-1].end == 70 * 60 and len(result.arrivals_per_minute) == 70
    spike = phase(result, "spike")
    per_minute = result.arrivals_per_minute
    spike_rate = sum(per_minute[int(spike.start // 60):int(spike.end // 60)]) / (spike.end - spike.start)
    assert spike_rate == pytest.approx(SimConfig().peak_rate, rel=0.05)
    assert sum(per_minute[:5]) / 300 == pytest.approx(SimConfig().peak_rate / 20, rel=0.15)
    assert all(SimConfig().prompt_min <= p <= SimConfig().prompt_max for _, p, _ in trace)


def test_both_pools_grow_after_the_spike_starts_and_shrink_in_the_quiet_period(result):
    spike, quiet = phase(result, "spike"), result.phases[-1]
    ticks, decisions = result.autoscaled.ticks, result.autoscaled.decisions
    for pool in POOLS:
        at_start = [ready(t, pool) for t in ticks if t.time <= spike.start][-1]
        during = max(ready(t, pool) for t in ticks if spike.start < t.time <= spike.end)
        assert during > at_start and during >= result.needed[pool], pool
        assert result.autoscaled.to_capacity_s[pool] is not None
        assert any(d.pool == pool and d.to_replicas < d.from_replicas and d.time >= quiet.start for d in decisions)
        assert ready(ticks[-1], pool) == getattr(ticks[-1], f"{pool}_desired") == 1  # back at minReplicas



def test_scale_downs_drain_one_pod_at_a_time(result):
    """As scaler.py does: one step down, then nothing more until that pod has drained and the
    router's settle time has passed."""
    settle = sim.AutoscalingSpec().router_settle_seconds
    for pool in POOLS:
        downs = [d for d in result.autoscaled.decisions if d.pool == pool and d.to_replicas < d.from_replicas]
        assert downs and all(d.to_replicas == d.from_replicas - 1 and d.reason.startswith("scale down") for d in downs)
        assert all(b.time - a.time >= settle for a, b in zip(downs, downs[1:]))
    assert result.autoscaled.dropped == 0  # every drain ended before its timeout


def test_pools_scale_independently(result):
    ticks = result.autoscaled.ticks
    assert any(t.prefill_desired > t.decode_desired for t in ticks)
    assert any(t.decode_desired > t.prefill_desired for t in ticks)
    first_up = {pool: min(d.time for d in result.autoscaled.decisions if d.pool == pool) for pool in POOLS}
    assert first_up["prefill"] != first_up["decode"]


def test_autoscaled_uses_fewer_pod_minutes_than_fixed(result):
    auto, fixed = result.autoscaled, result.fixed
    # Narrowly (0.98 on the default trace): panics run both pools up to maxReplicas and they come
    # down one drain at a time, so other seeds land above the fixed deployment.
    assert auto.pod_minutes["total"] < fixed.pod_minutes["total"]
    assert result.pod_minutes_ratio == pytest.approx(auto.pod_minutes["total"] / fixed.pod_minutes["total"])
    assert fixed.max_ready == sim.needed_servers(SimConfig(), phase(result, "spike").rate_from, sim.FIXED_UTILIZATION)
    for pool in POOLS:  # fixed pods are up the whole 70 minutes
        assert fixed.pod_minutes[pool] == pytest.approx(70 * fixed.max_ready[pool])
    assert fixed.decisions == () and fixed.to_capacity_s == {"prefill": 0.0, "decode": 0.0}
    assert fixed.latency["ttft_p99_s"] < 1.0  # sized for the peak: no queue to speak of


def test_outputs_have_the_documented_keys(result):
    report = report_dict(result)
    assert set(report) == {"bench", "config", "trace", "needed", "autoscaled", "fixed", "pod_minutes_ratio", "minutes"}
    assert set(report_dict(result, decisions=True)) == set(report) | {"decisions"}
    for setup in ("autoscaled", "fixed"):
        assert set(report[setup]) == {"most_ready", "pod_minutes", "ttft_p50_s", "ttft_p99_s", "ttft_spike_p99_s",
                                      "decode_wait_p50_s", "decode_wait_p99_s", "dropped_requests", "to_capacity_s"}
        assert set(report[setup]["pod_minutes"]) == {"prefill", "decode", "total"}
    rows = minute_rows(result)
    assert len(rows) == 70 and set(rows[0]) == {"minute", "arrivals_per_s", "prefill_ready", "prefill_desired",
                                                "decode_ready", "decode_desired", "prefill_waiting", "decode_kv_usage"}
    json.dumps(report_dict(result, decisions=True))  # serializable as it is
    text = report_text(result, decisions=True)
    for label in ("minute  req/s", "pod-minutes total", "TTFT p50 / p99", "decode wait p50 / p99",
                  "spike to capacity, prefill", "spike to capacity, decode", "autoscaled / fixed pod-minutes:",
                  "decisions:"):
        assert label in text
    assert "decisions:" not in report_text(result)


def test_cli_wires_flags_into_the_config(result, monkeypatch, capsys):
    args = build_parser().parse_args(["bench", "autoscale", "--json"])
    assert args.func is cmd_bench_autoscale and args.json and not args.decisions
    seen = []
    monkeypatch.setattr(sim, "simulate", lambda config: seen.append(config) or result)
    assert main(["bench", "autoscale", "--json"]) == 0
    assert seen == [SimConfig()]
    assert json.loads(capsys.readouterr().out)["pod_minutes_ratio"] == round(result.pod_minutes_ratio, 3)
    assert main(["bench", "autoscale", "--startup-seconds", "60", "--seed", "7", "--decisions"]) == 0
    assert (seen[-1].startup_seconds, seen[-1].seed) == (60.0, 7)
    assert "decisions:" in capsys.readouterr().out


def test_bad_flags_name_the_field(capsys):
    assert main(["bench", "autoscale", "--peak-rate", "0"]) == 2
    assert "peak_rate = 0.0: must be > 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="decode_kv_tokens = 1000: must be >= prompt_max"):
        SimConfig(decode_kv_tokens=1000).check()
