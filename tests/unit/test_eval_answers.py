"""Final-answer extraction and checking (tokenrouter_sdk.eval.answers) on realistic model
outputs, the packaged `evaluate` metric modules, and benchmark loading."""

import json

import pytest

from tokenrouter_sdk.eval import (
    BENCHMARKS,
    answers_agree,
    extract_choice,
    extract_math_answer,
    is_correct,
    load_benchmark,
    load_metric,
)
from tokenrouter_sdk.eval.answers import last_boxed
from tokenrouter_sdk.eval.config import wilson_interval

GSM8K_OUTPUTS = [  # (model output, gold, expected extraction, correct?)
    ("Janet has 16 - 3 - 4 = 9 eggs left. 9 * 2 = 18. The answer is 18.", "18", "18", True),
    ("She makes $1,234 dollars per week.", "1234", "1234", True),
    ("Total: 3 boxes x 12 eggs = 36 eggs.\nThe answer is 36 eggs.", "36", "36", True),
    ("First 5 + 7 = 12, then 12 * 2 = 24, then 24 - 4 = 20", "20", "20", True),
    ("The answer is 7. Check: 3 + 4 = 7. It took me 2 minutes.", "7", "7", True),
    ("#### 70,000", "70000", "70000", True),
    ("The answer is $18. She also earns $20 on Sundays.", "18", "18", True),
    ("So the total is 25 apples, the answer is 26.", "25", "26", False),
    ("I am not sure how to solve this problem.", "18", None, False),
    ("", "18", None, False),
    ("The speed is 5 km/h, so she walks 10 km in 2 hours. The answer is 2 hours.", "2", "2", True),
    ("-3 degrees at night", "-3", "-3", True),
    ("Each ticket costs $12.50, so 4 tickets cost 4 * 12.50 = $50.00.\nThe answer is $50.", "50", "50", True),
    ("He paid $0.50 per apple, 10 apples cost $5.00. The answer is 0.50", "0.5", "0.50", True),
    ("The discount is 20% of 80 = 16 dollars, so the answer is 20%.", "20", "20", True),
    ("The temperature dropped to -12 degrees.\nFinal answer: -12", "-12", "-12", True),
    ("Let x be the number of books. 3x = 45, so x = 15", "15", "15", True),
    ("The answer is 15.\n\nCheck: 15 * 3 = 45, which matches the 45 books.", "15", "15", True),
    ("Step 1: 120 / 4 = 30 pages per day.\nStep 2: 30 * 7 = 210.\n#### 210", "210", "210", True),
    ("She runs 3.5 km on Monday and 2.25 km on Tuesday, 5.75 km in total.", "5.75", "5.75", True),
    ("So she needs \\boxed{ 18 } more eggs.", "18", "18", True),
    ("Therefore, the total cost is $\\boxed{\\$1,250}$.", "1250", "1250", True),
    ("The farmer has 1,200 sheep and sells 1,150, so 50 remain. The answer is 50 sheep.", "50", "50", True),
    ("The answer is 48 cookies. Each of the 6 friends gets 8.", "48", "48", True),
    ("Answer: 7 hours", "8", "7", False),
]

MATH_OUTPUTS = [
    (
        "Simplifying, $\\frac{28}{6} = \\frac{14}{3}$, so the answer is $\\boxed{\\frac{14}{3}}$.",
        "\\frac{14}{3}",
        "\\frac{14}{3}",
        True,
    ),
    ("Thus $x = \\boxed{\\boxed{5}}$.", "5", "5", True),
    ("We get $\\boxed{\\dfrac{1}{2}}$", "0.5", "\\dfrac{1}{2}", True),
    (
        "The polar form is $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        True,
    ),
    ("The answer is \\boxed{1,000} dollars.", "1000", "1000", True),
    ("First \\boxed{3}, but on reflection the answer is \\boxed{4}.", "4", "4", True),
    ("Hence x = \\frac{3}{4}", "\\frac{3}{4}", "\\frac{3}{4}", True),
    ("The final answer is $\\sqrt{2}$.", "\\sqrt{2}", "\\sqrt{2}", True),
    ("The final answer is $\\sqrt{3}$.", "\\sqrt{2}", "\\sqrt{3}", False),
    ("\\boxed{12\\text{ eggs}}", "12", "12\\text{ eggs}", True),
    ("an unclosed \\boxed{3 and no number", "3", "3", True),  # falls back to the last number
    ("So $m + n = 3 + 4 = \\boxed{7}$.", "7", "7", True),
    ("The area is $\\boxed{\\dfrac{9}{4}}$ square units.", "\\frac{9}{4}", "\\dfrac{9}{4}", True),
    ("Hence the angle is $\\boxed{106^\\circ}$.", "106^\\circ", "106^\\circ", True),
    ("The largest value is $\\boxed{10{,}080}$.", "10,\\!080", "10080", True),
    ("The solution set is $\\boxed{(12,102)}$.", "(12,102)", "(12,102)", True),
    ("The solutions are $x = \\boxed{1, -2}$.", "1,-2", "1, -2", True),
    ("The interval is $\\boxed{(-\\infty, 0]}$.", "(-\\infty, 0]", "(-\\infty, 0]", True),
    ("She keeps $\\boxed{\\text{\\$32,348}}$.", "\\$32,\\!348", "32348", True),
    (
        "We find $k = -\\frac{1}{2}$. Check: substituting gives $2(-\\tfrac{1}{2}) + 1 = 0$, as required.",
        "-\\frac{1}{2}",
        "0",
        False,
    ),  # a check sentence after an unboxed answer: the last expression wins
    ("The answer is $\\frac{\\sqrt{3}}{2}$.", "\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}", True),
    ("Final Answer: The final answer is $3\\pi$. I hope it is correct.", "3\\pi", "3\\pi", True),
    ("Therefore $f(2) = 2^{3} - 1 = 7$.", "7", "7", True),
    ("The remainder is \\boxed{5}. (Check: 47 = 6 * 7 + 5.)", "5", "5", True),
    ("Final Answer: The final answer is $(3,4]$. I hope it is correct.", "(3,4]", "(3,4]", True),
    ("The answer is $6 - 5i$.", "6-5i", "6 - 5i", True),
    ("The answer is $6 - 5i$.", "6", "6 - 5i", False),
]

