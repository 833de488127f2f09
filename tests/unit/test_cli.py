"""The `tandem` command line: flags generated from the config dataclasses, and what one command
passes on to another."""

from __future__ import annotations

import pytest

from tandem.cli.main import build_parser, changed_engine_flags
from tandem.common.options import from_args
from tandem.server.config import EngineConfig
from tandem.server.scheduling.sampling_params import SamplingParams


def test_engine_flags_passed_on_to_serve_parse_there_to_the_same_config():
    """`tandem demo` and `bench pd` hand their changed engine flags to `tandem serve`, booleans included."""
    demo = build_parser().parse_args(["demo", "--enable-mixed-chunk", "--page-size", "32", "--no-disable-radix-cache",
                                      "--schedule-policy", "lpm"])
    passed = changed_engine_flags(demo)
    assert "--enable-mixed-chunk" in passed and not any(p.startswith("--disable-radix-cache") for p in passed)
    serve = build_parser().parse_args(["serve", *passed])
    assert from_args(serve, EngineConfig) == from_args(demo, EngineConfig)
    assert from_args(serve, EngineConfig).enable_mixed_chunk and from_args(serve, EngineConfig).page_size == 32


def test_a_repeatable_engine_flag_is_passed_on_once_per_value():
    demo = build_parser().parse_args(["demo", "--cuda-graph-bs", "1", "--cuda-graph-bs", "8"])
    assert changed_engine_flags(demo) == ["--cuda-graph-bs=1", "--cuda-graph-bs=8"]
    serve = build_parser().parse_args(["serve", *changed_engine_flags(demo)])
    assert from_args(serve, EngineConfig).cuda_graph_bs == (1, 8)
    assert changed_engine_flags(build_parser().parse_args(["demo"])) == []


@pytest.mark.parametrize("given, value", [([], None), (["--disable-overlap-schedule"], True),
                                           (["--no-disable-overlap-schedule"], False)])
def test_an_optional_boolean_flag_stays_unset_unless_given(given, value):
    """Unset, the engine decides (overlap scheduling: by device and role); either way it is passed on."""
    demo = build_parser().parse_args(["demo", *given])
    assert from_args(demo, EngineConfig).disable_overlap_schedule is value
    serve = build_parser().parse_args(["serve", *changed_engine_flags(demo)])
    assert from_args(serve, EngineConfig).disable_overlap_schedule is value


@pytest.mark.parametrize("command", [["serve"], ["demo"], ["bench", "peers"]])
def test_help_shows_every_flags_own_text(command, capsys):
    """Help texts with a % in them (argparse formats help with %) read as written."""
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "about 1% and a new prompt" in shown and "option_strings" not in shown


def test_sampling_flags_come_from_sampling_params_greedy_by_default():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--stop", "a", "--stop", "b", "--top-k", "5",
                                      "--ignore-eos", "--stop-token-ids", "7"])
    params = from_args(args, SamplingParams, seed=None)
    assert params == SamplingParams(temperature=0.0, top_k=5, stop=("a", "b"), stop_token_ids=(7,), ignore_eos=True)
    assert from_args(build_parser().parse_args(["generate", "--prompt", "x"]), SamplingParams, seed=None) == \
        SamplingParams(temperature=0.0)


@pytest.mark.parametrize("command", [["client", "generate", "--prompt", "x"], ["chat"]])
def test_clients_have_no_seed_flag_the_wire_cannot_carry(command):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--seed", "3"])
