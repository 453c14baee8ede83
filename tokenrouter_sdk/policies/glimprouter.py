"""GlimpRouter: step-level routing on the small model's first-token entropy (arXiv 2601.05110;
official code Zengwh02/GlimpRouter ``src/glimp_router.py`` @686838e).

A reasoning *step* is the text up to and including a blank line (``separator = "\\n\\n"``).
At each step start (output position 0, or right after the token that ended the previous step)
the small model S writes one token, the *glimpse*. Its entropy over the top-20 probabilities,
renormalised (nats),

    H = -sum_{i<=20} p_i log p_i,   p_i = softmax(top-20 logits)_i,

decides who writes the step: H >= theta -> the glimpse token is discarded and the large model
L writes the whole step (up to and including the token that completes the separator, kept;
then control returns to S); H < theta -> S writes the step. A step also ends after
``max_step_tokens`` tokens (the official ``max_tokens=512`` per step).

Final answer: once the answer phase starts, L writes every remaining token. It starts
  - right after the token completing ``answer_marker`` (default ``"</think>"``: the official
    "finished" test), whoever wrote it (the marker token is kept);
  - at the first step end where the output holds >= ``budget`` tokens (official token budget);
  - at the end of a step identical to the previous one (official loop stop; from step 3 on).
Choice for non-reasoning chat models: they never write ``</think>``, so with the defaults the
whole output is routed step by step and there is no separate answer phase; set
``answer_marker`` to the string your prompt asks the answer to start with (e.g. ``"####"``,
``"Answer:"``) to let L write the answer, or ``answer_marker=None`` to disable it.

Differences from the official code (which calls two vLLM servers step by step):
  - It regenerates the step in both branches (greedy glimpse, then a sampled step at T=0.6).
    By default S keeps its glimpse token when it stays (``regenerate_glimpse=False``): the
    entropy is taken from the logits, and the kept token is a draw from the distribution the
    official code re-samples from (the request's own sampling parameters).
    ``regenerate_glimpse=True`` does what the official code does: S discards its glimpse token
    and draws that position again from the same distribution (a `Resample` decision: no extra
    forward, one more discarded token per S step; the same tokens under greedy decoding).
  - Separators are kept in the output (vLLM strips the stop string and the code re-joins the
    steps with "\\n\\n"); a step cut at ``max_step_tokens`` gets no separator inserted.
  - At the answer phase the official code cuts the text after ``</think>`` and appends
    ``"\\n</think>\\n\\n"`` before L answers (<= 2048 tokens); no text is inserted here, and the
    answer length is bounded by the request's ``max_new_tokens`` (set it above ``budget``).
  - ``first_n_steps_base_model`` (default 0 there) is not offered.
"""

from __future__ import annotations

import torch

from tokenrouter_sdk.policy import Handoff, Needs, Policy, Resample, Step


def topk_entropy(logits: torch.Tensor, k: int = 20) -> float:
    """Entropy (nats) of the top-k probabilities renormalised to sum 1; ``logits`` shape [V] (or
    the top-k values themselves, shape [k])."""
    v = torch.topk(logits.double(), min(k, logits.shape[-1])).values
    lp = torch.log_softmax(v, -1)
    return float(-(lp.exp() * lp).sum())


def _completes(tokenizer, ids: list[int], start: int, tok: int, s: str) -> bool:
    """True if the text of ``ids[start:] + [tok]`` contains ``s`` (decoding only its tail: an
    earlier occurrence would already have been found on an earlier token)."""
    return s in tokenizer.decode(ids[max(start, len(ids) - 4 * len(s) - 4) :] + [tok], skip_special_tokens=False)


class GlimpRouter(Policy):
    """Args:
        theta: entropy threshold (nats): H >= theta -> L writes the step (official default 1.0).
        top_k: how many top probabilities the glimpse entropy uses (official: 20 logprobs).
        separator: text that ends a step (official ``stop=["\\n\\n"]``).
        max_step_tokens: a step also ends after this many tokens (official ``max_tokens=512``).
        budget: output tokens after which the next step end starts the answer phase (8192);
            None disables it.
        answer_marker: text after which L writes the rest (``"</think>"``); None disables it.
        stop_on_repeat: two identical consecutive steps start the answer phase (official).
        regenerate_glimpse: S discards its glimpse token and redraws it when it writes the step
            (the official code's regeneration; see the module docstring). Default False.
        small, large: model names (default: first and last model).

    Per-request state (``step.state``): ``start`` (output index where the current step
    began), ``n_steps``, ``prev`` (ids of the previous step), ``answer`` (answer phase on),
    ``glimpses`` (list of (position, H, writer)), ``keep`` (commit rule of the next handoff),
    ``redrawn`` (the output position of the last regenerated glimpse).
    """

    @property
    def needs(self) -> Needs:
        return Needs(topk=self.top_k)

    def __init__(
        self,
        theta: float = 1.0,
        top_k: int = 20,
        separator: str = "\n\n",
        max_step_tokens: int = 512,
        budget: int | None = 8192,
        answer_marker: str | None = "</think>",
        stop_on_repeat: bool = True,
        regenerate_glimpse: bool = False,
        small: str | None = None,
        large: str | None = None,
    ):
        if not separator:
            raise ValueError("GlimpRouter: separator must be a non-empty string")
        if max_step_tokens < 1 or top_k < 1:
            raise ValueError(f"GlimpRouter: max_step_tokens and top_k must be >= 1, got {max_step_tokens}, {top_k}")
        self.theta, self.top_k, self.separator = theta, top_k, separator
        self.max_step_tokens, self.budget, self.answer_marker = max_step_tokens, budget, answer_marker
        self.stop_on_repeat, self.regenerate_glimpse = stop_on_repeat, regenerate_glimpse
        self.small, self.large = small, large

    def route(self, step: Step) -> str | Resample:
        small, large = self.small or step.models[0], self.large or step.models[-1]
        st = step.state
        if st.get("answer"):
            return large
        tk = step.tokenizer
        if tk is None:
            raise ValueError(
                "GlimpRouter needs the tokenizer to find step boundaries: create the Router "
                "with tokenizer=..., or pass tokenizer= to reference_generate"
            )
        out, pos = step.request.output_ids, step.position
        start = st.setdefault("start", 0)
        st["keep"] = True
        if step.model == small and pos == start and st.get("redrawn") != pos:  # the glimpse
            h = topk_entropy(step.topk(self.top_k)[0], self.top_k)
            writer = large if h >= self.theta else small
            st.setdefault("glimpses", []).append((pos, h, writer))
            if writer == large:
                st["keep"] = False  # discard the glimpse; L regenerates this position
                return large
            if self.regenerate_glimpse:
                st["redrawn"] = pos  # discard the glimpse; S draws this position again
                return Resample()
        if self.answer_marker and _completes(tk, out, 0, step.token, self.answer_marker):
            st["answer"] = True
            return large
        if pos + 1 - start < self.max_step_tokens and not _completes(tk, out, start, step.token, self.separator):
            return step.model  # the step goes on, same writer
        # step end: the token is kept; decide what comes next
        cur = out[start:] + [step.token]
        st["start"], st["n_steps"] = pos + 1, st.get("n_steps", 0) + 1
        repeated = self.stop_on_repeat and st["n_steps"] >= 3 and st.get("prev") == cur
        st["prev"] = cur
        if repeated or (self.budget is not None and pos + 1 >= self.budget):
            st["answer"] = True
            return large
        return small  # the next step starts with S's glimpse

    def send(self, req, target) -> Handoff:
        return Handoff(keep_sampled=req.state.get("keep", True))
