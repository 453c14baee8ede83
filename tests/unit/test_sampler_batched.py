"""The batched sampler draws the tokens the row-by-row sampler drew for the same seeds.

`TABLE` holds seeded draws made by the row-by-row sampler (`_reference_sample`, a copy of it):
each case is one batch of 6 rows, sampled `ROUNDS` times in a row with the same generators.
"""

from __future__ import annotations

import random

import pytest
import torch

from tokenrouter_sdk.engine.core.sampler import _scale, _top_k, _top_p, make_generator, sample
from tokenrouter_sdk.request import SamplingParams

V = 96
ROUNDS = 4
SP = SamplingParams


def _reference_filter(logits_row, p):
    """The row-by-row sampler's filtered logits of one sampled row."""
    row = logits_row.float() / p.temperature
    if p.top_k and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        srt, idx = torch.sort(row, descending=True)
        cum = torch.softmax(srt, -1).cumsum(-1)
        drop = cum - torch.softmax(srt, -1) > p.top_p
        row = row.scatter(0, idx, srt.masked_fill(drop, float("-inf")))
    return row


def _reference_sample(logits, params, generators):
    """The row-by-row sampler: each sampled row filtered alone, then `torch.multinomial`."""
    out = logits.argmax(-1).cpu()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(_reference_filter(logits[i], p), -1)
        out[i] = torch.multinomial(probs, 1, generator=generators[i]).item()
    return out


def _logits(case: int, dtype: torch.dtype, values: str = "normal") -> torch.Tensor:
    """Six rows of ``V`` logits: "normal" (std 3), "ties" (steps of 0.25: ties at the k-th value
    and at the top-p cut) or "flat" (only -1, 0 and 1: the tie order decides the top-p set)."""
    g = torch.Generator().manual_seed(1000 + case)
    x = torch.randn(6, V, generator=g, dtype=torch.float64) * 3
    if values == "ties":
        x = (x * 2).round() / 4
    elif values == "flat":
        x = (x / 3).round().clamp(-1, 1)
    return x.to(dtype)


def _same(**kw) -> list[SamplingParams]:
    return [SP(**kw) for _ in range(6)]


MIXED = [
    SP(),
    SP(temperature=0.7),
    SP(),
    SP(temperature=1.3, top_k=5, top_p=0.9),
    SP(temperature=1.0, top_p=0.3),
    SP(temperature=0.7, top_k=V - 1),
]

# name -> (dtype, kind of logits, per-row params)
CASES = {
    "t0.7": (torch.float32, "normal", _same(temperature=0.7)),
    "t1.3": (torch.float32, "normal", _same(temperature=1.3)),
    "t1.3_k5": (torch.float32, "normal", _same(temperature=1.3, top_k=5)),
    "t1_k1": (torch.float32, "normal", _same(temperature=1.0, top_k=1)),
    "t1_kV": (torch.float32, "normal", _same(temperature=1.0, top_k=V)),
    "t1_p0.3": (torch.float32, "normal", _same(temperature=1.0, top_p=0.3)),
    "t0.7_p0.9": (torch.float32, "normal", _same(temperature=0.7, top_p=0.9)),
    "t1.3_p1.0": (torch.float32, "normal", _same(temperature=1.3, top_p=1.0)),
    "t1.3_k5_p0.9": (torch.float32, "normal", _same(temperature=1.3, top_k=5, top_p=0.9)),
    "mixed_f32": (torch.float32, "normal", MIXED),
    "mixed_bf16": (torch.bfloat16, "normal", MIXED),
    "mixed_f64": (torch.float64, "normal", MIXED),
    "ties_k3_p0.5": (torch.float32, "ties", _same(temperature=1.0, top_k=3, top_p=0.5)),
    "ties_bf16_p0.6": (torch.bfloat16, "ties", _same(temperature=0.9, top_p=0.6)),
    "ties_mixed": (torch.float32, "ties", MIXED),
    "ties_k3": (torch.float32, "ties", _same(temperature=2.0, top_k=3)),
    "flat_p0.5": (torch.float32, "flat", _same(temperature=1.0, top_p=0.5)),
    "flat_k10_bf16": (torch.bfloat16, "flat", _same(temperature=1.0, top_k=10)),
    "flat_mixed": (torch.float32, "flat", MIXED),
    "flat_k5_p0.5": (torch.float32, "flat", _same(temperature=1.0, top_k=5, top_p=0.5)),
}

