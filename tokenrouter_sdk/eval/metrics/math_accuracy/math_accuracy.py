"""``math_accuracy``: an `evaluate` metric for math benchmarks (GSM8K, MATH-500, AIME, AMC).

Loadable offline: ``evaluate.load(str(path_to_this_folder))`` or
``tokenrouter_sdk.eval.load_metric("math_accuracy")``. Extraction and checking follow
`tokenrouter_sdk.eval.answers` (last ``\\boxed{}``, answer anchors, last number; Math-Verify).
"""

import datasets
import evaluate

from tokenrouter_sdk.eval.answers import extract_math_answer, is_correct

_DESCRIPTION = """Share of model outputs whose final answer (last \\boxed{}, 'the answer is', or last number)
is mathematically equivalent (Math-Verify) to the reference answer."""

_KWARGS = """
Args:
    predictions (list of str): full model outputs.
    references (list of str): gold final answers, e.g. "18", "\\frac{14}{3}".
Returns:
    accuracy (float in [0, 1]), correct (int), answered (int: outputs with an extractable answer).
Examples:
    >>> m = evaluate.load("path/to/math_accuracy")
    >>> m.compute(predictions=["so \\boxed{1,000}"], references=["1000"])
    {'accuracy': 1.0, 'correct': 1, 'answered': 1}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class MathAccuracy(evaluate.Metric):
    """Final-answer accuracy with Math-Verify (Hugging Face, github.com/huggingface/Math-Verify)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references):
        ok = [is_correct(p, r, "math") for p, r in zip(predictions, references)]
        answered = sum(extract_math_answer(p) is not None for p in predictions)
        return {"accuracy": sum(ok) / len(ok) if ok else 0.0, "correct": sum(ok), "answered": answered}
