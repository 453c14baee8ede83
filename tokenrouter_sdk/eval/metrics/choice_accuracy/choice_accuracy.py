"""``choice_accuracy``: an `evaluate` metric for multiple-choice benchmarks (CommonsenseQA).

Loadable offline: ``evaluate.load(str(path_to_this_folder))`` or
``tokenrouter_sdk.eval.load_metric("choice_accuracy")``. The chosen letter is extracted by
`tokenrouter_sdk.eval.answers.extract_choice` (``\\boxed{B}``, "the answer is (B)", "(B)", "B.").
"""

import datasets
import evaluate

from tokenrouter_sdk.eval.answers import extract_choice, is_correct

_DESCRIPTION = "Share of model outputs whose chosen letter equals the reference letter."

_KWARGS = """
Args:
    predictions (list of str): full model outputs.
    references (list of str): gold letters, e.g. "A".
Returns:
    accuracy (float in [0, 1]), correct (int), answered (int: outputs with an extractable letter).
Examples:
    >>> m = evaluate.load("path/to/choice_accuracy")
    >>> m.compute(predictions=["The answer is (A)."], references=["A"])
    {'accuracy': 1.0, 'correct': 1, 'answered': 1}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class ChoiceAccuracy(evaluate.Metric):
    """Letter-match accuracy for multiple-choice questions."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references):
        ok = [is_correct(p, r, "choice") for p, r in zip(predictions, references)]
        answered = sum(extract_choice(p) is not None for p in predictions)
        return {"accuracy": sum(ok) / len(ok) if ok else 0.0, "correct": sum(ok), "answered": answered}