# Draws of the row-by-row sampler: per case, ROUNDS rounds of 6 tokens.
TABLE = {
    "t0.7": [[88, 10, 75, 87, 83, 65], [26, 10, 88, 42, 83, 27], [26, 10, 62, 59, 30, 65], [19, 10, 75, 42, 83, 23]],
    "t1.3": [[25, 15, 0, 45, 12, 82], [94, 92, 42, 78, 14, 83], [5, 79, 87, 41, 54, 25], [69, 37, 53, 41, 69, 25]],
    "t1.3_k5": [[4, 47, 72, 75, 34, 88], [60, 65, 19, 6, 34, 18], [26, 61, 72, 75, 34, 86], [4, 61, 72, 6, 33, 79]],
    "t1_k1": [[30, 32, 93, 81, 89, 31], [30, 32, 93, 81, 89, 31], [30, 32, 93, 81, 89, 31], [30, 32, 93, 81, 89, 31]],
    "t1_kV": [[25, 39, 72, 19, 8, 41], [94, 40, 38, 92, 1, 72], [94, 4, 38, 52, 57, 63], [66, 49, 72, 92, 45, 72]],
    "t1_p0.3": [[88, 92, 26, 10, 14, 34], [88, 92, 26, 10, 14, 8], [88, 92, 26, 10, 14, 34], [88, 92, 26, 10, 14, 34]],
    "t0.7_p0.9": [
        [75, 57, 74, 84, 37, 18],
        [31, 57, 57, 84, 74, 18],
        [75, 57, 57, 84, 74, 77],
        [75, 57, 74, 84, 74, 18],
    ],
    "t1.3_p1.0": [[25, 60, 63, 25, 8, 71], [60, 46, 32, 94, 90, 29], [95, 46, 41, 69, 76, 46], [33, 60, 3, 69, 76, 94]],
    "t1.3_k5_p0.9": [
        [15, 29, 77, 29, 44, 65],
        [72, 22, 4, 29, 1, 65],
        [72, 22, 34, 29, 50, 65],
        [15, 22, 85, 29, 1, 65],
    ],
    "mixed_f32": [[70, 34, 4, 72, 7, 37], [70, 34, 4, 60, 7, 37], [70, 72, 4, 72, 7, 37], [70, 34, 4, 72, 7, 94]],
    "mixed_bf16": [[40, 45, 50, 78, 6, 56], [40, 45, 50, 78, 6, 22], [40, 45, 50, 10, 6, 22], [40, 45, 50, 10, 6, 25]],
    "mixed_f64": [[9, 16, 85, 20, 83, 6], [9, 1, 85, 59, 83, 1], [9, 1, 85, 32, 83, 1], [9, 27, 85, 32, 83, 1]],
    "ties_k3_p0.5": [
        [76, 69, 42, 93, 36, 8],
        [76, 69, 42, 10, 36, 8],
        [76, 33, 42, 10, 36, 8],
        [76, 33, 42, 10, 36, 8],
    ],
    "ties_bf16_p0.6": [
        [7, 74, 83, 71, 15, 92],
        [89, 10, 83, 71, 77, 72],
        [28, 1, 83, 69, 46, 2],
        [89, 49, 3, 48, 15, 3],
    ],
    "ties_mixed": [
        [56, 60, 17, 70, 17, 91],
        [56, 40, 17, 71, 17, 76],
        [56, 60, 17, 88, 17, 85],
        [56, 49, 17, 93, 72, 91],
    ],
    "ties_k3": [[2, 39, 39, 43, 12, 11], [74, 2, 39, 4, 81, 32], [18, 44, 39, 43, 81, 22], [74, 39, 39, 26, 81, 11]],
    "flat_p0.5": [
        [27, 89, 92, 61, 66, 20],
        [74, 40, 92, 78, 73, 83],
        [95, 72, 41, 59, 54, 74],
        [33, 49, 35, 10, 61, 16],
    ],
    "flat_k10_bf16": [
        [25, 15, 92, 14, 89, 6],
        [94, 40, 92, 60, 77, 18],
        [25, 72, 41, 32, 30, 85],
        [15, 13, 75, 10, 84, 91],
    ],
    "flat_mixed": [[7, 80, 0, 90, 57, 56], [7, 40, 0, 51, 34, 29], [7, 4, 0, 90, 57, 46], [7, 49, 0, 15, 33, 23]],
    "flat_k5_p0.5": [
        [25, 46, 1, 73, 60, 65],
        [60, 50, 1, 71, 60, 35],
        [26, 46, 41, 76, 50, 35],
        [38, 59, 53, 29, 63, 23],
    ],
}


