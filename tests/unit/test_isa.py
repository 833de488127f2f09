"""tandem.kernels.isa: a listed CPU feature is trusted only once one of its instructions ran, in a
forked child; a feature whose instruction kills the child is left out of runnable_flags() and the
log says so."""

from __future__ import annotations

import pytest

from tandem.common.cpu import cpu_flags
from tandem.kernels import isa
from tandem.kernels.cpu_ops import cpu_ops_unavailable


def test_a_probe_that_faults_names_the_signal_and_the_parent_lives_on():
    assert cpu_ops_unavailable() is None
    assert isa.probe("trap") == "SIGILL"
    assert isa.probe("no-such-feature") == "exit status 1"  # the child raised; nothing ran


@pytest.mark.parametrize("feature", isa.PROBED)
def test_a_listed_feature_is_probed_and_an_unlisted_one_is_not(feature):
    features = isa.cpu_features()
    if feature in cpu_flags():
        assert (feature in features.runnable) == (isa.probe(feature) is None)
        assert feature in features.describe()
    else:
        assert feature not in features.runnable and feature not in features.faults


def test_a_listed_feature_that_faults_is_left_out(monkeypatch):
    monkeypatch.setattr(isa, "cpu_flags", lambda: ["avx2", "fma", "avx512_bf16", "amx_bf16", "amx_tile"])
    monkeypatch.setattr(isa, "probe", lambda feature: "SIGSEGV" if feature == "amx_bf16" else None)
    isa.cpu_features.cache_clear()
    try:
        features = isa.cpu_features()
        assert features.runnable == ["avx2", "fma", "avx512_bf16", "amx_tile"]
        assert features.describe() == "probed: avx512_bf16 runs; amx_bf16 listed but faults (SIGSEGV), so unused"
    finally:
        isa.cpu_features.cache_clear()


def test_without_the_kernels_the_list_is_trusted_and_the_log_says_so(monkeypatch):
    monkeypatch.setattr(isa, "cpu_flags", lambda: ["avx2", "avx512_bf16"])
    monkeypatch.setattr(isa, "cpu_ops_unavailable", lambda: "TANDEM_CPU_KERNELS=0")
    isa.cpu_features.cache_clear()
    try:
        features = isa.cpu_features()
        assert features.runnable == ["avx2", "avx512_bf16"]
        assert features.describe() == ("avx512_bf16 listed, not probed "
                                       "(tandem's CPU kernels cannot run: TANDEM_CPU_KERNELS=0)")
    finally:
        isa.cpu_features.cache_clear()
