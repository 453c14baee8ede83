"""One set of flags for ``serve``, ``eval``, ``bench`` and ``train`` (``--model NAME=SOURCE``,
``--device``, ``--dtype``, ``--policy SPEC``, ``--policy-file``), and the options of the lm-eval
model: each takes effect (checked on what it built) or stops with a message naming it. Models
are tiny ones saved to folders (no hub)."""

import argparse
import csv
import json

import pytest
import torch

from ..helpers import save_tiny_pair

POLICY_FILE = """
from tokenrouter_sdk import Policy

class EveryOther(Policy):
    def __init__(self, start: int = 0):
        self.start = start

    def route(self, step):
        return step.models[(step.position + self.start) % 2]
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("cli_models"))


def model_flags(folders):
    return ["--model", f"small={folders[0]}", "--model", f"large={folders[1]}"]


def dtypes(router):
    return {n: r.dtype for n, r in router.engine.runners.items()}


# -- serve ---------------------------------------------------------------------------------------
def serve_args(argv):
    from tokenrouter_sdk.cli.serve import add_parser

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd", required=True))
    return p.parse_args(["serve", "--transport", "thread", *argv])


def test_serve_flags_take_effect(folders, tmp_path):
    pytest.importorskip("fastapi")
    from tokenrouter_sdk.cli.serve import build

    argv = [
        *model_flags(folders),
        "--dtype",
        "small=float64",
        "--device",
        "cpu",
        "--policy",
        "rstitch:tau=0.3,tau_back=0.02",
        "--kv-memory-fraction",
        "0.01",
    ]
    router, app, sock, _ = build(serve_args(argv))
    try:
        assert dtypes(router) == {"small": torch.float64, "large": torch.float32}  # per model; the other auto
        pol = app.state.tr.policy
        assert (type(pol).__name__, pol.tau, pol.tau_back) == ("RStitch", 0.3, 0.02)
        assert router.kv_sizing["large"].rule == "kv_memory_fraction" and router.kv_sizing["large"].fraction == 0.01
        assert app.state.tr.restarts.limit == 3  # a dead sub-server is restarted up to 3 times by default
    finally:
        sock.close()
        router.close()
    (tmp_path / "p.py").write_text(POLICY_FILE)
    router, app, sock, _ = build(
        serve_args(
            [*model_flags(folders), "--policy-file", f"{tmp_path / 'p.py'}:EveryOther", "--max-kv-tokens", "512"]
        )
    )
    try:
        assert type(app.state.tr.policy).__name__ == "EveryOther" and app.state.tr.policy_label == "EveryOther"
        assert router.engine.runners["small"].pool.capacity_tokens == 512
        assert {r.impl for r in router.engine.runners.values()} == {"native"}  # the default
    finally:
        sock.close()
        router.close()


def test_model_impl_flag_reaches_every_runner(folders):
    pytest.importorskip("fastapi")
    from tokenrouter_sdk.cli.serve import build

    router, app, sock, _ = build(
        serve_args([*model_flags(folders), "--model-impl", "transformers", "--max-kv-tokens", "512"])
    )
    try:
        assert {r.impl for r in router.engine.runners.values()} == {"transformers"}
    finally:
        sock.close()
        router.close()
    with pytest.raises(SystemExit):
        serve_args([*model_flags(folders), "--model-impl", "vllm"])


def test_kernels_flag_reaches_every_runner(folders):
    pytest.importorskip("fastapi")
    from tokenrouter_sdk.cli.serve import build

    router, app, sock, _ = build(serve_args([*model_flags(folders), "--kernels", "off", "--max-kv-tokens", "512"]))
    try:
        assert {r.kernels for r in router.engine.runners.values()} == {"off"}
    finally:
        sock.close()
        router.close()
    with pytest.raises(SystemExit):
        serve_args([*model_flags(folders), "--kernels", "flash"])
    from tokenrouter_sdk.cli.main import build_parser

    for argv in (["demo", "--kernels", "off"], ["bench", "--kernels", "wait"], ["eval", "--kernels", "off"]):
        assert build_parser().parse_args(argv).kernels == argv[-1]


def test_tp_flag_makes_the_model_tensor_parallel_loaded_from_its_folder(folders):
    pytest.importorskip("fastapi")
    from tokenrouter_sdk.backends.tensor_parallel import TensorParallelRunner
    from tokenrouter_sdk.cli.serve import build

    router, app, sock, _ = build(serve_args([*model_flags(folders), "--tp", "large=2", "--max-kv-tokens", "512"]))
    try:
        runner = router.engine.runners["large"]
        assert isinstance(runner, TensorParallelRunner) and runner.tp == 2
        assert runner.recipe.source == folders[1]  # the ranks load the folder, not a pickled model
        assert not isinstance(router.engine.runners["small"], TensorParallelRunner)
        out = router.generate([[5, 6, 7]], max_new_tokens=4, ignore_eos=True)[0]
        assert out.error is None and len(out.token_ids) == 4
    finally:
        sock.close()
        router.close()


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--mode", "async", "--thresholds", "small=2"], "--thresholds apply to --mode delayed"),
        (["--device", "small=cpu"], "per model needs --model"),
        (["--small-layers", "4", "--model", "small=x", "--model", "large=y"], "--small-layers"),
        (["--model", "small=a", "--model", "large=b", "--device", "huge=cpu"], "not models of --model"),
        (["--policy", "rstitch:speed=1"], "has no argument 'speed'"),
        (["--tp", "large=two"], "--tp takes NAME=RANKS"),
        (["--tp", "huge=2"], "--tp names"),
        (["--restart-limit", "-1"], "--restart-limit must be >= 0"),
    ],
)
def test_serve_bad_flags_stop_naming_them(argv, msg):
    pytest.importorskip("fastapi")
    from tokenrouter_sdk.cli.serve import build

    with pytest.raises(SystemExit, match=msg):
        build(serve_args(argv))


def test_a_cuda_device_on_a_cpu_only_torch_stops_with_the_install_command(folders, monkeypatch):
    pytest.importorskip("fastapi")
    from tokenrouter_sdk.cli.serve import build
    from tokenrouter_sdk.placement import cuda_install_command

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    with pytest.raises(SystemExit) as err:
        build(serve_args([*model_flags(folders), "--device", "cuda:1"]))
    assert "CPU-only build" in str(err.value) and cuda_install_command() in str(err.value)


# -- eval ----------------------------------------------------------------------------------------
def eval_args(argv):
    from tokenrouter_sdk.cli.eval import add_arguments

    return add_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_eval_runs_your_pair_with_a_registry_spec(folders, tmp_path):
    from tokenrouter_sdk.cli.eval import cmd_eval

    out = tmp_path / "eval"
    argv = [
        *model_flags(folders),
        "--dtype",
        "float64",
        "--device",
        "cpu",
        "--policy",
        "rstitch:tau_back=0.02",
        "--values",
        "0.3",
        "--limit",
        "1",
        "--max-new-tokens",
        "3",
        "--no-references",
        "--no-progress",
        "--concurrency",
        "1",
        "--out",
        str(out),
    ]
    assert cmd_eval(eval_args(argv)) == 0
    res = json.loads((out / "results.json").read_text())
    models = res["config"]["router"]["models"]
    assert {n: (m["dtype"], m["device"]) for n, m in models.items()} == {
        "small": ("float64", "cpu"),
        "large": ("float64", "cpu"),
    }
    assert folders[1] in models["large"]["name_or_path"]
    (params,) = [p["params"] for p in res["config"]["policies"].values()]
    assert (params["tau"], params["tau_back"]) == (0.3, 0.02)


def test_eval_sweeps_learned_heads_and_your_class(tmp_path):
    from tokenrouter_sdk.cli.eval import sweep

    factory, param, values = sweep(eval_args(["--pair", "smollm2", "--policy", "citer"]))  # the head's calibrated tau
    assert param == "tau" and values == [pytest.approx(factory(values[0]).tau)] and 0 < values[0] < 1
    factory, param, values = sweep(eval_args(["--policy", "rstitch:tau_back=0.05"]))
    assert values == [0.02, 0.05, 0.1, 0.2, 0.4] and factory(0.2).tau_back == 0.05 and factory(0.2).tau == 0.2
    (tmp_path / "p.py").write_text(POLICY_FILE)
    own = ["--policy-file", f"{tmp_path / 'p.py'}:EveryOther"]
    factory, param, values = sweep(eval_args([*own, "--param", "start", "--values", "0,1"]))
    assert [factory(v).start for v in values] == [0, 1] and type(factory(0)).__name__ == "EveryOther"
    pol, param, values = sweep(eval_args(own))  # nothing named to sweep: one point, the class as it is
    assert type(pol).__name__ == "EveryOther" and pol.start == 0 and (param, values) == (None, [None])
    with pytest.raises(SystemExit, match="--param"):
        sweep(eval_args([*own, "--values", "0,1"]))
    with pytest.raises(SystemExit, match="fixes tau"):
        sweep(eval_args(["--policy", "rstitch:tau=0.1", "--values", "0.2"]))


# -- bench ---------------------------------------------------------------------------------------
def test_bench_runs_your_pair_and_policies(folders, tmp_path):
    from tokenrouter_sdk.cli.common import load_models
    from tokenrouter_sdk.cli.main import build_parser, cmd_bench

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one two\nthree four\n")
    argv = [
        "bench",
        *model_flags(folders),
        "--dtype",
        "float64",
        "--policy",
        "large_only",
        "--policy",
        "rstitch:tau=0.3,tau_back=0.02",
        "--modes",
        "async",
        "--concurrency",
        "1",
        "--max-new-tokens",
        "3",
        "--no-baselines",
        "--transport",
        "thread",
        "--data",
        str(prompts),
        "--out",
        str(tmp_path / "b"),
    ]
    args = build_parser().parse_args(argv)
    models, _ = load_models(args, "tokenrouter bench")
    assert {n: m.dtype for n, m in models.items()} == {"small": torch.float64, "large": torch.float64}
    assert cmd_bench(args) == 0
    rows = list(csv.DictReader(open(tmp_path / "b.csv")))
    assert [r["policy"] for r in rows] == ["large_only", "rstitch:tau=0.3,tau_back=0.02"]
    assert float(rows[0]["large_fraction"]) == 1.0 and int(rows[0]["committed_tokens"]) == 6
    with pytest.raises(SystemExit, match="do not apply"):
        cmd_bench(build_parser().parse_args(["bench", "--backend", "sim", "--device", "cpu"]))
    with pytest.raises(SystemExit, match="unknown policy"):
        cmd_bench(build_parser().parse_args(["bench", "--policy", "fastest"]))
    for argv, msg in (
        (["--modes", "async", "--thresholds", "small=2"], "delayed cells"),
        (["--prompt-tokens", "64"], "--random-pair"),
        (["--random-pair", "qwen3-0.6b,qwen3-8b", "--data", "gsm8k"], "--data does not apply"),
    ):
        with pytest.raises(SystemExit, match=msg):
            cmd_bench(build_parser().parse_args(["bench", *argv]))


# -- train ---------------------------------------------------------------------------------------
def test_train_flags_reach_the_router_and_the_calibration(folders, monkeypatch):
    import tokenrouter_sdk.train as T
    import tokenrouter_sdk.train.package as P
    from tokenrouter_sdk.cli.main import build_parser
    from tokenrouter_sdk.cli.train import run

    seen = {}

    class Result:
        metrics = {"loss": 0.0}

    def fake_train(router, **kw):
        seen["dtypes"], seen["models"] = dtypes(router), list(router.models)
        return Result()

    def fake_finalize(res, router, **kw):
        seen["finalize"] = kw
        return "head.pt", "head.json", 0.5

    monkeypatch.setattr(T, "train_r2r", fake_train)
    monkeypatch.setattr(P, "finalize", fake_finalize)
    args = build_parser().parse_args(
        [
            "train",
            "r2r",
            *model_flags(folders),
            "--dtype",
            "large=float64",
            "--policy",
            "r2r:large=large",
            "--calibrate",
            "2",
        ]
    )
    assert run(args) == 0
    assert seen["dtypes"] == {"small": torch.float32, "large": torch.float64} and seen["models"] == ["small", "large"]
    assert seen["finalize"]["target"] == 0.7  # the packaged heads' large fraction is the default
    assert seen["finalize"]["policy_kwargs"] == {"large": "large"}
    for argv, msg in (
        (["--policy", "co_llm"], "runs in 'r2r'"),
        (["--policy", "r2r:tau=0.2"], "come from training"),
        (["--package", *model_flags(folders)], "--package"),
        (["--large-fraction", "1.5"], r"\(0, 1\)"),
        (["--rollouts", "2"], "--rollouts does not apply to r2r"),
    ):
        with pytest.raises(SystemExit, match=msg):
            run(build_parser().parse_args(["train", "r2r", *argv]))
    for kind, argv, msg in (
        ("citer", ["--max-new-tokens", "64"], "gold solutions"),
        ("query", ["--calibrate-tokens", "64"], "--calibrate-tokens does not apply to query"),
    ):
        with pytest.raises(SystemExit, match=msg):
            run(build_parser().parse_args(["train", kind, *argv]))


# -- the lm-eval model ---------------------------------------------------------------------------
def test_lm_eval_model_options_take_effect_or_raise(folders, pair, tok):
    pytest.importorskip("lm_eval")
    from tokenrouter_sdk import Router
    from tokenrouter_sdk.eval.lm_eval_model import TokenRouterLM
    from tokenrouter_sdk.placement import DeviceError

    base = f"small_model={folders[0]},large_model={folders[1]},dtype=float64,processes=False"
    lm = TokenRouterLM.create_from_arg_string(base, {"batch_size": 4, "device": "cpu"})
    try:
        assert lm.concurrency == 4 and dtypes(lm.router) == {"small": torch.float64, "large": torch.float64}
        with pytest.raises(ValueError, match="repetition_penalty"):
            lm._sampling({"until": ["\n"], "repetition_penalty": 1.1})
    finally:
        lm.close()
    if torch.version.cuda is None:  # what `lm_eval_cli --device cuda:1` gets on this build: an error, not the CPU
        with pytest.raises(DeviceError, match="CPU-only"):
            TokenRouterLM.create_from_arg_string(base, {"device": "cuda:1"})
    lm = TokenRouterLM.create_from_arg_string(base + ",small_device=cpu", {"batch_size": "auto", "max_batch_size": 8})
    assert lm.concurrency == 8
    lm.close()
    with pytest.raises(ValueError, match="max_batch_size"):
        TokenRouterLM.create_from_arg_string(base, {"batch_size": 2, "max_batch_size": 8})
    with Router(pair, tokenizer=tok) as r:
        with pytest.raises(ValueError, match="cannot apply"):
            TokenRouterLM(router=r, small_model=folders[0])
        with pytest.raises(ValueError, match="need a policy name"):
            TokenRouterLM(router=r, tau=0.1)
        assert TokenRouterLM(router=r).policy is r.policy and TokenRouterLM(router=r, concurrency=3).concurrency == 3
    with pytest.raises(ValueError, match="need small_model"):
        TokenRouterLM(small_device="cpu")
