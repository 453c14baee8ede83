"""Distil a self-draft small model from a large model on the CPU (``tokenrouter distill``).

A self-draft is the large model's first ``k`` layers (shared, zero-copy) topped by ``m`` trained
decoder layers and a trained final norm; `tokenrouter_sdk.self_draft` holds its file format and
attaches it to a large model at run time. This package makes one. Each stage is a function, usable
from a notebook; `distill` runs them all:

1. `synthetic_prompts` (`.data`): templated prompts made in code (grade-school word problems with
   random names and numbers, and general instructions over a topic list). No text of the benchmark
   sets (`tokenrouter_sdk.benchmarks`) is used, so nothing overlaps them.
2. `teacher_continuations` (`.teacher`): the large model's own continuations (greedy for half of
   the prompts, temperature 0.7 for the rest) through this package's engine (sequence-level
   knowledge distillation, Kim & Rush 2016, arXiv 1606.07947, section 3.2).
3. `teacher_targets` (`.teacher`): one full-model forward per sequence gives the residual stream
   after layer ``k`` (the draft's frozen input, cached once, so training never reruns the shared
   layers) and the teacher's top-``topk`` next-token log-probabilities.
4. `train_draft` (`.training`): the ``m`` trained layers (initialised from the large model's last
   ``m`` layers) and the final norm minimise the cross-entropy to the teacher's renormalised
   top-``topk`` distribution (word-level KD, Hinton et al. 2015) on every position after the system
   prompt. AdamW, cosine schedule, bf16 autocast, a wall-clock budget in seconds.
5. `agreement` (`.evaluate`): teacher-forced greedy agreement along the large model's greedy
   continuations of held-out prompts: the fraction of positions where ``argmax`` of the draft
   equals the large model's greedy token; `step_time_ratio` compares decode-step times.

The whole run: `distill` (`.pipeline`); settings: `DistillConfig` (`.config`); CLI:
``tokenrouter distill`` (`.cli`). The packaged draft
(``tokenrouter_sdk/assets/smollm2_self_draft.safetensors``) was made by ``tokenrouter distill`` with
the defaults; its sidecar JSON records the data sizes, the time taken and the measured agreement.
Nothing imports torch until a function is used.
"""

from __future__ import annotations

_WHERE = {
    "synthetic_prompts": "data",
    "MATH_INSTRUCTION": "data",
    "teacher_continuations": "teacher",
    "teacher_targets": "teacher",
    "TeacherData": "teacher",
    "system_prefix_len": "teacher",
    "prompt_ids": "teacher",
    "draft_hidden": "training",
    "train_draft": "training",
    "distill": "pipeline",
    "agreement": "evaluate",
    "step_time_ratio": "evaluate",
    "DistillConfig": "config",
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
