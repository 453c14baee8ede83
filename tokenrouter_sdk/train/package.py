"""The default threshold of a trained head, and the packaged heads.

`calibrate_threshold`: a token-level head (CITER, R2R, Co-LLM) defers one small-model step at a
time, so the share of committed tokens the large model writes equals the share of the small
model's steps whose score crosses the threshold. The threshold that sends ``target`` of the
tokens to the large model is found in the engine itself: the policy runs (greedy) on calibration
prompts, its scores on the small model's steps are recorded, and the threshold moves to the
quantile of those scores that routes ``target`` of them; once two runs bracket the target, to the
linear interpolation between the closest two instead. This repeats until the realised large
fraction is within ``tol`` of the target (a routed run changes the trajectory, and with it the
scores, hence the rounds). Teacher-forced validation rows score differently from free-running generation, which is
why the pipelines' own thresholds (recall 0.95, Youden's J) are kept only as a record.

`finalize`: writes the head with the calibrated threshold as its ``config["threshold"]`` (the
policies' default) and a JSON record (command, data ids, seed, library versions, metrics,
the calibration rounds), optionally in float16 (the packaged heads: half the size; the threshold
is calibrated with the stored weights).
"""

from __future__ import annotations

import json
import shlex
import sys
import warnings
from pathlib import Path

import torch

from ..eval.calibrate import next_threshold, search_threshold
from .common import plain, threshold_for_rate

__all__ = ["calibrate_threshold", "calibrate_defer", "next_threshold", "finalize", "make_policy", "packaged_path"]

MIN_CALIBRATION_PROMPTS = 16  # fewer: a warning (the threshold then follows a handful of answers)

# kind -> (policy keyword of the threshold, method giving the score per small step, route when above)
SCORES = {
    "citer": ("tau", "confidence", False),
    "r2r": ("tau", "prob", True),
    "co_llm": ("eta", "deferral_prob", True),
    "query": ("threshold", None, False),
}


def make_policy(kind: str, head, threshold: float, embedding=None, extra: dict | None = None):
    """The policy of ``kind`` on ``head`` (a path or state) with its threshold set; R2R gets
    ``embedding`` (None: the packaged head's source table); ``extra``: more constructor
    arguments (e.g. Co-LLM's ``compose``)."""
    from tokenrouter_sdk import policies as P

    key = SCORES[kind][0]
    extra = dict(extra or {})
    if kind == "r2r":
        return P.R2R(head, embedding=extra.pop("embedding", embedding), tau=threshold, **extra)
    cls = {"citer": P.CITER, "co_llm": P.CoLLM, "query": P.QueryRouter}[kind]
    return cls(head, **{key: threshold}, **extra)


def calibrate_threshold(
    router,
    kind: str,
    head,
    prompts: list[str],
    target: float,
    *,
    start: float,
    max_new_tokens: int = 128,
    rounds: int = 4,
    tol: float = 0.015,
    concurrency: int = 16,
    embedding=None,
    policy_kwargs: dict | None = None,
) -> tuple[float, list[dict]]:
    """The threshold at which the ``kind`` policy on ``head`` realises a large fraction of about
    ``target`` on ``prompts`` (greedy, ``max_new_tokens`` tokens each), see the module docstring.

    Args:
        router: a threaded `Router` (``processes=False``: the scores are recorded in this process).
        kind: ``"citer"``, ``"r2r"`` or ``"co_llm"``.
        start: the first threshold tried.
        rounds: at most this many generation runs; tol: stop when |realised - target| <= tol.
        policy_kwargs: more arguments of the policy the head runs in (`make_policy`'s ``extra``).

    Returns:
        ``(threshold, rounds)``: the threshold whose run came closest to ``target``, and per run
        ``{"threshold", "large_fraction", "tokens", "hop_rate"}``.

    Raises:
        ValueError: ``kind`` is not token-level, ``target`` outside (0, 1), or the router runs
            its sub-servers in processes.
    """
    if kind not in ("citer", "r2r", "co_llm"):
        raise ValueError(f"calibrate_threshold: kind must be citer, r2r or co_llm, got {kind!r}")
    _, method, above = SCORES[kind]
    return calibrate_defer(
        router,
        lambda v: make_policy(kind, head, v, embedding, policy_kwargs),
        lambda pol, batch: getattr(pol, method)(batch),
        prompts,
        target,
        start=start,
        above=above,
        max_new_tokens=max_new_tokens,
        rounds=rounds,
        tol=tol,
        concurrency=concurrency,
    )