# LaTeX thousands separators: every spelling of 9500 reads as 9500, in every position
THOUSANDS_OUTPUTS = [
    ("so it costs $9{,}500.", "9500", "9500", True),
    ("so it costs $9\\,500.", "9500", "9500", True),
    ("so it costs $9\\!,500.", "9500", "9500", True),
    ("so it costs $9,500.", "9500", "9500", True),
    ("The answer is 9{,}500.", "9500", "9500", True),
    ("The answer is 9\\,500 dollars.", "9500", "9500", True),
    ("The final answer is $\\$9{,}500$.", "9500", "9500", True),
    ("Total: \\boxed{9{,}500}", "9500", "9500", True),
    ("Total: \\boxed{9\\!,500}", "9500", "9500", True),
    ("He ends with $1{,}234{,}567.50 in the account.", "1234567.5", "1234567.50", True),
    ("so it costs $9{,}500.", "500", "9500", False),
]

# expressions are extracted and compared whole, not their last fraction or number
EXPRESSION_OUTPUTS = [
    ("The probability is $1 - \\frac{1}{e}$.", "1 - \\frac{1}{e}", "1 - \\frac{1}{e}", True),
    ("The probability is $1 - \\frac{1}{e}$.", "\\frac{1}{e}", "1 - \\frac{1}{e}", False),
    ("So the side is x = 2\\sqrt{3}", "2\\sqrt{3}", "2\\sqrt{3}", True),
    ("So the side is x = 2\\sqrt{3}", "3", "2\\sqrt{3}", False),
    ("Therefore the slope is $-\\frac{3}{4}$.", "-\\frac{3}{4}", "-\\frac{3}{4}", True),
    ("Therefore the slope is $-\\frac{3}{4}$.", "\\frac{3}{4}", "-\\frac{3}{4}", False),
    ("Adding, the length is $\\frac{\\pi}{2} + 1$.", "1 + \\frac{\\pi}{2}", "\\frac{\\pi}{2} + 1", True),
    ("Adding, the length is $\\frac{\\pi}{2} + 1$.", "1", "\\frac{\\pi}{2} + 1", False),
    ("The final answer is 1 - \\frac{1}{e}, which is about 0.63.", "1 - \\frac{1}{e}", "1 - \\frac{1}{e}", True),
    ("The answer is 2\\sqrt{3} cm.", "2\\sqrt{3}", "2\\sqrt{3}", True),
    ("The answer is $x = -\\frac{3}{4}$.", "-\\frac{3}{4}", "-\\frac{3}{4}", True),
    ("We get $\\frac{28}{6} = \\frac{14}{3}$", "\\frac{14}{3}", "\\frac{14}{3}", True),
]

CHOICE_OUTPUTS = [
    ("Revolving doors are common in banks for security. The answer is (A).", "A", "A", True),
    ("B", "B", "B", True),
    ("C.", "D", "C", False),
    ("A revolving door is convenient, so (A) bank", "A", "A", True),
    ("Answer: d", "D", "D", True),
    ("\\boxed{E}", "E", "E", True),
    ("A revolving door is used for two-way travel.", "A", None, False),  # the article 'A' is no answer
    ("Option C looks plausible, but the answer is B", "B", "B", True),
    ("", "A", None, False),
]


@pytest.mark.parametrize("text,gold,pred,ok", GSM8K_OUTPUTS)
def test_gsm8k_style_outputs(text, gold, pred, ok):
    assert extract_math_answer(text) == pred
    assert is_correct(text, gold, "math") is ok


