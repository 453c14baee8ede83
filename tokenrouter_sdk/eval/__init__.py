"""Quality at hop rate: benchmarks, answer checking and threshold sweeps.

```python
from tokenrouter_sdk.eval import evaluate_policy, load_benchmark
res = evaluate_policy(router, "rstitch", values=[0.02, 0.05, 0.1], dataset="gsm8k", limit=64)
res.to_pandas(); res.plot(x="large_fraction"); res.save("out/")
```
Modules: ``datasets`` (benchmarks + prompt templates), ``answers`` (extraction, Math-Verify),
``metrics/`` (`evaluate` metric modules), ``sweep`` (`evaluate_policy`, `evaluate_policies`),
``calibrate`` (`calibrate_large_share`: a threshold for a wanted large share),
``references`` (matched random references), ``stats`` (paired statistics, RouteLLM summaries),
``machine`` (CPU time and load of timed runs), ``result`` (`EvalResult`), ``plots`` (Pareto plots),
``config`` (recorded configuration), ``cli`` (``tokenrouter eval``).
"""

from .answers import answers_agree, extract_answer, extract_choice, extract_math_answer, is_correct
from .calibrate import Calibration, calibrate_large_share
from .datasets import BENCHMARKS, Benchmark, load_benchmark
from .metrics import load_metric, metric_path
from .result import EvalResult
from .sweep import evaluate_policies, evaluate_policy, merge_sweep

__all__ = [
    "evaluate_policy",
    "evaluate_policies",
    "merge_sweep",
    "calibrate_large_share",
    "Calibration",
    "load_benchmark",
    "EvalResult",
    "Benchmark",
    "BENCHMARKS",
    "load_metric",
    "metric_path",
    "extract_answer",
    "extract_math_answer",
    "extract_choice",
    "is_correct",
    "answers_agree",
]
