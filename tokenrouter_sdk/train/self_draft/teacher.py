"""Teacher data of the self-draft: the large model's own continuations (sequence-level knowledge
distillation, Kim & Rush 2016, arXiv 1606.07947, section 3.2) and, per position, its residual
stream after layer ``k`` and its top-``topk`` next-token log-probabilities (the training targets)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def teacher_continuations(
    large,
    tok,
    prompts: list[str],
    max_new_tokens: int = 160,
    *,
    greedy_fraction: float = 0.5,
    temperature: float = 0.7,
    seed: int = 0,
    concurrency: int = 32,
    progress: bool = True,
) -> list[list[int]]:
    """Full token sequences (chat-templated prompt + the large model's continuation) for each
    prompt, generated with this package's engine (one sub-server, in-process)."""
    from tokenrouter_sdk.policies import SingleModel
    from tokenrouter_sdk.request import SamplingParams
    from tokenrouter_sdk.router import Router

    n_greedy = int(round(greedy_fraction * len(prompts)))
    sampling = [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0 if i < n_greedy else temperature, seed=seed + i)
        for i in range(len(prompts))
    ]
    with Router(
        {"large": large},
        SingleModel("large"),
        tokenizer=tok,
        processes=False,
        max_kv_tokens=concurrency * (max_new_tokens + 256),
    ) as r:
        outs = r.generate(prompts, sampling=sampling, concurrency=concurrency, progress=progress)
        return [r.encode(p) + list(o.token_ids) for p, o in zip(prompts, outs)]


def system_prefix_len(tok) -> int:
    """Tokens of the chat template before the user's text (the same for every prompt: no loss there)."""
    a = tok.apply_chat_template([{"role": "user", "content": "A"}], add_generation_prompt=True, tokenize=True)
    b = tok.apply_chat_template([{"role": "user", "content": "B"}], add_generation_prompt=True, tokenize=True)
    a, b = (x["input_ids"] if hasattr(x, "keys") else x for x in (a, b))
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


@dataclass
class TeacherData:
    """Cached training tensors, one entry per sequence of length T_s.

    Attributes:
        hidden: residual stream after layer ``k`` (input of the trained layers), [T_s, H] float32.
        top_ids: the teacher's top-``topk`` next-token ids at each position, [T_s, topk] int64.
        top_logp: their log-probabilities (not renormalised), [T_s, topk] float32.
        start: first position whose next-token prediction is trained (after the system prompt).
    """

    k: int
    hidden: list[torch.Tensor] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)
    top_logp: list[torch.Tensor] = field(default_factory=list)
    start: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Trained positions in all (tokens)."""
        return sum(h.shape[0] - 1 - s for h, s in zip(self.hidden, self.start))


@torch.no_grad()
def teacher_targets(
    large, seqs: list[list[int]], k: int, *, topk: int = 32, start: int = 0, progress: bool = True
) -> TeacherData:
    """One forward of ``large`` per sequence: its residual after layer ``k`` and top-``topk``
    next-token log-probabilities at every position (see `TeacherData`)."""
    from tqdm.auto import tqdm

    data = TeacherData(k=k)
    for ids in tqdm(seqs, desc="teacher targets", disable=not progress):
        x = torch.tensor([ids], device=large.device)
        out = large(input_ids=x, output_hidden_states=True, use_cache=False)
        logp = out.logits[0].float().log_softmax(-1)
        v, i = logp.topk(topk, dim=-1)
        data.hidden.append(out.hidden_states[k][0].float().cpu())
        data.top_ids.append(i.cpu())
        data.top_logp.append(v.cpu())
        data.start.append(min(start, len(ids) - 2))
    return data


def prompt_ids(tok, prompt: str) -> list[int]:
    """Token ids of ``prompt`` in ``tok``'s chat template, ending with the assistant turn's start."""
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
