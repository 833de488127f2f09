"""SamplingParams validation and the sampling kernel on small logits (CPU torch, no model)."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.kernels.sampling import SamplingRow, apply_penalties, apply_token_bitmask, sample
from tandem.server.scheduling.sampling_params import Constraint, InvalidRequestError, SamplingParams

VOCAB = 32


def row(seed: int = 0, history: list[int] | None = None, prompt_len: int = 0, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, history, prompt_len)


def draw(logits: list[float], n: int, **overrides) -> list[int]:
    """One seeded draw per seed 0..n-1 from the same logits row."""
    batch = torch.tensor([logits]).expand(n, -1).clone()
    ids, _, _ = sample(batch, [row(seed=s, **overrides) for s in range(n)])
    return ids


def logits_for(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


# -- validation ------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1), ("temperature", NAN), ("temperature", INF),
        ("top_p", 0.0), ("top_p", 1.01), ("top_p", NAN),
        ("top_k", -2), ("top_k", NAN), ("top_k", 2.5),
        ("min_p", -0.01), ("min_p", 1.5), ("min_p", INF),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", NAN),
        ("frequency_penalty", 2.01), ("frequency_penalty", -2.01), ("frequency_penalty", -INF),
        ("presence_penalty", 2.5), ("presence_penalty", -2.5), ("presence_penalty", NAN),
        ("stop_token_ids", (VOCAB,)), ("stop_token_ids", (-1,)), ("stop_token_ids", (1, 3.0)),
        ("max_new_tokens", 0), ("max_new_tokens", -5), ("max_new_tokens", INF), ("max_new_tokens", NAN),
        ("seed", -1),
        ("stop", ("",)),
        ("top_logprobs", 21),
    ],
)
def test_validate_names_the_bad_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value}).validate(VOCAB)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"temperature": 0.0, "top_k": 1},
        {"top_k": 0, "top_p": 1.0, "min_p": 1.0},
        {"min_p": 0.0, "repetition_penalty": 0.01},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0},
        {"stop_token_ids": (0, VOCAB - 1), "max_new_tokens": 1},
        {"max_new_tokens": None},
        {"seed": 0, "top_logprobs": 20, "stop": ("\n",)},
    ],
)
def test_validate_accepts_limits(params):
    SamplingParams(**params).validate(VOCAB)  # raises on failure


# -- greedy ----------------------------------------------------------------------------------------
def test_greedy_is_argmax():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    ids, _, _ = sample(logits, [row(temperature=0.0, seed=s) for s in range(6)])
    assert ids == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_even_when_hot():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(2))
    ids, _, _ = sample(logits, [row(temperature=50.0, top_k=1, seed=s) for s in range(5)])
    assert ids == logits.argmax(-1).tolist()


# -- seeds -----------------------------------------------------------------------------------------
def test_same_seed_same_token_regardless_of_batch():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    rows = [row(temperature=1.5, seed=100 + i) for i in range(4)]
    batched, _, _ = sample(logits, rows)
    again, _, _ = sample(logits.clone(), rows)
    alone = [sample(logits[i : i + 1], [rows[i]])[0][0] for i in range(4)]
    mixed_in, _, _ = sample(torch.cat([logits[:1], logits]), [row(temperature=0.0)] + rows)
    assert batched == again == alone == mixed_in[1:]


def test_different_seeds_give_different_tokens():
    ids = draw([0.0] * VOCAB, 64)
    assert len(set(ids)) > 16, "64 seeded draws from a uniform row should spread out"


# -- filters ---------------------------------------------------------------------------------------
def test_top_k_never_leaves_the_top_k():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4))
    top3 = set(logits.topk(3).indices.tolist())
    ids = draw(logits.tolist(), 300, top_k=3, temperature=2.0)
    assert set(ids) == top3


@pytest.mark.parametrize("top_p, allowed", [(0.3, {0}), (0.5, {0, 1}), (0.75, {0, 1, 2})])
def test_top_p_keeps_the_head(top_p, allowed):
    ids = draw(logits_for([0.4, 0.3, 0.2, 0.1]), 300, top_p=top_p)
    assert set(ids) == allowed


def test_min_p_drops_unlikely_tokens():
    ids = draw(logits_for([0.5, 0.3, 0.15, 0.05]), 300, min_p=0.2)  # threshold 0.1
    assert set(ids) == {0, 1, 2}
    unfiltered = draw(logits_for([0.5, 0.3, 0.15, 0.05]), 300)
    assert 3 in unfiltered, "without min_p the tail token does get drawn"


def test_draws_follow_softmax_with_temperature():
    logits = [1.0, 0.5, 0.0, -0.5, -1.0, 0.2]
    n, temperature = 4000, 0.8
    ids = draw(logits, n, temperature=temperature)
    expected = torch.softmax(torch.tensor(logits) / temperature, -1) * n
    observed = torch.bincount(torch.tensor(ids), minlength=len(logits)).float()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, f"chi-square {chi2:.1f} over 5 degrees of freedom: draws do not follow the softmax"
    # and the temperature matters: the same draws are far from softmax(logits) at T=1
    flat = torch.softmax(torch.tensor(logits), -1) * n
    assert float(((observed - flat) ** 2 / flat).sum()) > 25.0


# -- penalties -------------------------------------------------------------------------------------
def softmax_of(logits: torch.Tensor, token: int) -> float:
    return float(torch.softmax(logits, -1)[token])


@pytest.mark.parametrize("raw", [[2.0, 1.5, 0.0, -1.0], [-1.0, -1.5, -3.0, -4.0]])
def test_repetition_penalty_lowers_repeated_tokens(raw):
    logits = torch.tensor([raw])
    penalized = logits.clone()
    apply_penalties(penalized, [row(repetition_penalty=2.0, history=[0, 3], prompt_len=1)])
    expected_0 = raw[0] / 2.0 if raw[0] > 0 else raw[0] * 2.0
    assert float(penalized[0, 0]) == pytest.approx(expected_0)
    assert softmax_of(penalized[0], 0) < softmax_of(logits[0], 0)
    assert penalized[0, 1:3].tolist() == logits[0, 1:3].tolist(), "unseen tokens are untouched"
    # greedy sampling follows the penalty: token 1 now wins; the caller's logits stay as they were
    ids, _, _ = sample(logits, [row(temperature=0.0, repetition_penalty=2.0, history=[0], prompt_len=1)])
    assert ids == [1]
    assert logits[0].tolist() == raw


def test_frequency_penalty_scales_with_count_presence_does_not():
    logits = torch.zeros(2, 8)
    history = [1, 1, 3, 3, 3, 5]  # prompt [1, 1], output [3, 3, 3, 5]
    apply_penalties(
        logits,
        [row(frequency_penalty=0.5, history=history, prompt_len=2), row(presence_penalty=0.5, history=history, prompt_len=2)],
    )
    freq, pres = logits.tolist()
    assert freq[3] == pytest.approx(-1.5) and freq[5] == pytest.approx(-0.5)
    assert pres[3] == pytest.approx(-0.5) and pres[5] == pytest.approx(-0.5)
    assert freq[1] == pres[1] == 0.0, "frequency and presence penalties cover the output only"
    assert freq[0] == pres[0] == 0.0


def test_negative_frequency_penalty_favours_repeats():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    ids, _, _ = sample(logits, [row(temperature=0.0, frequency_penalty=-0.5, history=[2, 1], prompt_len=1)])
    assert ids == [1]


# -- logprobs --------------------------------------------------------------------------------------
def test_logprobs_are_of_the_raw_logits():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    rows = [
        row(temperature=0.0),
        row(temperature=0.7, top_k=5, seed=9),
        row(temperature=1.3, repetition_penalty=1.5, presence_penalty=1.0, history=[0, 1, 2], prompt_len=1, seed=3),
    ]
    ids, chosen, tops = sample(logits, rows, num_top_logprobs=3, want_logprobs=True)
    reference = torch.log_softmax(logits, -1)
    assert chosen == pytest.approx([float(reference[i, t]) for i, t in enumerate(ids)], abs=1e-6)
    for i, alternatives in enumerate(tops):
        want_vals, want_ids = reference[i].topk(3)
        assert [t for t, _ in alternatives] == want_ids.tolist()
        assert [v for _, v in alternatives] == pytest.approx(want_vals.tolist(), abs=1e-6)


def test_no_logprobs_unless_asked():
    ids, chosen, tops = sample(torch.zeros(2, 4), [row(), row(seed=1)])
    assert len(ids) == 2 and chosen is None and tops is None


# -- the wire --------------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    # the proto's floats are 32-bit: values exact in float32
    SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.75, top_k=5, min_p=0.125, repetition_penalty=1.25,
                   frequency_penalty=0.25, presence_penalty=-0.5, stop=("a", "b"), stop_token_ids=(3, 4),
                   ignore_eos=True, logprobs=True, top_logprobs=3),
    SamplingParams(max_new_tokens=None),
])
def test_sampling_params_cross_the_grpc_wire_unchanged(params):
    """What a client sends (tools.client) is what the servicer hands the engine."""
    from tandem.server.edge.grpc_servicer import to_sampling_params
    from tandem.tools.client import request_message

    message = request_message([1, 2, 3], params)
    assert to_sampling_params(message.sampling_params, message) == params


def packed(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """Bitmask rows (xgrammar's layout: bit j of int32 word w allows token 32 * w + j)."""
    words = torch.zeros(len(allowed), -(-vocab // 32), dtype=torch.int64)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            words[r, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # two's complement


def test_token_bitmask_masks_only_its_rows():
    vocab = 70  # three words, the last one partly used; token 31 is a sign bit
    logits = torch.randn(4, vocab)
    masked = logits.clone()
    apply_token_bitmask(masked, [1, 3], packed([[0, 31, 69], [32, 63]], vocab))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])  # unconstrained rows untouched
    for r, allowed in [(1, {0, 31, 69}), (3, {32, 63})]:
        assert {t for t in range(vocab) if masked[r, t] != float("-inf")} == allowed
        assert torch.equal(masked[r, sorted(allowed)], logits[r, sorted(allowed)])


def test_token_bitmask_matches_xgrammar_own_kernel():
    import xgrammar

    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    bitmask = torch.randint(-(1 << 31), 1 << 31, (5, -(-vocab // 32)), dtype=torch.int64, generator=gen).to(torch.int32)
    logits = torch.randn(5, vocab, generator=gen)
    ours, theirs = logits.clone(), logits.clone()
    apply_token_bitmask(ours, [0, 2, 4], bitmask[[0, 2, 4]])  # ours: one bitmask row per masked row
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, indices=[0, 2, 4])
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.5, top_k=5, top_p=0.9, min_p=0.05),
                                    dict(temperature=1.0, repetition_penalty=2.0, frequency_penalty=1.0)],
                         ids=["greedy", "filtered", "penalties"])
def test_masked_rows_draw_only_allowed_tokens(params):
    allowed = [17, 25, 30]  # among the least likely tokens of the row
    base = torch.arange(VOCAB, dtype=torch.float32).flip(0)
    rows = [row(seed=s, history=[3, 17, 5, 6] if "repetition_penalty" in params else None, prompt_len=2, **params)
            for s in range(40)]
    ids, _, _ = sample(base.expand(40, -1).clone(), rows, masked=(list(range(40)), packed([allowed] * 40, VOCAB)))
    assert set(ids) <= set(allowed)
    free, _, _ = sample(base.expand(40, -1).clone(), rows)
    assert not set(free) & set(allowed)  # unmasked, these rows never pick them


def test_constraint_validation_names_the_field():
    with pytest.raises(InvalidRequestError, match="regex: must not be empty"):
        SamplingParams(constraint=Constraint("regex", "")).validate(VOCAB)
    with pytest.raises(InvalidRequestError, match="constraint: kind 'grammar' is none of"):
        SamplingParams(constraint=Constraint("grammar", "x")).validate(VOCAB)
    SamplingParams(constraint=Constraint("json_schema", "{}")).validate(VOCAB)
