"""``math_accuracy``: an `evaluate` metric for math benchmarks (GSM8K, MATH-500, AIME, AMC).

Loadable offline: ``evaluate.load(str(path_to_this_folder))`` or
``tokenrouter_sdk.eval.load_metric("math_accuracy")``. Extraction and checking follow
`tokenrouter_sdk.eval.answers` (last ``\\boxed{}``, answer anchors, last number; Math-Verify).
"""

import evaluate

from tokenrouter_sdk.eval.answers import extract_math_answer
from tokenrouter_sdk.eval.metrics import answer_metric

_DESCRIPTION = """Share of model outputs whose final answer (last \\boxed{}, 'the answer is', or last number)
is mathematically equivalent (Math-Verify) to the reference answer."""

_KWARGS = answer_metric.usage(
    "math_accuracy", 'gold final answers, e.g. "18", "\\\\frac{14}{3}"', "answer", "so \\boxed{1,000}", "1000"
)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class MathAccuracy(answer_metric.AnswerAccuracy):
    """Final-answer accuracy with Math-Verify (Hugging Face, github.com/huggingface/Math-Verify)."""

    kind = "math"
    extract = staticmethod(extract_math_answer)
    about, about_inputs = _DESCRIPTION, _KWARGS
