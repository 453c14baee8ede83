"""Benchmark data shipped with the package and the one loader every consumer uses
(tokenrouter_sdk.benchmarks): packaged files and their checksums, the source order, the same
questions and prompts for the demo, `tokenrouter bench`, evaluation and training on a fresh clone
(no local data folder), and the errors for bad input."""

import gzip
import hashlib
import json

import pytest

from tokenrouter_sdk import benchmarks as B

FIRST8_ANSWERS = ["18", "3", "70000", "540", "20", "64", "260", "160"]
FIRST8_IDS = [f"gsm8k-test-{i:04d}" for i in range(8)]


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch):
    """The environment of a fresh clone: no $TOKENROUTER_DATA, an empty `datasets` cache, and a
    working directory with nothing in it; returns a local data folder (not yet created) that only
    an explicit ``data_dir`` names."""
    import datasets.config

    empty = tmp_path / "nowhere" / "data"
    monkeypatch.delenv("TOKENROUTER_DATA", raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return empty


def test_packaged_gsm8k_train_file_matches_its_sha256_and_has_7473_rows(fresh_clone):
    spec = B.BENCHMARKS["gsm8k_train"]
    raw = gzip.decompress(spec.packaged.read_bytes())
    assert (
        hashlib.sha256(raw).hexdigest()
        == spec.sha256
        == "a7938272ceef0dc84175e722a99bf3d2b3014dba67cd270dd3ab25106806eae3"
    )
    rows = [json.loads(line) for line in raw.decode("utf-8").split("\n") if line]
    assert len(rows) == spec.rows == 7473 and len(B.load("gsm8k_train")) == 7473
    assert [r["id"] for r in rows] == [f"gsm8k-train-{i:04d}" for i in range(7473)]
    assert all(
        r["answer"] == r["meta"]["answer_raw"].replace(",", "") and "####" in r["meta"]["solution"] for r in rows
    )
    assert rows[0]["answer"] == "72" and rows[0]["question"].startswith("Natalia sold clips to 48 of her friends")
    test = {r["question"] for r in B.load("gsm8k").rows}
    assert not test & {r["question"] for r in rows}  # no question of the test split
    assert B.load("gsm8k-train").source == str(spec.packaged)


def test_packaged_gsm8k_file_matches_its_sha256_and_has_1319_rows():
    spec = B.BENCHMARKS["gsm8k"]
    assert spec.packaged is not None and spec.packaged.is_file()
    raw = gzip.decompress(spec.packaged.read_bytes())
    # the sha256 of the source JSONL (openai/grade-school-math test set as converted), stated in code
    assert (
        hashlib.sha256(raw).hexdigest()
        == spec.sha256
        == "31a83d6aa716809a11e017ae9c667b5db7d0cc68c21ab11f8b73444c8a6bf5d3"
    )
    rows = [json.loads(line) for line in raw.decode("utf-8").splitlines()]
    assert len(rows) == spec.rows == 1319
    assert [r["id"] for r in rows] == [f"gsm8k-test-{i:04d}" for i in range(1319)]
    assert all(
        set(r) == {"id", "question", "answer", "meta"} and r["answer"] and "####" in r["meta"]["solution"] for r in rows
    )
    assert (B.PACKAGED_DIR / "LICENSE").is_file() and "OpenAI" in (B.PACKAGED_DIR / "LICENSE").read_text()
    assert "3101c7d5072418e28b9008a6636bde82a006892c" in (B.PACKAGED_DIR / "README.md").read_text()


@pytest.mark.parametrize("name", ["math500", "aime24", "amc23"])
def test_other_packaged_math_sets(name):
    spec = B.BENCHMARKS[name]
    raw = gzip.decompress(spec.packaged.read_bytes())
    assert hashlib.sha256(raw).hexdigest() == spec.sha256
    data = B.load(name)
    assert len(data) == spec.rows and data.source == str(spec.packaged)
    assert len(set(data.ids)) == len(data) and all(data.answers)


def test_commonsenseqa_is_not_shipped():
    spec = B.BENCHMARKS["commonsenseqa"]
    assert spec.packaged is None and spec.sha256 is None
    assert not list(B.PACKAGED_DIR.glob("commonsense*"))


def test_fresh_clone_demo_bench_eval_and_training_get_the_same_first_8_questions(fresh_clone):
    from tokenrouter_sdk.cli.main import build_parser, demo_prompts
    from tokenrouter_sdk.eval import load_benchmark
    from tokenrouter_sdk.train.data import as_examples, load_examples

    demo, shown, source = demo_prompts(None, None, 8)  # tokenrouter demo
    args = build_parser().parse_args(["bench"])
    bench = B.load_prompts(args.data or "gsm8k", 8)  # tokenrouter bench (its first 8)
    ev = load_benchmark("gsm8k", limit=8)  # tokenrouter_sdk.eval
    tr = load_examples("gsm8k", limit=8, exclude_heldout=False)  # tokenrouter_sdk.train on the test split
    assert str(B.BENCHMARKS["gsm8k"].packaged) in source and ev.source == str(B.BENCHMARKS["gsm8k"].packaged)
    assert ev.ids == [e.id for e in tr] == FIRST8_IDS
    assert ev.answers == [e.answer for e in tr] == FIRST8_ANSWERS
    assert shown == ev.questions and ev.questions[0].startswith("Janet’s ducks lay 16 eggs per day.")
    # one template per benchmark: every consumer sends the same text
    assert (
        demo
        == bench
        == ev.prompts
        == [e.prompt for e in tr]
        == [B.GSM8K_TEMPLATE.format(question=q) for q in ev.questions]
    )
    assert as_examples([{"question": ev.questions[0]}])[0].prompt == ev.prompts[0]
    assert all(e.solution.endswith(f"The answer is {e.answer}.") for e in tr)


def test_training_holds_out_the_first_128_gsm8k_questions(fresh_clone):
    from tokenrouter_sdk.train.data import HELDOUT, HELDOUT_IDS, load_examples

    assert HELDOUT == 128 and HELDOUT_IDS == {f"gsm8k-test-{i:04d}" for i in range(128)}
    assert [e.id for e in load_examples("gsm8k", limit=2)] == ["gsm8k-test-0128", "gsm8k-test-0129"]
    assert len(load_examples("gsm8k")) == 1319 - 128
    held = load_examples("gsm8k", limit=HELDOUT, exclude_heldout=False)
    assert [e.id for e in held] == sorted(HELDOUT_IDS)


def test_source_order_explicit_then_packaged(tmp_path, monkeypatch, fresh_clone):
    row = {"id": "gsm8k-test-0000", "question": "local?", "answer": "1", "meta": {}}
    csqa = {"id": "c0", "question": "Where?\nAnswer Choices: (A) bank (B) mall", "answer": "A"}
    # a data folder beside the working directory is never searched unless named
    beside = tmp_path / "shared" / "data"
    beside.mkdir(parents=True)
    (beside / "gsm8k_test.jsonl").write_text(json.dumps(row) + "\n")
    (beside / "commonsenseqa_validation.jsonl").write_text(json.dumps(csqa) + "\n")
    assert B.load("gsm8k", 1).questions != ["local?"]
    with pytest.raises(FileNotFoundError):
        B.load("csqa")
    # a benchmark that is not shipped loads from a folder passed explicitly
    assert B.load("csqa", data_dir=beside).source == str((beside / "commonsenseqa_validation.jsonl").resolve())
    # a local folder passed explicitly (argument or $TOKENROUTER_DATA) and an explicit path come first
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "gsm8k_test.jsonl").write_text(json.dumps(row | {"question": "mine?"}) + "\n")
    assert B.load("gsm8k", data_dir=mine).questions == ["mine?"]
    monkeypatch.setenv("TOKENROUTER_DATA", str(mine))
    assert B.load("gsm8k").questions == ["mine?"]
    assert B.load("math500", 1).source == str(B.BENCHMARKS["math500"].packaged)  # not in that folder
    gz = tmp_path / "q.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"question": "a?", "answer": 2}\n\n{"question": "b?", "answer": "3"}\n'))
    d = B.load(gz)
    assert (d.ids, d.answers, d.spec.template) == (["q-0", "q-1"], ["2", "3"], B.MATH_TEMPLATE)
    assert B.load("gsm8k", path=gz).prompts == [
        B.GSM8K_TEMPLATE.format(question="a?"),
        B.GSM8K_TEMPLATE.format(question="b?"),
    ]