def _draw(fn, name: str) -> list[list[int]]:
    dtype, values, params = CASES[name]
    logits = _logits(list(CASES).index(name), dtype, values)
    gens = [make_generator(100 + r, r % 2, "cpu") for r in range(6)]
    return [fn(logits, params, gens).tolist() for _ in range(ROUNDS)]


def _table_mismatches(fn) -> list[str]:
    """The cases where ``fn`` does not draw the pinned tokens."""
    return [f"{n}: {_draw(fn, n)} != {TABLE[n]}" for n in CASES if _draw(fn, n) != TABLE[n]]


def test_the_table_is_the_row_by_row_samplers_draws():
    assert set(TABLE) == set(CASES)
    assert _table_mismatches(_reference_sample) == []


def test_batched_sampler_draws_the_pinned_tokens():
    assert _table_mismatches(sample) == []


def test_the_table_tells_the_filters_apart():
    """The top-k, top-p and combined cases draw other tokens than temperature alone on the same
    rows, so a sampler that skipped or misplaced a filter would not reproduce the table."""
    for name in [
        "t1.3_k5",
        "ties_k3",
        "flat_k10_bf16",
        "t1_p0.3",
        "t0.7_p0.9",
        "flat_p0.5",
        "t1.3_k5_p0.9",
        "ties_k3_p0.5",
        "flat_k5_p0.5",
    ]:
        dtype, values, params = CASES[name]
        plain = [SP(temperature=p.temperature) for p in params]
        logits = _logits(list(CASES).index(name), dtype, values)
        gens = [make_generator(100 + r, r % 2, "cpu") for r in range(6)]
        unfiltered = [_reference_sample(logits, plain, gens).tolist() for _ in range(ROUNDS)]
        assert unfiltered != TABLE[name], name


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    if rng.random() < 0.2:
        return SP()
    top_k = rng.choice([0, 1, 2, rng.randint(1, vocab), vocab, vocab + 3])
    top_p = rng.choice([1.0, 1.0, 0.3, 0.9, round(rng.uniform(0.05, 1.0), 3)])
    return SP(temperature=rng.choice([0.3, 0.7, 1.0, 1.3, round(rng.uniform(0.1, 2.5), 3)]), top_k=top_k, top_p=top_p)


