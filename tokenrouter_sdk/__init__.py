"""tokenrouter-sdk: a runtime for token-level routing between language models.

After the TokenRouter paper (arXiv 2610.12242): one sub-server per model with a private KV
pool; a request handed off to a peer stays pending with its KV intact.

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.policies import RStitch
    router = Router.default(policy=RStitch(tau=0.3))
    outs = router.generate(["What is 7 + 5?"], max_new_tokens=64)
"""

from .metrics import Metrics, ModelMetrics
from .placement import ModelSpec
from .policy import Handoff, Needs, Policy, Resample, Step, StepBatch, TopK
from .request import RequestOutput, RequestView, SamplingParams
from .router import Router, TokenEvent

__all__ = [
    "Router",
    "Policy",
    "Step",
    "StepBatch",
    "TopK",
    "Handoff",
    "Needs",
    "Resample",
    "SamplingParams",
    "RequestOutput",
    "RequestView",
    "Metrics",
    "ModelMetrics",
    "TokenEvent",
    "ModelSpec",
]
__version__ = "0.1.0"
