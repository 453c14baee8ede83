"""``choice_accuracy``: an `evaluate` metric for multiple-choice benchmarks (CommonsenseQA).

Loadable offline: ``evaluate.load(str(path_to_this_folder))`` or
``tokenrouter_sdk.eval.load_metric("choice_accuracy")``. The chosen letter is extracted by
`tokenrouter_sdk.eval.answers.extract_choice` (``\\boxed{B}``, "the answer is (B)", "(B)", "B.").
"""

import evaluate

from tokenrouter_sdk.eval.answers import extract_choice
from tokenrouter_sdk.eval.metrics import answer_metric

_DESCRIPTION = "Share of model outputs whose chosen letter equals the reference letter."

_KWARGS = answer_metric.usage("choice_accuracy", 'gold letters, e.g. "A"', "letter", "The answer is (A).", "A")


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class ChoiceAccuracy(answer_metric.AnswerAccuracy):
    """Letter-match accuracy for multiple-choice questions."""

    kind = "choice"
    extract = staticmethod(extract_choice)
    about, about_inputs = _DESCRIPTION, _KWARGS
