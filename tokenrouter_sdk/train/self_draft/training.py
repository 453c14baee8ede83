"""The self-draft training loop: `train_draft` fits the trained layers to cached teacher targets;
`draft_hidden` runs them on a cached residual stream."""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

from ...self_draft import init_trainable
from .teacher import TeacherData


def draft_hidden(extra, norm, rotary, h: torch.Tensor) -> torch.Tensor:
    """h [B, T, H] (residual after layer k, positions 0..T-1) -> normed last hidden [B, T, H]
    through the trained layers (causal attention, no padding mask: pad on the right)."""
    B, T, _ = h.shape
    pos = torch.arange(T, device=h.device).unsqueeze(0).expand(B, T)
    pe = rotary(h, pos)
    for layer in extra:
        h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        if isinstance(h, tuple):
            h = h[0]
    return norm(h)


def train_draft(
    large,
    data: TeacherData,
    m: int = 2,
    *,
    seconds: float = 1200.0,
    max_epochs: int = 20,
    lr: float = 3e-4,
    batch_tokens: int = 2048,
    seed: int = 0,
    progress: bool = True,
    log=None,
) -> tuple[list, torch.nn.Module, dict]:
    """Train ``m`` decoder layers + final norm on ``data`` for at most ``seconds`` (wall clock) or
    ``max_epochs``. Returns ``(extra_layers, norm, stats)``; stats holds ``steps``, ``epochs``,
    ``seconds``, ``loss_first``/``loss_last`` (mean soft cross-entropy, nats/token)."""
    from tqdm.auto import tqdm

    extra, norm = init_trainable(large, m)
    params = [p for mod in [*extra, norm] for p in mod.parameters()]
    for mod in extra:
        mod.train()
    rotary, lm_head = large.model.rotary_emb, large.lm_head
    amp = lm_head.weight.dtype == torch.float32  # bf16 autocast for fp32 models (2x faster on AVX512-BF16 CPUs)
    rng = random.Random(seed)
    order = list(range(len(data.hidden)))

    # batches of sequences up to batch_tokens (padded to the longest; right padding is harmless
    # under causal attention, and padded positions carry no loss)
    def batches():
        rng.shuffle(order)
        cur, longest = [], 0
        for i in sorted(order, key=lambda j: (data.hidden[j].shape[0] // 32, rng.random())):
            t = data.hidden[i].shape[0]
            if cur and max(longest, t) * (len(cur) + 1) > batch_tokens:
                yield cur
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, t)
        if cur:
            yield cur

    steps_per_epoch = sum(1 for _ in batches())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    est_steps = max_epochs * steps_per_epoch
    t0, step, losses, first, epoch = time.perf_counter(), 0, [], None, 0

    def lr_factor(s: int) -> float:  # warm-up, then cosine over whichever budget (steps, seconds) ends first
        frac = max(s / max(1, est_steps), (time.perf_counter() - t0) / seconds)
        return min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    bar = tqdm(total=est_steps, desc="distil", disable=not progress)
    done = False
    while epoch < max_epochs and not done:
        batch_list = list(batches())
        rng.shuffle(batch_list)
        for b in batch_list:
            T = max(data.hidden[i].shape[0] for i in b)
            H = data.hidden[b[0]].shape[1]
            h = torch.zeros(len(b), T, H)
            mask = torch.zeros(len(b), T, dtype=torch.bool)
            tid = torch.zeros(len(b), T, data.top_ids[b[0]].shape[1], dtype=torch.long)
            tlp = torch.full((len(b), T, data.top_ids[b[0]].shape[1]), -1e4)
            for r, i in enumerate(b):
                t = data.hidden[i].shape[0]
                h[r, :t], tid[r, :t], tlp[r, :t] = data.hidden[i], data.top_ids[i], data.top_logp[i]
                mask[r, data.start[i] : t - 1] = True
            with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=amp):
                x = draft_hidden(extra, norm, rotary, h)[mask]
                logits = lm_head(x if amp else x.to(lm_head.weight.dtype)).float()
            logp = logits.log_softmax(-1)
            target = tlp[mask].softmax(-1)  # renormalised teacher top-k
            loss = -(target * logp.gather(-1, tid[mask])).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            first = first if first is not None else losses[-1]
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(loss=f"{statistics.fmean(losses[-20:]):.3f}")
                if log:
                    log(
                        f"step {step} epoch {epoch} loss {statistics.fmean(losses[-20:]):.4f} "
                        f"{time.perf_counter() - t0:.0f}s"
                    )
            if time.perf_counter() - t0 > seconds:
                done = True
                break
        epoch += 1
    bar.close()
    for mod in [*extra, norm]:
        mod.eval().requires_grad_(False)
    stats = {
        "steps": step,
        "epochs": epoch,
        "steps_per_epoch": steps_per_epoch,
        "seconds": round(time.perf_counter() - t0, 1),
        "loss_first": first,
        "loss_last": statistics.fmean(losses[-20:]) if losses else None,
    }
    return extra, norm, stats