def calibrate_defer(
    router,
    factory,
    score,
    prompts: list[str],
    target: float,
    *,
    start: float,
    above: bool,
    max_new_tokens: int = 128,
    rounds: int = 4,
    tol: float = 0.015,
    concurrency: int = 16,
) -> tuple[float, list[dict]]:
    """`calibrate_threshold` for any one-token deferral policy (`DeferOneToken`: CITER, R2R,
    Co-LLM, R2REntropy, R2RAleatoric).

    Args:
        factory: ``factory(threshold) -> policy``.
        score: ``score(policy, batch) -> [B]`` tensor, the quantity the policy compares with its
            threshold on a small-model step (recorded on every step the policy decides).
        above: the policy routes when the score is above the threshold (R2R, Co-LLM, entropy),
            else below (CITER's confidence).
        Others: as in `calibrate_threshold`.

    Returns:
        ``(threshold, rounds)`` as in `calibrate_threshold`.
    """
    if not 0 < target < 1:
        raise ValueError(f"calibrate: target must be in (0, 1), got {target}")
    if len(prompts) < MIN_CALIBRATION_PROMPTS:
        warnings.warn(
            f"calibrating the threshold on {len(prompts)} prompt(s), fewer than {MIN_CALIBRATION_PROMPTS}: "
            f"the large fraction it realises on other questions may be far from the target {target}; "
            f"calibrate on more prompts (tokenrouter train --calibrate N, with --data holding N questions)",
            UserWarning,
            stacklevel=3,
        )
    if router.config.processes:
        raise ValueError("calibration records scores in this process: use Router(..., processes=False)")
    scores: list = []  # the last run's scores

    def run(value: float) -> dict:
        pol = factory(value)
        defer = pol.defer
        scores.clear()

        def recording(batch, _pol=pol, _defer=defer):
            with torch.no_grad():
                scores.append(score(_pol, batch).detach().float().cpu())
            return _defer(batch)

        pol.defer = recording
        outs = router.generate(
            prompts, policy=pol, max_new_tokens=max_new_tokens, temperature=0.0, concurrency=concurrency
        )
        bad = [o for o in outs if not o.ok]
        if bad:
            raise RuntimeError(f"calibration run failed: {bad[0].error}")
        m = router.metrics()
        return {"large_fraction": m.large_fraction, "tokens": m.committed_tokens, "hop_rate": m.hop_rate}

    def propose(hist: list[dict]) -> float | None:
        if not scores:  # the policy decided no step: nothing to take a quantile of
            return None
        return next_threshold(hist, target) or threshold_for_rate(torch.cat(scores), target, above=above)

    return search_threshold(run, target, [float(start)], propose, rounds=rounds, tol=tol)


def packaged_path(kind: str, pair: str | None = None) -> Path:
    """Where the package keeps the head of ``kind`` for a named pair (None: ``smollm2``)."""
    from tokenrouter_sdk.policies.heads import packaged_head_path

    return packaged_head_path(kind, pair)


