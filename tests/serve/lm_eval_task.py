"""A local lm-evaluation-harness task over a local JSONL file (no hub): eight arithmetic
questions, generation with the chat template, scored by exact match of the last number."""

import json
from pathlib import Path

QUESTIONS = [
    ("What is 2 + 3?", 5),
    ("What is 7 + 5?", 12),
    ("What is 10 - 4?", 6),
    ("What is 3 times 3?", 9),
    ("What is 9 + 1?", 10),
    ("What is 6 + 2?", 8),
    ("What is 12 - 2?", 10),
    ("What is 4 + 4?", 8),
]

YAML = """task: arith8
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 24
  do_sample: false
  temperature: 0.0
filter_list:
  - name: last_number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(folder: Path) -> Path:
    """Write ``arith.jsonl`` and ``arith8.yaml`` into ``folder``; returns the folder (for
    lm-eval's ``--include_path``)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "arith.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": str(a)}) + "\n" for q, a in QUESTIONS))
    (folder / "arith8.yaml").write_text(YAML.format(data=data))
    return folder


CHOICES = [
    ("What is 2 + 3?", ["5", "7", "9"], 0),
    ("The sky on a clear day is", ["green", "blue", "red"], 1),
    ("What is 10 - 4?", ["4", "5", "6"], 2),
    ("A cat says", ["meow", "moo", "quack"], 0),
]

CHOICE_YAML = """task: choice4
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_choice_task(folder: Path) -> Path:
    """Write ``choice.jsonl`` and ``choice4.yaml`` (four three-way multiple-choice questions,
    scored by log-likelihood) into ``folder``; returns the folder (``--include_path``)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "choice.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in CHOICES))
    (folder / "choice4.yaml").write_text(CHOICE_YAML.format(data=data))
    return folder
