"""The one `evaluate` metric behind ``math_accuracy`` and ``choice_accuracy``: the share of
model outputs whose extracted answer is correct (`tokenrouter_sdk.eval.answers`). Each packaged
metric module subclasses `AnswerAccuracy` with its answer kind and extractor."""

from __future__ import annotations

from typing import Callable

import datasets
import evaluate

from tokenrouter_sdk.eval.answers import is_correct


def usage(name: str, gold: str, answer: str, prediction: str, reference: str) -> str:
    """The arguments-and-returns text of a packaged metric ``name``: references are ``gold``
    (e.g. 'gold letters, e.g. "A"'), ``answer`` names what is extracted; the example computes
    ``prediction`` against ``reference``."""
    return f"""
Args:
    predictions (list of str): full model outputs.
    references (list of str): {gold}.
Returns:
    accuracy (float in [0, 1]), correct (int), answered (int: outputs with an extractable {answer}).
Examples:
    >>> m = evaluate.load("path/to/{name}")
    >>> m.compute(predictions=[{prediction!r}], references=[{reference!r}])
    {{'accuracy': 1.0, 'correct': 1, 'answered': 1}}
"""


class AnswerAccuracy(evaluate.Metric):
    """Accuracy of extracted answers: ``accuracy`` (float in [0, 1]), ``correct`` (int),
    ``answered`` (int: outputs with an extractable answer).

    Subclasses set ``kind`` (the `is_correct` answer kind), ``extract`` (output text -> answer
    or None), ``about`` and ``about_inputs`` (its description and its arguments)."""

    kind: str = ""
    extract: Callable[[str], object] = staticmethod(lambda text: None)
    about = ""  # the metric's description
    about_inputs = ""  # its arguments and returns

    def _info(self):
        return evaluate.MetricInfo(
            description=self.about,
            citation="",
            inputs_description=self.about_inputs,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        ok = [is_correct(p, r, self.kind) for p, r in zip(predictions, references)]
        answered = sum(type(self).extract(p) is not None for p in predictions)
        return {"accuracy": sum(ok) / len(ok) if ok else 0.0, "correct": sum(ok), "answered": answered}