def command_line() -> str:
    """This process's command line as ``tokenrouter ...`` when run from the CLI, else argv."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("tokenrouter", "__main__.py", "main.py"):
        argv[0] = "tokenrouter"
    return shlex.join(argv)


def finalize(
    res,
    router,
    *,
    target: float,
    calib_prompts: list,
    max_new_tokens: int = 128,
    dest=None,
    name: str | None = None,
    dtype=None,
    command: str | None = None,
    concurrency: int = 16,
    embedding=None,
    rounds: int = 4,
    config: dict | None = None,
    policy_kwargs: dict | None = None,
) -> tuple[Path, Path, float]:
    """Give a trained head (`TrainResult`) its default threshold and write it for use.

    Token-level heads: `calibrate_threshold` on ``calib_prompts`` (`Example` or str) for
    ``target``; the query head keeps the threshold its pipeline chose (the quantile of p over the
    training prompts sending ``large_share`` of them to the large model; train it with
    ``large_share=target``). The head goes to ``<dest>/<name>.pt`` (default: where it was
    trained, ``<kind>_head``) with ``config["threshold"]`` = that threshold, its tensors in
    ``dtype`` (None: as trained), and the record to ``<dest>/<name>.json``: the pipeline's record
    plus ``command``, ``seed``, ``stored_dtype`` and ``default_threshold`` (value, target,
    calibration prompt ids, rounds). ``config`` adds keys to the head's config (R2R:
    ``embedding_source``, the model whose token table the head reads when none is given).
    ``policy_kwargs``: more arguments of the policy the head is calibrated in (recorded as
    ``default_threshold.policy_kwargs``).

    Returns:
        ``(head path, JSON path, threshold)``.
    """
    from tokenrouter_sdk.policies.heads import load_head, save_head

    kind = res.kind
    sd, cfg, meta = load_head(res.head_path, kind)
    cfg = dict(cfg) | dict(config or {})
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    dest = Path(dest) if dest is not None else Path(res.head_path).parent
    dest.mkdir(parents=True, exist_ok=True)
    stem = name or Path(res.head_path).stem
    head_path, js = dest / f"{stem}.pt", dest / f"{stem}.json"
    meta = dict(meta)
    meta["command"] = command or command_line()
    meta["seed"] = meta.get("hyperparameters", {}).get("seed")
    meta["stored_dtype"] = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    meta["pipeline_threshold"] = {"value": res.threshold, "rule": meta.pop("threshold_rule", None)}
    meta.pop("threshold", None)
    save_head(head_path, kind, sd, plain(cfg | {"threshold": res.threshold}), plain(meta))
    prompts = [getattr(p, "prompt", p) for p in calib_prompts]
    ids = [getattr(p, "id", f"prompt-{i:04d}") for i, p in enumerate(calib_prompts)]
    if kind == "query":
        thr = res.threshold
        dt = {
            "value": thr,
            "target_large_fraction": target,
            "unit": "share of prompts answered by the large model",
            "rule": "quantile of p over the training prompts (train_query large_share)",
            "measured_train_share": res.metrics.get("large_share_train"),
        }
    else:
        thr, hist = calibrate_threshold(
            router,
            kind,
            head_path,
            prompts,
            target,
            start=res.threshold,
            max_new_tokens=max_new_tokens,
            concurrency=concurrency,
            embedding=embedding,
            rounds=rounds,
            policy_kwargs=policy_kwargs,
        )
        dt = {
            "value": thr,
            "target_large_fraction": target,
            "unit": "share of committed tokens written by the large model",
            "rule": "calibrated in the engine (greedy) on the calibration prompts: the quantile of the "
            "head's scores on the small model's steps, then the interpolation between the two runs bracketing the "
            "target, repeated until the realised large fraction is within 0.015 (at most 4 runs)",
            "calibration_ids": ids,
            "n_prompts": len(ids),
            "max_new_tokens": max_new_tokens,
            "rounds": hist,
            "realised_large_fraction": next(h["large_fraction"] for h in hist if h["threshold"] == thr),
            "policy_kwargs": {k: str(v) for k, v in (policy_kwargs or {}).items()},
        }
    meta["default_threshold"] = dt
    meta = plain(meta)
    save_head(head_path, kind, sd, plain(cfg | {"threshold": thr}), meta)
    js.write_text(json.dumps(meta, indent=1))
    return head_path, js, thr