@pytest.mark.parametrize("text,gold,pred,ok", MATH_OUTPUTS)
def test_latex_outputs(text, gold, pred, ok):
    assert extract_math_answer(text) == pred
    assert is_correct(text, gold, "math") is ok


@pytest.mark.parametrize("text,gold,pred,ok", THOUSANDS_OUTPUTS)
def test_latex_thousands_separators(text, gold, pred, ok):
    assert extract_math_answer(text) == pred
    assert is_correct(text, gold, "math") is ok


@pytest.mark.parametrize("text,gold,pred,ok", EXPRESSION_OUTPUTS)
def test_whole_expressions(text, gold, pred, ok):
    assert extract_math_answer(text) == pred
    assert is_correct(text, gold, "math") is ok


@pytest.mark.parametrize("text,gold,pred,ok", CHOICE_OUTPUTS)
def test_choice_outputs(text, gold, pred, ok):
    assert extract_choice(text) == pred
    assert is_correct(text, gold, "choice") is ok


def test_last_boxed_nesting_and_top_level():
    assert last_boxed("\\boxed{\\frac{1}{\\sqrt{2}}}") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\boxed{\\boxed{2}+\\boxed{3}}") == "\\boxed{2}+\\boxed{3}"  # not the inner box
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{2 and never closed") is None


def test_agreement_rules():
    assert answers_agree("18", "18.0")
    assert answers_agree("\\frac{1}{2}", "0.5")
    assert not answers_agree("18", "19")
    assert answers_agree(None, None)  # neither answered
    assert not answers_agree("18", None)
    assert answers_agree("b", "B", "choice")
    with pytest.raises(ValueError, match="kind"):
        is_correct("1", "1", "essay")


def test_wilson_interval_values():
    lo, hi = wilson_interval(0, 64)
    assert lo == 0.0 and hi == pytest.approx(0.0565, abs=1e-3)
    lo, hi = wilson_interval(32, 64)
    assert lo == pytest.approx(0.3813, abs=1e-3) and hi == pytest.approx(0.6187, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_metric_modules_load_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = load_metric("math_accuracy")
    preds = [t for t, *_ in GSM8K_OUTPUTS]
    refs = [g for _, g, *_ in GSM8K_OUTPUTS]
    want = sum(ok for *_, ok in GSM8K_OUTPUTS)
    out = m.compute(predictions=preds, references=refs)
    assert out["correct"] == want == 21
    assert out["accuracy"] == pytest.approx(want / len(preds))
    assert out["answered"] == len(preds) - 2
    c = load_metric("choice_accuracy").compute(
        predictions=[t for t, *_ in CHOICE_OUTPUTS], references=[g for _, g, *_ in CHOICE_OUTPUTS]
    )
    assert c["correct"] == 6 and c["answered"] == 7
    with pytest.raises(ValueError, match="packaged metrics"):
        load_metric("accuracy")


def test_load_benchmark_local_files_subsets_and_templates(tmp_path, monkeypatch):
    # CommonsenseQA is not shipped: it comes from a local folder passed explicitly
    (tmp_path / "commonsenseqa_validation.jsonl").write_text(
        "".join(
            json.dumps(
                {"id": f"c{i}", "question": f"Where {i}?\nAnswer Choices: (A) bank (B) mall", "answer": "AB"[i % 2]}
            )
            + "\n"
            for i in range(3)
        )
    )
    monkeypatch.setenv("TOKENROUTER_DATA", str(tmp_path))
    for name in BENCHMARKS:
        b = load_benchmark(name, limit=3)
        assert len(b) == 3 and b.kind == ("choice" if name == "commonsenseqa" else "math")
        assert all(p.endswith(q) for p, q in zip(b.prompts, b.questions))
    g = load_benchmark("gsm8k", limit=2)
    assert g.ids == ["gsm8k-test-0000", "gsm8k-test-0001"] and g.answers[0] == "18"
    assert "The answer is N." in g.prompts[0]
    assert "\\boxed{}" in load_benchmark("math500", limit=1).prompts[0]
    s1, s2 = load_benchmark("gsm8k", limit=5, seed=1), load_benchmark("gsm8k", limit=5, seed=1)
    assert s1.ids == s2.ids != load_benchmark("gsm8k", limit=5, seed=2).ids
    assert load_benchmark("csqa", limit=1).answers[0] in "ABCDE"
    p = tmp_path / "mine.jsonl"
    p.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": i + 1}) + "\n" for i in range(4)))
    b = load_benchmark(p, template="Q: {question}")
    assert b.prompts == [f"Q: {i}+1?" for i in range(4)] and b.answers == ["1", "2", "3", "4"]
    assert b.ids == [f"mine-{i}" for i in range(4)]
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        load_benchmark("nope")
    with pytest.raises(ValueError, match="limit"):
        load_benchmark("gsm8k", limit=0)
    with pytest.raises(ValueError, match="question"):
        load_benchmark("gsm8k", template="no field")
