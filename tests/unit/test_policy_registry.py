"""Built-in policies by name with typed arguments (`tokenrouter_sdk.policies.registry`), the
operator's own class from a file, and the ``tokenrouter serve`` flags that use them."""

import pytest

from tokenrouter_sdk import Policy
from tokenrouter_sdk.cli.main import main
from tokenrouter_sdk.policies import (
    LargeOnly,
    RandomQueryRouting,
    RandomRouting,
    RStitch,
    SingleModel,
    SmallOnly,
    TokenEnsemble,
)
from tokenrouter_sdk.policies.registry import (
    PolicyRegistry,
    PolicySpecError,
    build_policy,
    builtin_registry,
    load_policy_class,
    parse_spec,
)


def test_builtin_names_build_the_right_classes():
    assert isinstance(build_policy("large_only"), LargeOnly) and isinstance(build_policy("small_only"), SmallOnly)
    assert isinstance(build_policy("RStitch"), RStitch)  # a class name works too
    p = build_policy("rstitch:tau=0.05,tau_back=0.2,signal=max_prob")
    assert (p.tau, p.tau_back, p.signal) == (0.05, 0.2, "max_prob") and isinstance(p.tau, float)
    p = build_policy("random:p=0.3,seed=7")
    assert isinstance(p, RandomRouting) and (p.p, p.seed) == (0.3, 7) and isinstance(p.seed, int)
    p = build_policy({"name": "random_query", "p": 1, "seed": 2})
    assert isinstance(p, RandomQueryRouting) and p.p == 1.0 and isinstance(p.p, float)
    assert build_policy("rstitch:tau_back=none").tau_back == 0.1  # None -> defaults to tau
    assert build_policy("single:model=large").model == "large" and isinstance(
        build_policy("single:model=x"), SingleModel
    )
    e = build_policy("ensemble:weights=[0.25,0.75],seed=3")
    assert isinstance(e, TokenEnsemble) and e.weights == [0.25, 0.75] and e.seed == 3
    assert build_policy({"name": "ensemble", "weights": {"small": 1, "large": 3}}).weights == {"small": 1, "large": 3}
    assert build_policy("glimprouter:stop_on_repeat=false,budget=none").stop_on_repeat is False
    names = builtin_registry().names()
    assert names[:4] == ["rstitch", "random", "large_only", "small_only"] and "citer" in names


@pytest.mark.parametrize(
    "spec,words",
    [
        ("nope", ["unknown policy 'nope'", "rstitch"]),
        ("rstitch:tau=abc", ["'tau'", "float", "'abc'"]),
        ("random:seed=1.5", ["'seed'", "int"]),
        ("rstitch:foo=1", ["no argument 'foo'", "tau, tau_back"]),
        ("rstitch:tau", ["not key=value"]),
        (":tau=1", ["empty policy name"]),
        ("single", ["needs argument(s) ['model']", "single:model="]),
        ("random:p=2", ["p must be in [0, 1]"]),
        ("glimprouter:stop_on_repeat=maybe", ["'stop_on_repeat'", "bool"]),
        ({"tau": 1}, ["needs a 'name'"]),
    ],
)
def test_bad_specs_name_the_problem(spec, words):
    with pytest.raises(PolicySpecError) as e:
        build_policy(spec)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_learned_policies_build_from_their_packaged_heads():
    for name, kind, cls in (
        ("citer", "citer", "CITER"),
        ("r2r", "r2r", "R2R"),
        ("co_llm", "co_llm", "CoLLM"),
        ("query_router", "query", "QueryRouter"),
    ):
        pol = build_policy(name)
        assert type(pol).__name__ == cls and pol.head.endswith(f"smollm2_{kind}_head.pt")
        assert len(repr(pol)) < 400  # the head's record stays out of the repr
        if kind != "query":
            assert pol.head_meta["kind"] == kind


def test_file_arguments_can_be_refused():
    reg = builtin_registry()
    with pytest.raises(PolicySpecError, match="names a file on the server"):
        reg.resolve("citer:head=/etc/passwd", allow_paths=False)
    with pytest.raises(PolicySpecError, match="names a file on the server"):
        reg.resolve({"name": "r2r", "head": "h.safetensors", "embedding": "x"}, allow_paths=False)
    entry, kw = reg.resolve("citer:head=/some/head.safetensors,tau=0.9")  # allowed for the operator
    assert kw == {"head": "/some/head.safetensors", "tau": 0.9}


def test_parse_spec_keeps_brackets_and_quotes_together():
    assert parse_spec('ensemble:weights={"a": 1, "b": 2},seed=1') == (
        "ensemble",
        {"weights": '{"a": 1, "b": 2}', "seed": "1"},
    )
    assert parse_spec("glimprouter:separator=',',theta=2") == ("glimprouter", {"separator": "','", "theta": "2"})


POLICY_FILE = '''
from tokenrouter_sdk import Policy

class EveryOther(Policy):
    """Writes even positions on the first model, odd ones on the last."""
    def __init__(self, offset: int = 0):
        self.offset = offset

    def route(self, step):
        return step.models[(step.position + self.offset) % 2]
'''


def test_policy_file_class_is_loaded_and_registered(tmp_path):
    path = tmp_path / "my_policy.py"
    path.write_text(POLICY_FILE)
    cls = load_policy_class(f"{path}:EveryOther")
    assert issubclass(cls, Policy) and cls.__name__ == "EveryOther"
    reg = PolicyRegistry()
    reg.add("every_other", cls)
    assert reg.build("every_other:offset=1").offset == 1
    assert reg.build("EveryOther").offset == 0
    with pytest.raises(PolicySpecError, match="has no class 'Missing'; its Policy classes: \\['EveryOther'\\]"):
        load_policy_class(f"{path}:Missing")
    with pytest.raises(PolicySpecError, match="does not exist"):
        load_policy_class(f"{tmp_path / 'nope.py'}:X")
    with pytest.raises(PolicySpecError, match="module.py:ClassName"):
        load_policy_class("just_a_name")
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(PolicySpecError, match="ModuleNotFoundError"):
        load_policy_class(f"{tmp_path / 'broken.py'}:X")


def test_serve_command_rejects_bad_flags_before_loading_models(tmp_path, capsys):
    pytest.importorskip("fastapi")
    with pytest.raises(SystemExit, match="--policy: unknown policy 'fastest'"):
        main(["serve", "--policy", "fastest"])
    with pytest.raises(SystemExit, match="--model takes NAME=SOURCE"):
        main(["serve", "--model", "small"])
    with pytest.raises(SystemExit, match="has no class 'Nope'"):
        (tmp_path / "p.py").write_text(POLICY_FILE)
        main(["serve", "--policy-file", f"{tmp_path / 'p.py'}:Nope"])
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--policy-file" in capsys.readouterr().out
