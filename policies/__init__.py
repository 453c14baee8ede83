"""Built-in routing policies, shipped as ``tokenrouter_sdk.policies``.

Each file holds one algorithm with its source; see ``../shared/research/policies.md``.
"""

from .baselines import LargeOnly, RandomRouting, SingleModel, SmallOnly
from .rstitch import RStitch

__all__ = ["SingleModel", "SmallOnly", "LargeOnly", "RandomRouting", "RStitch"]
