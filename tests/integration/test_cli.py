"""The `tokenrouter` command: marker formatting (cheap, tiny tokenizer) and a real demo run."""

import subprocess
import sys
from pathlib import Path

import pytest

from tokenrouter_sdk.cli.main import RESET, format_output, load_prompts, main
from tokenrouter_sdk.models import tiny_tokenizer
from tokenrouter_sdk.request import RequestOutput


def _out(tok, pieces):
    ids, models = [], []
    for model, text in pieces:
        t = tok.encode(text, add_special_tokens=False)
        ids += t
        models += [model] * len(t)
    return RequestOutput(rid=0, prompt="p", token_ids=ids, token_models=models, finish_reason="eos")


def test_markers_and_colours():
    tok = tiny_tokenizer()
    out = _out(tok, [("small", "7 + 5"), ("large", " = 12"), ("small", ". Done")])
    out.token_ids.append(tok.eos_token_id)  # special tokens are not shown
    out.token_models.append("small")
    assert format_output(out, tok, ["small", "large"], color=False) == "[S:7 + 5][L: = 12][S:. Done]"
    col = format_output(out, tok, ["small", "large"], color=True)
    assert col == f"\033[36m7 + 5{RESET}\033[33m = 12{RESET}\033[36m. Done{RESET}"


def test_multibyte_char_split_across_models():
    tok = tiny_tokenizer()  # one token per byte: "é" is two tokens, here written by two models
    b = "é".encode()
    out = RequestOutput(
        rid=0, prompt="p", token_ids=[ord("a"), b[0], b[1], ord("b")], token_models=["small", "small", "large", "large"]
    )
    text = format_output(out, tok, ["small", "large"], color=False)
    assert text.replace("[S:", "").replace("[L:", "").replace("]", "") == "aéb", text


def test_load_prompts(tmp_path):
    (tmp_path / "q.jsonl").write_text('{"question": "Q1"}\n\n{"question": "Q2"}\n{"question": "Q3"}\n')
    (tmp_path / "q.txt").write_text("first prompt\nsecond\n")
    assert load_prompts(tmp_path / "q.jsonl", 2, template="I: {question}") == ["I: Q1", "I: Q2"]
    assert load_prompts(tmp_path / "q.txt", 8) == ["first prompt", "second"]


def test_info(capsys):
    assert main(["info"]) == 0
    assert "torch threads" in capsys.readouterr().out


@pytest.mark.integration
def test_demo_subprocess():
    exe = Path(sys.executable).parent / "tokenrouter"
    r = subprocess.run(
        [
            str(exe),
            "demo",
            "--pair",
            "smollm2",
            "--prompt",
            "What is 7 + 5?",
            "-n",
            "1",
            "--max-new-tokens",
            "16",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "[S:" in out or "[L:" in out, out
    assert "\033[" not in out
    for field in ("throughput_tok_s", "hop_rate", "large_fraction", "committed_tokens", "finish="):
        assert field in out, out
    assert "committed_tokens     16" in out or "finish=eos" in out, out
    # the comparison table: large-only, small-only and routed, with throughput ratio, large share,
    # hop rate and answer agreement with large-only
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("run ") and "vs large" in line)
    assert lines[head].split() == [
        "run",
        "correct",
        "tok/s",
        "vs",
        "large",
        "large",
        "share",
        "hop",
        "rate",
        "agree",
        "w/",
        "large",
        "tokens",
        "wall",
        "s",
        "tok/cpu-s",
    ], lines[head]
    rows = {cells[0]: cells for cells in (line.split() for line in lines[head + 2 : head + 5])}
    assert list(rows) == ["large-only", "small-only", "routed"], lines[head : head + 5]
    for cells in rows.values():
        correct, tok_s, ratio, share, hop, agree, tokens, wall = cells[1:9]
        assert correct == "-"  # a prompt of one's own has no reference answer
        assert float(tok_s) > 0 and float(wall) > 0 and 1 <= int(tokens) <= 16
        # the ratio is computed from unrounded throughputs: it must lie within what the printed
        # one-decimal throughputs (each +-0.05) and its own two decimals (+-0.005) allow
        a, b, x = float(tok_s), float(rows["large-only"][2]), float(ratio[:-1])
        assert ratio.endswith("x") and (a - 0.05) / (b + 0.05) - 0.005 <= x <= (a + 0.05) / max(b - 0.05, 1e-9) + 0.005
        assert agree.endswith("/1") and 0 <= float(hop) <= 2
    assert rows["large-only"][3:5] == ["1.00x", "100%"] and rows["large-only"][6] == "1/1"
    assert rows["small-only"][4] == "0%" and rows["small-only"][5] == "0.000"
    assert "=== step accounting" in out and "routed      [small] steps=" in out, out
    assert "large-only answer=" in out, out


@pytest.mark.timeout(600)
def test_eval_shards_launched_locally_and_merged(tmp_path):
    """``tokenrouter eval --shards 2``: two local processes, each with its own Router of the
    packaged pair, then the merge (that a merge equals the unsharded sweep is checked on tiny
    models in tests/unit/test_eval_shards.py)."""
    import json

    out = tmp_path / "sharded"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenrouter_sdk.cli",
            "eval",
            "--pair",
            "smollm2",
            "--values",
            "0.3",
            "--limit",
            "2",
            "--max-new-tokens",
            "6",
            "--references",
            "large_only",
            "--no-progress",
            "--concurrency",
            "2",
            "--repeats",
            "1",
            "--shards",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 points from 2 shards merged" in r.stdout
    recs = json.loads((out / "results.json").read_text())["records"]
    assert [x["label"] for x in recs] == ["large_only", "RStitch(tau=0.3)"] and recs[1]["agreement"] is not None
    assert sorted(p.name for p in (out / "shards").glob("*.json")) == ["shard-1-of-2.json", "shard-2-of-2.json"]
