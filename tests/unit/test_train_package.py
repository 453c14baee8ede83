"""Default thresholds of trained heads (calibrated in the engine to a target large fraction) and
the written head + record (`tokenrouter_sdk.train.package`), on tiny models."""

import json

import pytest
import torch

from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate
from tokenrouter_sdk.policies import CITER, CoLLM, R2REntropy
from tokenrouter_sdk.policies.heads import load_head, save_head
from tokenrouter_sdk.train.common import TrainResult
from tokenrouter_sdk.train.package import calibrate_defer, calibrate_threshold, finalize

from ..helpers import mixed_prompts

PROMPTS = mixed_prompts(8, seed=3)


@pytest.fixture(scope="module")
def router():
    large = tiny_model(num_layers=2, seed=5)
    with Router({"small": truncate(large, 1), "large": large}, tokenizer=tiny_tokenizer(), processes=False) as r:
        yield r


def test_calibration_reaches_the_target_fraction(router):
    thr, rounds = calibrate_defer(
        router,
        lambda t: R2REntropy(threshold=t),
        lambda p, b: b.entropy,
        PROMPTS,
        0.3,
        start=100.0,
        above=True,
        max_new_tokens=24,
        rounds=4,
        tol=0.02,
    )
    assert rounds[0] == {"threshold": 100.0, "large_fraction": 0.0, "tokens": 8 * 24, "hop_rate": 0.0}
    assert (
        len(rounds) >= 2
        and abs(min(rounds, key=lambda h: abs(h["large_fraction"] - 0.3))["large_fraction"] - 0.3) <= 0.05
    )
    assert thr == min(rounds, key=lambda h: abs(h["large_fraction"] - 0.3))["threshold"]
    router.generate(PROMPTS, policy=R2REntropy(threshold=thr), max_new_tokens=24)  # the chosen one, rerun
    assert router.metrics().large_fraction == pytest.approx(
        next(h["large_fraction"] for h in rounds if h["threshold"] == thr), abs=1e-9
    )


def test_calibration_refuses_bad_input(router):
    with pytest.raises(ValueError, match="kind must be citer, r2r or co_llm"):
        calibrate_threshold(router, "query", None, PROMPTS, 0.3, start=0.5)
    with pytest.raises(ValueError, match=r"target must be in \(0, 1\)"):
        calibrate_defer(router, R2REntropy, lambda p, b: b.entropy, PROMPTS, 1.5, start=0.5, above=True)


def test_calibration_on_fewer_than_16_prompts_warns(router):
    import warnings

    args = dict(start=100.0, above=True, max_new_tokens=2, rounds=1)
    with pytest.warns(UserWarning, match="calibrating the threshold on 2 prompt"):
        calibrate_defer(router, lambda t: R2REntropy(threshold=t), lambda p, b: b.entropy, PROMPTS[:2], 0.3, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibrate_defer(router, lambda t: R2REntropy(threshold=t), lambda p, b: b.entropy, PROMPTS * 2, 0.3, **args)


@pytest.mark.parametrize("kind,cls,key", [("citer", CITER, "tau"), ("co_llm", CoLLM, "eta")])
def test_finalize_stores_the_calibrated_threshold(router, tmp_path, kind, cls, key):
    head = cls.random_head(64, seed=2)
    save_head(
        tmp_path / "h.pt",
        kind,
        head.state_dict(),
        {},
        {"kind": kind, "hyperparameters": {"seed": 7}, "threshold_rule": "some rule", "threshold": 0.5},
    )
    res = TrainResult(kind, tmp_path / "h.pt", tmp_path / "h.json", 0.5, {}, {})
    path, js, thr = finalize(
        res,
        router,
        target=0.25,
        calib_prompts=PROMPTS,
        max_new_tokens=16,
        dest=tmp_path / "pkg",
        name="packaged",
        dtype=torch.float16,
        command="tokenrouter train x",
    )
    sd, cfg, meta = load_head(path, kind)
    record = json.loads(js.read_text())
    assert record == meta and cfg["threshold"] == thr and path == tmp_path / "pkg" / "packaged.pt"
    assert all(v.dtype == torch.float16 for v in sd.values() if v.is_floating_point())
    assert (record["command"], record["seed"], record["stored_dtype"]) == ("tokenrouter train x", 7, "float16")
    assert record["pipeline_threshold"] == {"value": 0.5, "rule": "some rule"} and "threshold" not in record
    dt = record["default_threshold"]
    assert dt["value"] == thr and dt["target_large_fraction"] == 0.25 and len(dt["calibration_ids"]) == len(PROMPTS)
    assert abs(dt["realised_large_fraction"] - 0.25) <= 0.1
    pol = cls(path)  # the stored threshold is the policy's default
    assert getattr(pol, key) == thr
    router.generate(PROMPTS, policy=pol, max_new_tokens=16)
    assert router.metrics().large_fraction == pytest.approx(dt["realised_large_fraction"], abs=1e-9)


def test_next_threshold_interpolates_between_the_closest_bracketing_runs():
    from tokenrouter_sdk.train.package import next_threshold

    assert next_threshold([{"threshold": 0.6, "large_fraction": 0.8}], 0.25) is None
    hist = [
        {"threshold": 0.6, "large_fraction": 0.8},
        {"threshold": 0.16, "large_fraction": 0.15},
        {"threshold": 0.18, "large_fraction": 0.19},
        {"threshold": 0.3, "large_fraction": 0.4},
    ]
    assert next_threshold(hist, 0.25) == pytest.approx(0.18 + (0.06 / 0.21) * 0.12)


def test_fit_bce_is_seeded_whatever_the_global_random_state():
    from tokenrouter_sdk.train.common import fit_bce

    x, y = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)), (torch.arange(64) % 2).float()

    def fit(global_seed):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
        torch.manual_seed(global_seed)  # whatever ran before training
        fit_bce(lambda_net := _Flat(net), (x,), y, epochs=3, batch_size=16, seed=5)
        return lambda_net, torch.rand(1)

    (a, ra), (b, rb) = fit(1), fit(2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(ra, rb)  # the caller's generator was left alone


class _Flat(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)[:, 0]
