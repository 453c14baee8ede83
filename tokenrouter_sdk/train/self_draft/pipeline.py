"""The whole self-draft pipeline (`distill`): data, teacher targets, training, evaluation, and the
draft file with its JSON sidecar."""

from __future__ import annotations

import platform
import time
from dataclasses import asdict

import torch

from ...benchmarks import get_spec
from ...self_draft import attach_layers, save_self_draft
from .config import DistillConfig
from .data import synthetic_prompts
from .evaluate import agreement, step_time_ratio
from .teacher import prompt_ids, system_prefix_len, teacher_continuations, teacher_targets
from .training import train_draft


def distill(
    large,
    tok,
    out,
    config: DistillConfig | None = None,
    *,
    gsm8k_questions: list[str] | None = None,
    progress: bool = True,
    log=print,
) -> dict:
    """Run the whole pipeline (`tokenrouter_sdk.train.self_draft`) and write the draft to ``out``. Returns the
    metadata written next to it (config, data sizes, stats, agreements, step-time ratio).

    ``gsm8k_questions``: optional held-out evaluation questions (e.g. the first GSM8K test
    questions), put in the GSM8K template of `tokenrouter_sdk.benchmarks`; they are only ever
    used for the agreement measurement.
    """
    cfg = config or DistillConfig()
    t_all = time.perf_counter()
    times = {}
    t = time.perf_counter()
    prompts = synthetic_prompts(cfg.train_prompts + cfg.heldout_prompts, seed=cfg.seed)
    train_p, held_p = prompts[: cfg.train_prompts], prompts[cfg.train_prompts :]
    eval_sets = {"synthetic_heldout": held_p}
    if gsm8k_questions:
        gsm8k = get_spec("gsm8k")
        eval_sets["gsm8k_heldout"] = [gsm8k.prompt(q) for q in gsm8k_questions[: cfg.gsm8k_heldout]]
    log(f"distill: generating teacher continuations for {len(train_p)} training prompts")
    seqs = teacher_continuations(large, tok, train_p, cfg.max_new_tokens, seed=cfg.seed, progress=progress)
    eval_seqs = {}
    for name, ps in eval_sets.items():
        full = teacher_continuations(large, tok, ps, cfg.max_new_tokens, greedy_fraction=1.0, progress=progress)
        eval_seqs[name] = (full, [len(prompt_ids(tok, p)) for p in ps])
    times["generate_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    start = system_prefix_len(tok)
    data = teacher_targets(large, seqs, cfg.k, topk=cfg.topk, start=start, progress=progress)
    times["teacher_targets_s"] = round(time.perf_counter() - t, 1)
    log(
        f"distill: {data.tokens} training positions from {len(seqs)} sequences; training for at most "
        f"{cfg.seconds:.0f} s"
    )
    extra, norm, stats = train_draft(
        large,
        data,
        cfg.m,
        seconds=cfg.seconds,
        max_epochs=cfg.max_epochs,
        lr=cfg.lr,
        batch_tokens=cfg.batch_tokens,
        seed=cfg.seed,
        progress=progress,
        log=log,
    )
    times["train_s"] = stats["seconds"]
    p = next(large.parameters())
    for mod in [*extra, norm]:
        mod.to(device=p.device, dtype=p.dtype)
    from ...models import truncate

    draft = attach_layers(large, cfg.k, extra, norm)
    plain = truncate(large, cfg.k)
    t = time.perf_counter()
    agree = {}
    for name, (full, plens) in eval_seqs.items():
        agree[name] = {
            "self_draft": agreement(draft, full, plens),
            f"truncation_k{cfg.k}": agreement(plain, full, plens),
        }
        log(
            f"distill: {name}: self-draft agreement {agree[name]['self_draft']['agreement']:.3f}, "
            f"plain truncation {agree[name][f'truncation_k{cfg.k}']['agreement']:.3f}"
        )
    speed = step_time_ratio(draft, large)
    times["eval_s"] = round(time.perf_counter() - t, 1)
    import transformers

    meta = {
        "base": "SmolLM2-135M-Instruct"
        if "smollm" in str(getattr(large.config, "_name_or_path", "")).lower() or large.config.num_hidden_layers == 30
        else str(getattr(large.config, "_name_or_path", "?")),
        "k": cfg.k,
        "m": cfg.m,
        "config": asdict(cfg),
        "data": {
            "train_prompts": len(train_p),
            "train_positions": data.tokens,
            "source": "synthetic templated prompts (tokenrouter_sdk.train.self_draft.data.synthetic_prompts, "
            f"seed {cfg.seed}); no text from the benchmark sets",
            "heldout": {name: len(v[0]) for name, v in eval_seqs.items()},
        },
        "train": stats,
        "agreement": agree,
        "step_time": speed,
        "times_s": times,
        "total_s": round(time.perf_counter() - t_all, 1),
        "env": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
        },
    }
    save_self_draft(out, extra, norm, meta)
    return meta
