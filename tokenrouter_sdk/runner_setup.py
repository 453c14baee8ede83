"""The runners of a Router's models: each model loaded from its source (or taken as given: a
loaded model, a runner object), checked against the device, dtype and tensor-parallel settings
asked for, its KV pool sized (`tokenrouter_sdk.kv_sizing`), and made a `TorchRunnerSpec` (built
where its sub-server runs), a `TensorParallelRunner`, or kept as the runner object given; a
`ModelSpec` with ``runner="vllm"`` or ``"sglang"`` becomes that engine's runner spec (the model
is loaded by the engine where its sub-server runs, never here: only its tokenizer and config are
read here); or, for ``backend="sim"``, a `SimRunner` per latency model."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .engine.config import EngineConfig
from .engine.runner import Runner
from .request import token_ids


@dataclass
class RunnerSetup:
    """What `build_runners` (or `sim_runners`) made.

    Attributes:
        runners: model name -> runner object or `RunnerSpec`, in the models' order.
        eos_ids: end-of-sequence ids the models declare (generation configs, runner objects).
        tokenizer: the Router's tokenizer (the one given, else the first model's; the last
            model's when the models do not share one).
        kv_sizing: model name -> `tokenrouter_sdk.kv_sizing.KVSizing` (how its pool was sized).
        models: model name -> the loaded model (or the runner object given).
        text: the models' `Vocabularies` when they do not share a tokenizer, else None.
    """

    runners: dict
    eos_ids: list[int]
    tokenizer: Any
    kv_sizing: dict
    models: dict
    text: Any = None


def per_model(value, names: list[str], what: str) -> dict:
    """``value`` (one for all, or a dict name -> value) as a dict over ``names`` (None where
    not given).

    Raises:
        ValueError: a dict naming a model that is not there.
    """
    if isinstance(value, Mapping):
        bad = sorted(set(value) - set(names))
        if bad:
            raise ValueError(f"{what} names model(s) {bad} that the Router does not have; its models are {names}")
        return {n: value.get(n) for n in names}
    return {n: value for n in names}


def start_ranks(runners: dict) -> None:
    """Start the ranks of the tensor-parallel runners (rank 0 here); on a failure, stop the
    ones already started and raise."""
    from .backends.tensor_parallel import TensorParallelRunner

    tps = [r for r in runners.values() if isinstance(r, TensorParallelRunner)]
    try:
        for r in tps:
            r.start()
    except BaseException:
        for r in tps:
            r.release()
        raise


def build_runners(models: dict, tokenizer, config: EngineConfig, dtype, device, tp=None) -> RunnerSetup:
    """The runners of ``models`` (name -> source, `ModelSpec`, loaded model, ``(model,
    tokenizer)`` or runner object), loaded and placed as the Router's arguments ask.

    Raises:
        ValueError: a setting that does not apply to a model (device or dtype of a loaded model
            or runner, tp of a runner, KV sizes with runner objects only), a missing tokenizer.
        TokenizerBytesError: models with different tokenizers, one of which cannot be read as
            bytes (`tokenrouter_sdk.byte_vocab.ByteVocab`; names the models and the problem).
        Exception: what loading a model or checking it for the runner raises
            (`tokenrouter_sdk.models.ModelLoadError`, `UnsupportedAttention`).
    """
    from .backends.torch_runner import TorchRunner, TorchRunnerSpec
    from .deferred import DeferredModel, deferrable
    from .kv_sizing import KVSizing, plan
    from .models import load_model, same_tokenizer
    from .placement import AUTO, ModelSpec, resolve_device, resolve_dtype

    names = list(models)
    devices, dtypes = per_model(device, names, "device"), per_model(dtype, names, "dtype")
    tps = per_model(tp, names, "tp")
    loaded, toks, runners, eos, folders = {}, {}, {}, [], {}
    engines = {}
    own_eos: dict[str, list[int]] = {n: [] for n in names}
    for name, m in models.items():
        spec = ModelSpec.of(m)
        if spec is not None and spec.runner != "torch":
            tp_here = spec.tp if spec.tp is not None else tps[name]
            engines[name], tok, ids = engine_runner_spec(
                name, spec, devices[name], dtypes[name], tp_here, config, with_tokenizer=tokenizer is None
            )
            if tok is not None:
                toks[name] = tok
            eos += ids
            own_eos[name] += ids
            continue
        if spec is not None and spec.tp is not None:
            tps[name] = spec.tp
        if spec is not None and spec.loaded:
            if spec.device is not None or spec.dtype is not None:
                raise ValueError(
                    f"model '{name}': ModelSpec of a loaded model takes no device or dtype (it "
                    f"stays where it is); give its source to load it elsewhere"
                )
            m, spec = spec.source, None
        if spec is not None:
            dev, dt = spec.placed(devices[name], dtypes[name])
            folder = deferrable(spec.source, spec.gguf_file, tps[name])
            if folder is not None:  # loaded by its sub-server, where it runs
                loaded[name] = deferred_model(folder, dt, dev)
                toks[name] = load_tokenizer(folder)
                continue
            m, toks[name] = load_model(spec.source, device=dev, dtype=dt, gguf_file=spec.gguf_file)
            loaded[name] = m
            src = os.path.expanduser(str(spec.source))
            if spec.gguf_file is None and os.path.isfile(os.path.join(src, "config.json")):
                folders[name] = src  # the ranks of a tensor-parallel model load it from here
            continue
        if isinstance(m, tuple):  # (model, its tokenizer)
            m, toks[name] = m
        elif not isinstance(m, Runner) and tokenizer is None:
            raise ValueError(f"model '{name}' was given as an object: pass tokenizer=... too")
        here = m.device if isinstance(m, Runner) else next(m.parameters()).device
        have = getattr(m, "dtype", None) if isinstance(m, Runner) else next(m.parameters()).dtype
        if devices[name] is not None and resolve_device(devices[name]) != torch.device(here):
            raise ValueError(
                f"device={devices[name]!r} was given, but model '{name}' is a loaded "
                f"{'runner' if isinstance(m, Runner) else 'model'} on {here}: move it first "
                f"(model.to({str(devices[name])!r})) or give its source (a folder or hub id, or "
                f"ModelSpec(source, device=...)) so the Router loads it there"
            )
        want = resolve_dtype(dtypes[name])
        if want not in (None, AUTO) and have is not None and want != have:
            raise ValueError(
                f"dtype={dtypes[name]!r} was given, but model '{name}' is loaded in {have}: convert "
                f"it first (model.to({want})) or give its source so the Router loads it in {want}"
            )
        if isinstance(m, Runner):
            if tps[name] not in (None, 1):
                raise ValueError(
                    f"model '{name}' is a runner object: tp={tps[name]} cannot apply to it (give "
                    f"the model or its source)"
                )
            runners[name] = m
            eos += list(getattr(m, "eos_token_ids", ()) or ())
            own_eos[name] += list(getattr(m, "eos_token_ids", ()) or ())
        else:
            loaded[name] = m
    if tokenizer is None and not toks:
        raise ValueError("the models were given as runner objects: pass tokenizer=... too")
    router_tok = tokenizer if tokenizer is not None else next(iter(toks.values()))
    model_toks = {n: toks.get(n, router_tok) for n in names}
    mixed = not all(same_tokenizer(model_toks[names[0]], model_toks[n]) for n in names[1:])
    check_order(loaded, names)
    if not loaded and not engines and (config.max_kv_tokens is not None or config.kv_memory_fraction is not None):
        raise ValueError(
            "every model is a runner object with its own KV pool: max_kv_tokens and "
            "kv_memory_fraction do not apply (size the runners' pools instead)"
        )
    sizing = (
        plan(
            {**loaded, **engines},
            block_size=config.block_size,
            max_kv_tokens=config.max_kv_tokens,
            fraction=config.kv_memory_fraction,
        )
        if loaded or engines
        else {}
    )
    for name, runner_spec in engines.items():
        runner_spec.max_kv_tokens = sizing[name].tokens
        runner_spec.describe()
        runners[name] = runner_spec
    for name, m in loaded.items():
        ranks = check_tp(name, tps[name], config)
        if ranks > 1:
            runners[name] = tp_runner(m, folders.get(name), ranks, sizing[name].tokens, config)
        else:  # built where its sub-server runs; checked here (a model the runner refuses raises now)
            deferred = isinstance(m, DeferredModel)
            runners[name] = TorchRunnerSpec(
                m.folder if deferred else m,
                max_kv_tokens=sizing[name].tokens,
                block_size=config.block_size,
                cuda_graphs=config.cuda_graphs,
                compile=config.compile,
                model_impl=config.model_impl,
                kernels=config.kernels,
                allow_unknown_attention=config.allow_unknown_attention,
                **({"dtype": m.dtype, "device": m.device} if deferred else {}),
            )
            runners[name].describe()
            runners[name].prefetch()
        gen_eos = token_ids(
            m.eos_token_id
            if isinstance(m, DeferredModel)
            else getattr(getattr(m, "generation_config", None), "eos_token_id", None)
        )
        eos += gen_eos
        own_eos[name] += gen_eos
    kv_sizing = {
        n: sizing.get(n) or KVSizing(n, str(runners[n].device), runners[n].pool.capacity_tokens, "runner")
        for n in names
    }
    if config.cuda_graphs and any(
        getattr(r, "device", None) is not None and r.device.type != "cuda"
        for r in runners.values()
        if isinstance(r, (TorchRunner, TorchRunnerSpec))
    ):
        warnings.warn(
            "cuda_graphs=True with a model that is not on a CUDA device: its steps run the "
            "fixed-shape path without capture (what the tests check), which pads batches and "
            "is slower than the default; move the models to a GPU or leave cuda_graphs off",
            UserWarning,
            stacklevel=3,
        )
    text = None
    if mixed:  # models that share text, not tokens
        from .engine.core.text_mode import Vocabularies

        text = Vocabularies.build(
            model_toks,
            {
                n: tuple(
                    dict.fromkeys(
                        int(i) for i in [*token_ids(getattr(model_toks[n], "eos_token_id", None)), *own_eos[n]]
                    )
                )
                for n in names
            },
        )
        router_tok = model_toks[names[-1]]
    return RunnerSetup(
        {n: runners[n] for n in models},
        [int(i) for i in eos],
        router_tok,
        kv_sizing,
        {n: loaded.get(n, runners.get(n)) for n in models},
        text,
    )


def deferred_model(folder: str, dtype, device):
    """A `DeferredModel` of ``folder`` in ``dtype`` (``"auto"``: its ``config.json``'s) on ``device``."""
    from .deferred import DeferredModel
    from .placement import AUTO, resolve_dtype

    want = resolve_dtype(dtype)
    if want in (None, AUTO):
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(folder)
        have = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        want = resolve_dtype(have) if have is not None else torch.float32
        if not isinstance(want, torch.dtype):
            want = torch.float32
    return DeferredModel(folder, want, device)


def load_tokenizer(folder: str):
    """The tokenizer of a checkpoint folder.

    Raises:
        ModelLoadError: it cannot be loaded (names the folder and why).
    """
    from transformers import AutoTokenizer

    from .models import ModelLoadError

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load the tokenizer of {folder!r}: {e}") from e


def engine_runner_spec(name: str, spec, device, dtype, tp, config: EngineConfig, with_tokenizer: bool = True):
    """``(runner spec, tokenizer, eos ids)`` of a `ModelSpec` whose ``runner`` is ``"vllm"`` or
    ``"sglang"``: the engine's runner spec (its KV size set later by the planner), the source's
    tokenizer (None without ``with_tokenizer``: the Router was given one) and the
    end-of-sequence ids of its generation config. Nothing is loaded here but the tokenizer and
    the config. The Router's ``compile``, ``cuda_graphs``, ``model_impl`` and
    ``kernels`` configure our torch runner only (the engine's own come with ``engine_args``).

    Raises:
        ValueError: a loaded model, a GGUF file name or tp > 1 with an engine runner.
        RuntimeError: the engine is not installed (names the extra to install).
        ModelLoadError: the source's tokenizer or config cannot be read.
    """
    from transformers import AutoTokenizer

    from .models import ModelLoadError

    what = f"model '{name}' (runner={spec.runner!r})"
    if spec.loaded:
        raise ValueError(
            f"{what}: the engine loads the model itself; give its source (a folder or hub id), not a loaded model"
        )
    if spec.gguf_file is not None:
        raise ValueError(f"{what}: gguf_file does not apply; give the .gguf file's path as the source")
    if tp not in (None, 1):
        raise ValueError(
            f"{what}: tp={tp} is not served behind this runner yet; use runner='torch' for a tensor-parallel model"
        )
    dev, dt = spec.placed(device, dtype)
    src = os.path.expanduser(str(spec.source))
    common = dict(
        max_kv_tokens=config.max_kv_tokens or 8192,
        block_size=config.block_size,
        dtype=dt,
        device=dev,
        engine_args=dict(spec.engine_args),
    )
    if spec.runner == "vllm":
        from .backends.vllm_runner import VLLMRunnerSpec

        runner_spec = VLLMRunnerSpec(src, **common)
    else:
        from .backends.sglang_runner import SGLangRunnerSpec

        runner_spec = SGLangRunnerSpec(src, **common)
    runner_spec.describe()  # the engine installed, the config readable: fail here, not in the sub-server
    tok = None
    if with_tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(src)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{what}: could not load the tokenizer of {str(spec.source)!r}: {e}") from e
    try:
        from transformers import GenerationConfig

        ids = token_ids(GenerationConfig.from_pretrained(src).eos_token_id)
    except (OSError, ValueError):
        ids = token_ids(getattr(tok, "eos_token_id", None))
    return runner_spec, tok, ids


def parameter_count(model) -> int:
    """Parameters of a torch model (each tensor once, shared ones included), or of a
    `DeferredModel` (from its safetensors headers; 0 when it has none)."""
    from .deferred import DeferredModel
    from .deferred import parameter_count as folder_count

    if isinstance(model, DeferredModel):
        return folder_count(model.folder)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def check_order(loaded: dict, names: list[str]) -> None:
    """Warn when the models are not given smallest first, by parameter count: the last model is
    the one metrics and policies count as "large" (`Router`'s ``models``), so a larger model
    before a smaller one swaps what every large fraction means. Runner objects are not
    counted."""
    counts = [(n, parameter_count(loaded[n])) for n in names if n in loaded]
    counts = [(n, c) for n, c in counts if c > 0]
    for i, (a, na) in enumerate(counts):
        bigger = next(((b, nb) for b, nb in counts[i + 1 :] if nb < na), None)
        if bigger is not None:
            b, nb = bigger
            order = ", ".join(f"'{n}'" for n, _ in sorted(counts, key=lambda c: c[1]))
            warnings.warn(
                f"Router models are given smallest first, but '{a}' ({na / 1e6:.3g}M parameters) comes "
                f"before the smaller '{b}' ({nb / 1e6:.3g}M): the last model is the one metrics, large "
                f"fractions and policies count as large. Give them in the order {order}",
                UserWarning,
                stacklevel=4,
            )
            return


def check_tp(name: str, tp, config: EngineConfig) -> int:
    """``tp`` of model ``name`` as an int >= 1.

    Raises:
        ValueError: not a positive int; with ``compile`` or ``cuda_graphs``.
    """
    if tp is None:
        return 1
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp of model '{name}' must be a positive int (tensor-parallel ranks), got {tp!r}")
    if tp > 1 and (config.compile or config.cuda_graphs):
        raise ValueError(
            f"model '{name}' has tp={tp}: compile and cuda_graphs do not apply to a "
            f"tensor-parallel model yet; leave them off"
        )
    return tp


def tp_runner(model, folder, tp: int, kv_tokens: int, config: EngineConfig):
    """The `TensorParallelRunner` of ``model`` (its ranks load ``folder`` when the model came
    from one, else the model object itself), not started yet."""
    from .backends.tensor_parallel import ModelRecipe, TensorParallelRunner

    p = next(model.parameters())
    dtype = str(p.dtype).removeprefix("torch.")
    recipe = ModelRecipe(
        folder if folder is not None else model,
        dtype=dtype,
        device="cuda" if p.device.type == "cuda" else p.device.type,
    )
    return TensorParallelRunner(
        recipe,
        tp,
        max_kv_tokens=kv_tokens,
        block_size=config.block_size,
        model_impl=config.model_impl,
        kernels=config.kernels,
        allow_unknown_attention=config.allow_unknown_attention,
    )


def sim_runners(models: dict, tokenizer, config: EngineConfig) -> RunnerSetup:
    """``backend="sim"``: a `SimRunner` per model (a `LatencyModel`, or the keyword arguments
    of one), over ``tokenizer`` (default: the tiny test tokenizer); pools of
    ``config.max_kv_tokens`` tokens (default 4M)."""
    from .backends.sim_runner import LatencyModel, SimRunner
    from .kv_sizing import KVSizing
    from .models import tiny_tokenizer

    tok = tokenizer if tokenizer is not None else tiny_tokenizer()
    runners = {
        n: SimRunner(
            m if isinstance(m, LatencyModel) else LatencyModel(**(m or {})),
            vocab_size=len(tok),
            max_kv_tokens=config.max_kv_tokens or (1 << 22),
            block_size=config.block_size,
            seed=i,
        )
        for i, (n, m) in enumerate(models.items())
    }
    sizing = {
        n: KVSizing(n, "sim", r.pool.capacity_tokens, "max_kv_tokens" if config.max_kv_tokens else "runner")
        for n, r in runners.items()
    }
    return RunnerSetup(runners, [], tok, sizing, dict(models))