def test_datasets_cache_is_read_offline_and_mapped(monkeypatch, fresh_clone):
    import datasets
    import datasets.config

    seen, before = {}, datasets.config.HF_HUB_OFFLINE

    def fake_load_dataset(path, config=None, split=None):
        seen.update(path=path, config=config, split=split, offline=datasets.config.HF_HUB_OFFLINE)
        return datasets.Dataset.from_list([{"question": "How many?", "answer": "4 * 400 = 1,600\n#### 1,600"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(B, "PACKAGED_DIR", fresh_clone / "not_installed")  # as if the files were missing
    d = B.load("gsm8k")
    assert seen == {"path": "openai/gsm8k", "config": "main", "split": "test", "offline": True}
    assert datasets.config.HF_HUB_OFFLINE == before  # restored after the read
    assert d.source == "datasets-cache:openai/gsm8k"
    assert d.rows == [
        {
            "id": "gsm8k-test-0000",
            "question": "How many?",
            "answer": "1600",
            "meta": {"index": 0, "solution": "4 * 400 = 1,600\n#### 1,600", "answer_raw": "1,600"},
        }
    ]


def test_errors_name_the_problem_and_the_fix(tmp_path, monkeypatch, fresh_clone):
    with pytest.raises(
        ValueError,
        match=r"unknown benchmark 'gsm9k': use one of gsm8k, gsm8k_train, math500, aime24, amc23, "
        r"commonsenseqa",
    ):
        B.load("gsm9k")
    with pytest.raises(FileNotFoundError) as e:
        B.load("commonsenseqa")  # not shipped, no local copy, nothing cached
    msg = str(e.value)
    assert "tried:" in msg and "datasets cache of 'tau/commonsense_qa'" in msg and "shared" not in msg
    assert "not shipped" in msg and "path=" in msg and "data_dir=" in msg
    with pytest.raises(FileNotFoundError, match="no_such.jsonl"):
        B.load(tmp_path / "no_such.jsonl")
    with pytest.raises(ValueError, match="limit"):
        B.load("gsm8k", 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n{"prompt": "no question"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2 has no 'question' field"):
        B.load(bad)
    with pytest.raises(ValueError, match=r"\{question\}"):
        B.load_prompts("gsm8k", 2, template="no field")
    # a damaged or edited shipped file is refused
    broken = tmp_path / "pkg"
    broken.mkdir()
    spec = B.BENCHMARKS["gsm8k"]
    raw = gzip.decompress(spec.packaged.read_bytes()).replace(b'"answer": "18"', b'"answer": "19"', 1)
    (broken / spec.packaged.name).write_bytes(gzip.compress(raw))
    monkeypatch.setattr(B, "PACKAGED_DIR", broken)
    with pytest.raises(ValueError, match="sha256 .* does not match .* reinstall"):
        B.load("gsm8k", 1)


def test_load_prompts_text_files_and_templates(tmp_path):
    (tmp_path / "q.jsonl").write_text('{"question": "Q1"}\n\n{"question": "Q2"}\n{"question": "Q3"}\n')
    (tmp_path / "q.txt").write_text("first prompt\n\nsecond\n")
    assert B.load_prompts(tmp_path / "q.jsonl", 2, template="I: {question}") == ["I: Q1", "I: Q2"]
    assert B.load_prompts(tmp_path / "q.jsonl", 1) == [B.MATH_TEMPLATE.format(question="Q1")]
    assert B.load_prompts(tmp_path / "q.txt") == ["first prompt", "second"]
    assert B.load_prompts("aime", 1)[0].startswith(
        "Solve the following problem step by step. Put your final answer within \\boxed{}."
    )
    assert B.get_spec("CSQA") is B.BENCHMARKS["commonsenseqa"] and B.get_spec("gsm8k").kind == "math"


def test_packaged_gold_answers_are_accepted_by_the_answer_check():
    """Every gold answer of the shipped math sets, written as a model would (boxed, or after
    'The final answer is' in $...$), is read back and judged correct."""
    from tokenrouter_sdk.eval.answers import is_correct

    bad = []
    for name in ("math500", "aime24", "amc23"):
        for gold in B.load(name).answers:
            for text in (f"So the answer is $\\boxed{{{gold}}}$.", f"The final answer is ${gold}$."):
                if not is_correct(text, gold):
                    bad.append((name, text))
    assert not bad, bad[:10]


def test_every_command_defaults_to_the_self_draft_pair():
    from tokenrouter_sdk.cli.main import build_parser
    from tokenrouter_sdk.models import describe_default_pair

    p = build_parser()
    for argv in (["demo"], ["bench"], ["eval"], ["train", "r2r"]):
        assert p.parse_args(argv).small_layers is None, argv
        assert p.parse_args(argv + ["--small-layers", "10"]).small_layers == 10
    assert describe_default_pair() == (
        "pair: small = self-draft (12 shared + 2 distilled layers) of "
        "SmolLM2-135M-Instruct, large = SmolLM2-135M-Instruct"
    )
    assert describe_default_pair(10) == (
        "pair: small = first 10 layers of SmolLM2-135M-Instruct (plain truncation), large = SmolLM2-135M-Instruct"
    )