@pytest.mark.parametrize("block", range(4))
def test_batched_matches_row_by_row_on_random_batches(block):
    """Random batches (sizes, vocabularies, dtypes, ties, parameters, seeded and global rows):
    the same tokens and the same generator states afterwards."""
    rng = random.Random(block)
    for trial in range(80):
        b, vocab = rng.randint(1, 9), rng.choice([2, 7, 64, 257, 1000, 4099])
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float64])
        x = torch.randn(b, vocab, dtype=torch.float64) * rng.choice([0.5, 3.0, 12.0])
        if rng.random() < 0.3:
            x = (x * 2).round() / 2
        x = x.to(dtype)
        params = [_random_params(rng, vocab) for _ in range(b)]
        seeds = [rng.choice([None, rng.randint(0, 10**9)]) for _ in range(b)]
        seed_global = rng.randint(0, 10**6)
        gens_old = [make_generator(s, 0, "cpu") for s in seeds]
        gens_new = [make_generator(s, 0, "cpu") for s in seeds]
        torch.manual_seed(seed_global)
        old = _reference_sample(x, params, gens_old)
        torch.manual_seed(seed_global)
        new = sample(x, params, gens_new)
        ctx = f"block {block} trial {trial}: B={b} V={vocab} {dtype} {params} seeds {seeds}"
        assert new.dtype == torch.int64 and new.device.type == "cpu" and new.shape == (b,), ctx
        assert new.tolist() == old.tolist(), ctx
        for go, gn in zip(gens_old, gens_new):
            if go is not None:
                assert torch.equal(go.get_state(), gn.get_state()), ctx
        sampled = [p for p in params if not p.greedy]
        if sampled:  # the filtered logits bit for bit: rounding of temperature, mass, ties
            rows = x[[i for i, p in enumerate(params) if not p.greedy]]
            ref = torch.stack([_reference_filter(r, p) for r, p in zip(rows, sampled)])
            got = _top_p(
                _top_k(_scale(rows.float(), [p.temperature for p in sampled]), [p.top_k for p in sampled]),
                [p.top_p for p in sampled],
            )
            assert torch.equal(got, ref), ctx


def test_large_vocabulary_batch_matches_row_by_row():
    """A Qwen-sized vocabulary (151936) in bfloat16, every filter in one batch."""
    vocab = 151936
    x = (torch.randn(5, vocab, generator=torch.Generator().manual_seed(7)) * 4).to(torch.bfloat16)
    params = [
        SP(temperature=0.7, top_p=0.9),
        SP(),
        SP(temperature=1.0, top_k=50),
        SP(temperature=1.3, top_k=40, top_p=0.8),
        SP(temperature=0.6),
    ]
    old = _reference_sample(x, params, [make_generator(r, 0, "cpu") for r in range(5)])
    new = sample(x, params, [make_generator(r, 0, "cpu") for r in range(5)])
    assert new.tolist() == old.tolist()


def test_greedy_rows_take_argmax_and_leave_generators_alone():
    x = _logits(0, torch.bfloat16)
    gens = [make_generator(5, 0, "cpu") for _ in range(6)]
    before = [g.get_state() for g in gens]
    out = sample(x, [SP()] * 6, gens)
    assert out.tolist() == x.argmax(-1).tolist()
    assert all(torch.equal(b, g.get_state()) for b, g in zip(before, gens))


def test_top_k_keeps_every_value_tied_at_the_kth():
    x = torch.tensor([[5.0, 3.0, 3.0, 3.0, -1.0, -2.0]])
    seen = {int(sample(x, [SP(temperature=50.0, top_k=2)], [make_generator(s, 0, "cpu")])[0]) for s in range(200)}
    assert seen == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    # probabilities 0.5, 0.3, 0.2: the mass before each token is 0, 0.5, 0.8
    x = torch.tensor([[0.5, 0.3, 0.2]]).log()
    for top_p, allowed in [(0.45, {0}), (0.55, {0, 1}), (0.79, {0, 1}), (0.85, {0, 1, 2})]:
        seen = {
            int(sample(x, [SP(temperature=1.0, top_p=top_p)], [make_generator(s, 0, "cpu")])[0]) for s in range(300)
        }
        assert seen == allowed, top_p


def test_nan_logits_raise_naming_the_row():
    x = torch.randn(3, 10)
    x[1, 4] = float("nan")
    with pytest.raises(RuntimeError, match=r"rows \[1\].*NaN"):
        sample(x, [SP(temperature=1.0)] * 3, [None] * 3)


def test_empty_batch_and_all_greedy_shapes():
    assert sample(torch.zeros(0, 5), [], []).shape == (0,)
    out = sample(torch.randn(3, 5, dtype=torch.float64), [SP()] * 3, [None] * 3)
    assert out.dtype == torch.int64 and out.shape == (3,)
