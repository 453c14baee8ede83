"""The command line's edges: per-policy sweep arguments in ``tokenrouter eval`` beside the
``name:fixed=arg`` and ``@V1,V2`` forms, policies without arguments, a bad ``--dataset`` stopped
in one line before any model loads, defaults shown by ``eval --help``, Ctrl-C on ``tokenrouter
serve`` without a traceback, the in-process lm-eval command on a CPU machine with lm-eval's
default device and the routing numbers in its console output, and a Router given the larger
model first."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import warnings

import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_model, truncate

from ..helpers import save_tiny_pair


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("edge_models"))


def eval_args(argv):
    from tokenrouter_sdk.cli.eval import add_arguments

    return add_arguments(argparse.ArgumentParser()).parse_args(argv)


def by_name(argv):
    from tokenrouter_sdk.cli.eval import sweeps

    return {name: (factory, param, values) for name, factory, param, values in sweeps(eval_args(argv))}


# -- per-policy sweeps ---------------------------------------------------------------------------
def test_each_policy_sweeps_its_own_argument():
    got = by_name(
        [
            "--policy",
            "r2r_entropy:threshold=0.1,0.3",
            "--policy",
            "rstitch:tau=0.05,0.1,0.2,tau_back=0.02",
            "--policy",
            "random@0.2,0.4",
        ]
    )
    f, param, values = got["r2r_entropy"]
    assert param == "threshold" and values == [0.1, 0.3] and f(0.3).threshold == 0.3
    f, param, values = got["rstitch"]
    assert param == "tau" and values == [0.05, 0.1, 0.2]
    assert (f(0.1).tau, f(0.1).tau_back) == (0.1, 0.02)  # tau swept, tau_back fixed
    assert got["random"][1:] == ("p", [0.2, 0.4])
    # --param/--values apply to the specs that sweep nothing of their own
    got = by_name(["--policy", "rstitch:tau=0.1,0.2", "--policy", "random", "--values", "0.3"])
    assert got["rstitch"][1:] == ("tau", [0.1, 0.2]) and got["random"][1:] == ("p", [0.3])
    for argv, msg in (
        (["--policy", "rstitch:tau=0.1,0.2,tau_back=0.01,0.02"], "several values"),
        (["--policy", "rstitch:threshold=0.1,0.2"], "no argument 'threshold'"),
        (["--policy", "rstitch:tau=0.1,0.2@0.3"], "not both"),
        (["--policy", "rstitch:tau=low,high"], "must be numbers"),
        (["--policy", "large_only@0.1,0.2"], "no known swept argument"),
    ):
        with pytest.raises(SystemExit, match=msg):
            by_name(argv)


def test_policies_without_arguments_run_as_one_point(folders, tmp_path):
    from tokenrouter_sdk.cli.eval import cmd_eval
    from tokenrouter_sdk.policies import LargeOnly

    got = by_name(["--policy", "large_only", "--policy", "rstitch@0.3"])
    pol, param, values = got["large_only"]
    assert isinstance(pol, LargeOnly) and param is None and values == [None]
    (tmp_path / "p.py").write_text(
        "from tokenrouter_sdk import Policy\n\nclass Mine(Policy):\n"
        "    def __init__(self, start: int = 0):\n        self.start = start\n"
    )
    own = ["--policy-file", f"{tmp_path / 'p.py'}:Mine"]
    pol, param, values = by_name(own)["Mine"]  # an argument, none named to sweep: the class as it is
    assert type(pol).__name__ == "Mine" and pol.start == 0 and (param, values) == (None, [None])
    assert by_name([*own, "--param", "start", "--values", "0,1"])["Mine"][1:] == ("start", [0.0, 1.0])
    with pytest.raises(SystemExit, match="--param"):
        by_name([*own, "--values", "0,1"])  # values for an argument it cannot guess
    out = tmp_path / "eval"
    argv = [
        "--model",
        f"small={folders[0]}",
        "--model",
        f"large={folders[1]}",
        "--dtype",
        "float64",
        "--policy",
        "large_only",
        "--policy",
        "rstitch:tau=0.3,0.6",
        "--limit",
        "2",
        "--max-new-tokens",
        "3",
        "--references",
        "large_only,small_only",
        "--no-progress",
        "--concurrency",
        "2",
        "--repeats",
        "1",
        "--transport",
        "thread",
        "--out",
        str(out),
    ]
    assert cmd_eval(eval_args(argv)) == 0
    recs = {r["label"]: r for r in json.loads((out / "results.json").read_text())["records"]}
    assert list(recs) == ["large_only", "small_only", "large_only (policy)", "rstitch(tau=0.3)", "rstitch(tau=0.6)"]
    mine = recs["large_only (policy)"]
    assert mine["kind"] == "sweep" and mine["large_fraction"] == 1.0 and mine["param"] is None


# -- eval's inputs and help ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "dataset,msg", [("", "--dataset is empty"), ("/nonexistent/q.jsonl", "not found"), ("gsm9k", "unknown benchmark")]
)
def test_a_bad_dataset_stops_in_one_line_before_any_model_loads(dataset, msg, tmp_path, monkeypatch):
    import tokenrouter_sdk.eval as E
    import tokenrouter_sdk.router as R
    from tokenrouter_sdk.cli.eval import cmd_eval

    def no_models(*a, **k):
        raise AssertionError("a model was loaded before the dataset was checked")

    monkeypatch.setattr(R.Router, "default", classmethod(no_models))
    monkeypatch.setattr(E, "evaluate_policy", no_models)
    with pytest.raises(SystemExit) as e:
        cmd_eval(eval_args(["--dataset", dataset, "--no-progress", "--out", str(tmp_path)]))
    text = str(e.value)
    assert text.startswith("tokenrouter eval: ") and msg in text and "\n" not in text
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="no rows"):
        cmd_eval(eval_args(["--dataset", str(empty), "--no-progress", "--out", str(tmp_path)]))


def test_eval_help_shows_the_defaults():
    from tokenrouter_sdk.cli.eval import add_arguments

    text = " ".join(add_arguments(argparse.ArgumentParser(prog="tokenrouter eval")).format_help().split())
    assert "--max-new-tokens MAX_NEW_TOKENS tokens generated per question at most (default 256)" in text
    assert "--concurrency CONCURRENCY requests in flight per point (default 16)" in text
    assert "NAME:ARG=V1,V2" in text


# -- serve: Ctrl-C ---------------------------------------------------------------------------------
@pytest.mark.xfail(
    strict=False,
    reason="known: in the full suite from a fresh clone the server sometimes does not "
    "stop within 60 s of one SIGINT to its process group (it passes alone); "
    "not yet found",
)
def test_ctrl_c_stops_the_server_without_a_traceback(folders):
    pytest.importorskip("fastapi")
    env = {k: v for k, v in os.environ.items() if k != "TOKENROUTER_PROCESSES"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["PYTHONFAULTHANDLER"] = "1"  # a SIGABRT then prints every thread's stack (where a stop hangs)
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenrouter_sdk.cli",
            "serve",
            "--model",
            f"small={folders[0]}",
            "--model",
            f"large={folders[1]}",
            "--transport",
            "thread",
            "--max-kv-tokens",
            "512",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        line = p.stdout.readline()
        assert line.startswith("tokenrouter serve: http://127.0.0.1:"), (line, p.stderr.read() if p.poll() else "")
        url = line.split()[2]
        deadline = time.monotonic() + 60
        while True:  # Ctrl-C on a server that serves (the URL is printed just before uvicorn starts)
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server never answered /health"
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole process group
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGABRT)
            out, err = p.communicate(timeout=30)
            why = f"the server did not stop within 60 s of Ctrl-C; its threads then:\n{err[-6000:]}"
            warnings.warn(why, stacklevel=1)  # the warnings summary shows it even while the test is a known failure
            pytest.fail(why)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "tokenrouter serve: stopped (Ctrl-C)"


# -- lm-eval in-process on the CPU -----------------------------------------------------------------
def test_lm_eval_command_runs_on_the_cpu_and_prints_the_routing(folders, tmp_path):
    pytest.importorskip("lm_eval")
    from tests.serve.lm_eval_task import write_task

    task = write_task(tmp_path / "arith8")
    env = {k: v for k, v in os.environ.items() if k != "TOKENROUTER_PROCESSES"}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        HF_DATASETS_CACHE=str(tmp_path / "hf_datasets"),
    )
    args = [
        sys.executable,
        "-m",
        "tokenrouter_sdk.cli.lm_eval",
        "--model",
        "tokenrouter",
        "--model_args",
        f"small_model={folders[0]},large_model={folders[1]},policy=random,p=0.5,processes=False,max_gen_toks=4",
        "--tasks",
        "arith8",
        "--include_path",
        str(task),
        "--limit",
        "2",
        "--batch_size",
        "2",
    ]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DeviceError" not in r.stderr and "cuda" not in r.stderr.lower()
    tail = r.stdout[r.stdout.index("tokenrouter routing") :]
    head, _, row = tail.splitlines()[1:4]
    cells = dict(zip(head.strip("|").split("|"), row.strip("|").split("|")))
    assert cells["requests"] == "2" and cells["failed"] == "0" and cells["policy"].startswith("RandomRouting")
    assert 0.0 <= float(cells["hop rate"]) and 0.0 < float(cells["large share"]) < 1.0
    assert 0 < int(cells["committed tokens"]) <= 2 * 24  # the task asks for 24 tokens at most
    from tokenrouter_sdk.cli.lm_eval import device_args

    assert device_args(["--model", "tokenrouter"]) == ["--model", "tokenrouter", "--device", "cpu"]
    assert device_args(["--model", "tokenrouter", "--device", "cuda"]) == ["--model", "tokenrouter", "--device", "cuda"]
    assert device_args(["ls", "tasks"]) == ["ls", "tasks"]


def test_lm_eval_model_args_device_wins_over_lm_evals_device(folders):
    pytest.importorskip("lm_eval")
    from tokenrouter_sdk.eval.lm_eval_model import TokenRouterLM

    args = f"small_model={folders[0]},large_model={folders[1]},dtype=float64,processes=False,device=cpu"
    lm = TokenRouterLM.create_from_arg_string(args, {"device": "cuda:0", "batch_size": 2})
    try:
        assert {str(r.device) for r in lm.router.engine.runners.values()} == {"cpu"} and lm.concurrency == 2
    finally:
        lm.close()


# -- the models' order -----------------------------------------------------------------------------
def test_a_router_given_the_larger_model_first_warns(tok):
    large = tiny_model(num_layers=3, seed=2)
    small = truncate(large, 1)
    with pytest.warns(UserWarning, match=r"'big' \(.*M parameters\) comes before the smaller 'small'"):
        Router({"big": large, "small": small}, tokenizer=tok).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Router({"small": small, "big": large}, tokenizer=tok).close()
        Router({"a": large, "b": large}, tokenizer=tok).close()  # one size: nothing to say
