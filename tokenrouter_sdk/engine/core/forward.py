"""One step's forward through a `Runner`, failing only the requests whose own inputs fail: when
the batched forward raises, each input is run alone (its KV slots are rewritten by the retry),
so one bad request never costs the others their step. `RunnerDied` is never caught: the runner
can serve no more steps.
"""

from __future__ import annotations

import torch

from ..runner import ForwardOut, RunnerDied, SeqInput

__all__ = ["forward", "forward_each"]


def forward(runner, inputs: list[SeqInput]) -> tuple[torch.Tensor, torch.Tensor, list]:
    """One runner forward: (logits [B, V], hidden [B, H], per input the hidden states of every
    fed position [n, H] where it asked (``all_hidden``), else None).

    Raises:
        TypeError: the runner's ``forward`` returned something other than a `ForwardOut`.
        whatever the runner raises.
    """
    out = runner.forward(inputs)
    if not isinstance(out, ForwardOut):
        raise TypeError(
            f"{type(runner).__name__}.forward returned {type(out).__name__}; a Runner.forward "
            f"returns tokenrouter_sdk.engine.runner.ForwardOut(logits, hidden, fed_hidden)"
        )
    fed = list(out.fed_hidden) if out.fed_hidden is not None else [None] * len(inputs)
    return out.logits, out.hidden, fed


def forward_each(
    runner, inputs: list[SeqInput]
) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None, list, list[tuple[int, Exception]]]:
    """The forward of ``inputs``; when it raises, each input alone. Returns ``(rows that ran,
    their logits [R, V], hidden [R, H], per row the fed hidden states or None, (index,
    exception) per input that failed)``; logits and hidden are None when none ran.

    Raises:
        RunnerDied: the runner can serve no more steps.
    """
    try:
        logits, hidden, fed = forward(runner, inputs)
        return list(range(len(inputs))), logits, hidden, fed, []
    except RunnerDied:
        raise
    except Exception as e:  # noqa: BLE001
        if len(inputs) == 1:
            return [], None, None, [], [(0, e)]
    ok, ls, hs, fs, failed = [], [], [], [], []
    for i, inp in enumerate(inputs):
        try:
            lg, hd, fd = forward(runner, [inp])
        except RunnerDied:
            raise
        except Exception as e:  # noqa: BLE001
            failed.append((i, e))
            continue
        ok.append(i), ls.append(lg), hs.append(hd), fs.extend(fd)
    if not ok:
        return [], None, None, [], failed
    return ok, torch.cat(ls), torch.cat(hs), fs, failed
