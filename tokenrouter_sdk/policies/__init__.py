"""Built-in routing policies, shipped as ``tokenrouter_sdk.policies``.

One file per algorithm; its docstring gives the source (paper, section, official code) and the
rule as implemented, with what the paper leaves open. Naming: token-level policies are named after their paper
(`CITER`, `R2R`, `CoLLM`, `RStitch`, `GlimpRouter`), baselines after what they do.

| policy | decides | on a handoff | peer writes |
|---|---|---|---|
| `SmallOnly`, `LargeOnly`, `SingleModel` | nothing | - | - |
| `RandomRouting` | Bernoulli(p) per small step | discard | 1 token |
| `RandomSpanRouting` | geometric stretches (mean ``small_visit``) | discard | a geometric span (mean ``large_visit``) |
| `RStitch` | normalised entropy vs tau, both ways | discard up, keep down | until confident |
| `CITER` | MLP confidence on small hidden | discard | 1 token |
| `R2R`, `R2REntropy`, `R2RAleatoric` | router net / entropy / LogU | discard | 1 token |
| `CoLLM` | deferral head sigmoid(g . h) | discard | 1 token |
| `GlimpRouter` | first-token top-20 entropy per step | discard glimpse | a whole step |
| `TokenEnsemble` | draw from ensemble weights | keep | 1 token, re-drawn |
| `QueryRouter`, `RandomQueryRouting` | once per request | discard | the whole answer |
"""

from .baselines import LargeOnly, RandomRouting, RandomSpanRouting, SingleModel, SmallOnly
from .citer import CITER
from .co_llm import CoLLM
from .ensemble import TokenEnsemble
from .glimprouter import GlimpRouter
from .heads import HeadMissingError, load_head, save_head
from .query_level import QueryRouter, RandomQueryRouting
from .r2r import R2R, R2RAleatoric, R2REntropy
from .rstitch import RStitch

__all__ = [
    "SingleModel",
    "SmallOnly",
    "LargeOnly",
    "RandomRouting",
    "RandomSpanRouting",
    "RStitch",
    "CITER",
    "R2R",
    "R2REntropy",
    "R2RAleatoric",
    "CoLLM",
    "GlimpRouter",
    "TokenEnsemble",
    "QueryRouter",
    "RandomQueryRouting",
    "HeadMissingError",
    "save_head",
    "load_head",
]
