"""Settings of the self-draft pipeline (no torch import: the CLI reads the defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DistillConfig:
    """Settings of `distill` (the defaults made the packaged draft).

    Attributes:
        k: layers of the large model the draft shares (zero-copy).
        m: decoder layers trained on top (initialised from the large model's last ``m``).
        train_prompts: synthetic training prompts (`synthetic_prompts`).
        max_new_tokens: length of each teacher continuation (tokens).
        heldout_prompts: synthetic prompts held out for the agreement measurement.
        gsm8k_heldout: GSM8K test questions used for the agreement measurement (only that).
        topk: teacher next-token candidates kept per position (the soft target's support).
        seconds: training wall-clock budget (seconds).
        max_epochs: at most this many passes over the training positions.
        lr: AdamW peak learning rate (warm-up over 20 steps, then cosine).
        batch_tokens: padded tokens per training batch.
        seed: seed of the prompts, the sampled continuations and the batch order.
    """

    k: int = 12
    m: int = 2
    train_prompts: int = 400
    max_new_tokens: int = 128
    heldout_prompts: int = 32
    gsm8k_heldout: int = 32
    topk: int = 32
    seconds: float = 1500.0
    max_epochs: int = 14
    lr: float = 5e-4
    batch_tokens: int = 2048
    seed: int = 0
