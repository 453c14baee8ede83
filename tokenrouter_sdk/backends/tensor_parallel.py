"""Tensor parallelism for one model: its sub-server's runner is rank 0 of ``tp`` ranks.

Rank 0 is the process that runs the model's sub-server (scheduler, policy, sampler). It starts
ranks 1..tp-1 as processes of its own, and every step ships the step's inputs (`SeqInput`s:
tokens, positions, block tables) to them over a pyzmq socket; each rank then runs the same
packed forward (`TorchRunner`) on its shard of the model, with torch.distributed collectives
inside it (gloo on the CPU, NCCL on CUDA; one process group object per runner, no process-wide
default group). vLLM does the same: its own message queue for step inputs, torch.distributed
only inside the forward.

Sharding follows the model's own tensor-parallel plan (``config.base_model_tp_plan`` of
transformers, e.g. Llama, Qwen2, Qwen3: ``q/k/v/gate/up_proj`` column-wise, ``o/down_proj``
row-wise): a column-wise linear keeps its rows ``rank * n / tp ..`` (its heads, for the
attention projections), a row-wise one its matching columns and all-reduces (sums) its output
over the ranks before its bias. Embeddings, norms and the LM head are replicated, so every
rank computes the same logits. Each rank's model config is rewritten to its local shard
(``num_attention_heads`` and ``num_key_value_heads`` divided by ``tp``), so each rank's KV pool
holds its local KV heads; block tables are shared (rank 0's scheduler decides them).
"""

from __future__ import annotations

import fnmatch
import io
import os
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..engine.runner import RunnerDied, SeqInput

DEFAULT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


class TensorParallelError(ValueError):
    """A model that cannot be split over the asked number of ranks (names the numbers)."""


def tp_plan(model) -> dict[str, str]:
    """The model's tensor-parallel plan: module path pattern (relative to the decoder) ->
    ``"colwise"`` or ``"rowwise"``; the Llama-style plan when the config declares none. An
    ``"embedding_rowwise"`` entry (transformers before 5.20 adds one for ``embed_tokens``) is
    left out: the embedding stays whole on every rank, as with the plans of later releases.

    Raises:
        TensorParallelError: the plan uses a style other than colwise and rowwise.
    """
    plan = {
        k: v
        for k, v in dict(getattr(model.config, "base_model_tp_plan", None) or DEFAULT_PLAN).items()
        if v != "embedding_rowwise"
    }
    bad = {k: v for k, v in plan.items() if v not in ("colwise", "rowwise")}
    if bad:
        raise TensorParallelError(
            f"tensor parallelism supports colwise and rowwise layers; the model's plan has "
            f"{bad} ({type(model).__name__})"
        )
    return plan


def check_divisible(config, tp: int) -> None:
    """Raise `TensorParallelError` unless the attention and KV heads divide by ``tp``."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", 0) or 0
    if tp < 1:
        raise TensorParallelError(f"tp must be >= 1, got {tp}")
    if kv % tp or heads % tp or inter % tp:
        raise TensorParallelError(
            f"tensor parallelism {tp} needs the KV heads ({kv}), the attention heads ({heads}) and the MLP width "
            f"({inter}) to divide by {tp}; pick tp among the divisors of {kv}"
        )


def _allreduce_hook(group, bias):
    def hook(module, args, out):
        group.allreduce([out]).wait()
        if bias is not None:
            out += bias
        return out

    return hook


def shard_model(model, rank: int, tp: int, group) -> None:
    """Keep this rank's shard of ``model`` (in place) per `tp_plan`, all-reduce row-wise outputs
    over ``group`` (a torch.distributed process group object), and rewrite its config to the
    local heads.

    Raises:
        TensorParallelError: heads that do not divide by ``tp`` or a layer the plan names that
            is not a linear layer.
    """
    cfg = model.config
    check_divisible(cfg, tp)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    plan = tp_plan(model)
    for name, mod in decoder.named_modules():
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style is None:
            continue
        if not isinstance(mod, torch.nn.Linear):
            raise TensorParallelError(
                f"the tensor-parallel plan names {name!r}, a {type(mod).__name__}, not a Linear layer"
            )
        w = mod.weight.detach()
        if style == "colwise":
            n = w.shape[0] // tp
            mod.weight = torch.nn.Parameter(w[rank * n : (rank + 1) * n].clone(), requires_grad=False)
            if mod.bias is not None:
                mod.bias = torch.nn.Parameter(mod.bias.detach()[rank * n : (rank + 1) * n].clone(), requires_grad=False)
            mod.out_features = n
        else:
            n = w.shape[1] // tp
            mod.weight = torch.nn.Parameter(w[:, rank * n : (rank + 1) * n].clone(), requires_grad=False)
            bias = None if mod.bias is None else mod.bias.detach().clone()
            mod.bias = None
            mod.in_features = n
            mod.register_forward_hook(_allreduce_hook(group, bias))
    cfg.num_key_value_heads = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) // tp
    cfg.num_attention_heads //= tp
    for mod in decoder.modules():  # attention modules that keep a head count of their own
        for attr in ("num_heads", "num_key_value_heads"):
            if isinstance(getattr(mod, attr, None), int):
                setattr(mod, attr, getattr(mod, attr) // tp)


@dataclass
class ModelRecipe:
    """How each rank gets the whole model before it keeps its shard.

    Attributes:
        source: a local folder (``config.json`` and weights; loaded with transformers on every
            rank) or a model object (pickled once, loaded by every rank).
        dtype: torch dtype name for a folder (``"float32"``, ``"bfloat16"``, ``"auto"``).
        device: ``"cpu"`` or ``"cuda"`` (rank r uses ``cuda:r``).
    """

    source: object
    dtype: str = "float32"
    device: str = "cpu"

    def config(self):
        """The model's transformers config (read from the folder, or the object's own)."""
        if isinstance(self.source, (str, os.PathLike)):
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(str(self.source))
        return self.source.config

    def attention_spec(self, allow_unknown: bool = False):
        """The model's `AttentionSpec` (`tokenrouter_sdk.backends.attention.spec`): read from the
        model object, or from a weightless copy built from the folder's config."""
        from .attention import read_spec, use_paged_attention

        model = self.source
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(self.config())
        use_paged_attention(model)
        return read_spec(model, allow_unknown=allow_unknown)

    def torch_dtype(self) -> torch.dtype:
        """The dtype the ranks hold the weights in (``"auto"``: the checkpoint's own)."""
        if not isinstance(self.source, (str, os.PathLike)):
            return next(self.source.parameters()).dtype
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        cfg = self.config()
        dt = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32
        return getattr(torch, dt) if isinstance(dt, str) else dt

    def payload(self) -> bytes:
        """What travels to the ranks (a folder path, or the pickled model)."""
        buf = io.BytesIO()
        src = ("folder", str(self.source)) if isinstance(self.source, (str, os.PathLike)) else ("module", self.source)
        torch.save((*src, self.dtype, self.device), buf)
        return buf.getvalue()


def _load(payload: bytes, rank: int):
    kind, src, dtype, device = torch.load(io.BytesIO(payload), weights_only=False)
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else device)
    if kind == "folder":
        from transformers import AutoModelForCausalLM

        dt = "auto" if dtype == "auto" else getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dt)
    else:
        model = src
    return model.to(dev).eval().requires_grad_(False)


def _group(store_host: str, store_port: int, rank: int, tp: int, device: str, timeout_s: float):
    """The process group object of the ranks (no default group is set)."""
    import torch.distributed as dist

    store = dist.TCPStore(
        store_host, store_port, tp, rank == 0, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    prefix = dist.PrefixStore("tokenrouter-tp", store)
    if device == "cuda":
        return store, dist.ProcessGroupNCCL(prefix, rank, tp)
    return store, dist.ProcessGroupGloo(prefix, rank, tp, timedelta(seconds=timeout_s))


def _follower_main() -> None:
    """Rank >= 1 (a process started by `TensorParallelRunner.start`): read its set-up from stdin
    (one pickle), load, shard, then run every step rank 0 ships until told to stop or stdin
    closes (rank 0's process ended)."""
    import sys

    import zmq

    from .torch_runner import TorchRunner

    stdin = sys.stdin.buffer
    payload, rank, tp, store_port, address, runner_kw, threads, timeout_s = pickle.load(stdin)
    torch.set_num_threads(max(1, threads))
    model = _load(payload, rank)
    store, group = _group("127.0.0.1", store_port, rank, tp, runner_kw.get("device", "cpu"), timeout_s)
    shard_model(model, rank, tp, group)
    runner = TorchRunner(
        model,
        max_kv_tokens=runner_kw["max_kv_tokens"],
        block_size=runner_kw["block_size"],
        model_impl=runner_kw.get("model_impl", "auto"),
        kernels=runner_kw.get("kernels", "auto"),
        allow_unknown_attention=runner_kw.get("allow_unknown_attention", False),
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(address)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(stdin.fileno(), zmq.POLLIN)  # readable only at EOF: rank 0 is gone
    store.set(f"ready{rank}", b"1")
    try:
        while True:
            ready = dict(poller.poll())
            if sock in ready:
                kind, inputs = pickle.loads(sock.recv())
                if kind == "stop":
                    return
                runner.forward(inputs)
            elif stdin.fileno() in ready and not os.read(stdin.fileno(), 1):
                return
    finally:
        sock.close(linger=0)
        ctx.term()
        os._exit(0)


class TensorParallelRunner:
    """A `Runner` over ``tp`` ranks: the process that calls `start` is rank 0 (see the module
    docstring).

    Built in one process and started in another: the constructor reads the model's shape (vocab,
    context, KV heads) and makes a KV pool of the local heads (what the engine sizes admission
    by), and travels by pickle until `start`; `start` (called by `prepare_process` in a
    sub-server process, or by the Router for sub-servers in threads) starts ranks 1..tp-1 as
    processes of its own (``python -c``, their set-up over a pipe whose end is also their
    signal that rank 0 is gone), shards rank 0's model and builds its `TorchRunner`.

    Args:
        recipe: the `ModelRecipe` every rank loads.
        tp: ranks (>= 2; tp = 1 is a plain `TorchRunner`).
        max_kv_tokens, block_size: the KV pool of every rank (each holds its local KV heads).
        threads: torch threads per follower rank.
        timeout_s: seconds a collective or the start-up waits for a rank before it fails.
        start: start the ranks now (default False: at `start` / `prepare_process`).
        model_impl: every rank's `TorchRunner` ``model_impl`` (the native forward calls the
            row-wise linears as modules, so their all-reduce hooks run).
        kernels: every rank's `TorchRunner` ``kernels`` (the C++ CPU kernels).
        allow_unknown_attention: every rank's `TorchRunner` ``allow_unknown_attention``. Each
            rank reads its layers' attention parameters (window, soft-cap, scale) from its own
            shard, as a single runner does; the constructor reads them from the model (or, for a
            folder, from a weightless copy built from its config) to refuse an unsupported model
            before any rank starts.

    Raises:
        TensorParallelError: the model's heads do not divide by ``tp`` (names both numbers).
        UnsupportedAttention: the model's attention uses a feature the paged attention does not
            compute (unless ``allow_unknown_attention``).
        RuntimeError: a rank did not start within ``timeout_s`` (names it and its exit code).

    Attributes:
        ship_s: seconds spent shipping the last step's inputs to the other ranks.
    """

    def __init__(
        self,
        recipe: ModelRecipe,
        tp: int,
        *,
        max_kv_tokens: int = 8192,
        block_size: int = 16,
        threads: int = 1,
        timeout_s: float = 120.0,
        start: bool = False,
        model_impl: str = "auto",
        kernels: str = "auto",
        allow_unknown_attention: bool = False,
    ):
        from ..engine.core.kv_pool import KVPool

        if tp < 2:
            raise TensorParallelError(f"TensorParallelRunner needs tp >= 2, got {tp} (tp = 1: use TorchRunner)")
        self.recipe, self.tp, self.timeout_s, self.threads = recipe, tp, timeout_s, threads
        self.max_kv_tokens, self.block_size, self.model_impl = max_kv_tokens, block_size, model_impl
        self.kernels, self.allow_unknown_attention = kernels, bool(allow_unknown_attention)
        cfg = recipe.config()
        check_divisible(cfg, tp)
        self.spec = recipe.attention_spec(self.allow_unknown_attention)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) // tp
        self.max_context = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(cfg.vocab_size)
        self.dtype = recipe.torch_dtype()
        self.device = torch.device("cuda", 0) if recipe.device == "cuda" else torch.device(recipe.device)
        self.pool = KVPool(
            cfg.num_hidden_layers,
            kv_heads,
            head_dim,
            -(-max_kv_tokens // block_size),
            block_size,
            dtype=self.dtype,
            device="cpu" if recipe.device == "cuda" else recipe.device,
        )
        self.local = None
        self.last_forward_s = 0.0
        self.ship_s = 0.0
        self._procs: list = []
        self._socks: list = []
        self._ctx = None
        self._dir = ""
        if start:
            self.start()

    def __getstate__(self):
        if self.local is not None:
            raise TypeError(
                "a started TensorParallelRunner cannot be pickled (its ranks belong to this process); "
                "send it before start()"
            )
        return dict(self.__dict__)

    @property
    def started(self) -> bool:
        """Whether the ranks run (rank 0 in this process)."""
        return self.local is not None

    def prepare_process(self) -> None:
        """Set-up in the process that runs the sub-server: start the ranks."""
        self.start()

    def start(self) -> None:
        """Start ranks 1..tp-1, shard this rank's model, build its runner (idempotent).

        Raises:
            RuntimeError: a rank did not start within ``timeout_s`` (names it).
        """
        import subprocess
        import sys
        import tempfile

        import torch.distributed as dist
        import zmq

        from .torch_runner import TorchRunner

        if self.local is not None:
            return
        tp, timeout_s, recipe = self.tp, self.timeout_s, self.recipe
        payload = recipe.payload()
        model = _load(payload, 0)
        self._store = dist.TCPStore(
            "127.0.0.1", 0, tp, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self._dir = tempfile.mkdtemp(prefix="tokenrouter-tp-")
        self._ctx = zmq.Context()
        runner_kw = {
            "max_kv_tokens": self.max_kv_tokens,
            "block_size": self.block_size,
            "device": recipe.device,
            "model_impl": self.model_impl,
            "kernels": self.kernels,
            "allow_unknown_attention": self.allow_unknown_attention,
        }
        code = "from tokenrouter_sdk.backends.tensor_parallel import _follower_main; _follower_main()"
        try:
            for r in range(1, tp):
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                addr = f"ipc://{self._dir}/steps-{r}"
                sock.bind(addr)
                self._socks.append(sock)
                p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, close_fds=True)
                self._procs.append(p)
                pickle.dump(
                    (payload, r, tp, self._store.port, addr, runner_kw, self.threads, timeout_s),
                    p.stdin,
                    protocol=pickle.HIGHEST_PROTOCOL,
                )
                p.stdin.flush()  # stdin stays open: its end tells the rank that this process is gone
            prefix = dist.PrefixStore("tokenrouter-tp", self._store)
            self.group = (
                dist.ProcessGroupNCCL(prefix, 0, tp)
                if recipe.device == "cuda"
                else dist.ProcessGroupGloo(prefix, 0, tp, timedelta(seconds=timeout_s))
            )
            shard_model(model, 0, tp, self.group)
            deadline = time.monotonic() + timeout_s
            for r, p in enumerate(self._procs, start=1):
                while True:
                    try:
                        self._store.wait([f"ready{r}"], timedelta(seconds=1))
                        break
                    except Exception:  # noqa: BLE001 - not ready yet
                        if p.poll() is not None or time.monotonic() > deadline:
                            raise RuntimeError(
                                f"tensor-parallel rank {r} of {tp} did not start within {timeout_s} s "
                                f"(exit code {p.poll()})"
                            ) from None
        except BaseException:
            self.release()
            raise
        self.pool.release()
        self.local = TorchRunner(
            model,
            max_kv_tokens=self.max_kv_tokens,
            block_size=self.block_size,
            model_impl=self.model_impl,
            kernels=self.kernels,
            allow_unknown_attention=self.allow_unknown_attention,
        )
        self.spec = self.local.spec
        self.pool = self.local.pool
        self.device = self.local.device

    def pids(self) -> list[int]:
        """Process ids of ranks 1..tp-1 (empty before `start`)."""
        return [p.pid for p in self._procs]

    def _dead(self) -> list[tuple[int, int | None]]:
        return [(r, p.poll()) for r, p in enumerate(self._procs, start=1) if p.poll() is not None]

    def forward(self, seqs: list[SeqInput]):
        """Ship ``seqs`` to the other ranks, run rank 0's shard; see `TorchRunner.forward`.

        Raises:
            RunnerDied: a rank is gone (before the step, or a collective failed because of it).
        """
        if self.local is None:
            self.start()
        dead = self._dead()
        if dead:
            raise RunnerDied(
                f"tensor-parallel rank(s) {[r for r, _ in dead]} of {self.tp} died (exit codes {[c for _, c in dead]})"
            )
        t0 = time.perf_counter()
        data = pickle.dumps(("step", list(seqs)), protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._socks:
            sock.send(data)
        self.ship_s = time.perf_counter() - t0
        try:
            out = self.local.forward(seqs)
        except RuntimeError as e:
            deadline = time.monotonic() + 1.0  # a rank whose socket closed is reaped a moment later
            while not self._dead() and time.monotonic() < deadline:
                time.sleep(0.01)
            dead = [r for r, _ in self._dead()]
            if dead or "gloo" in str(e).lower() or "nccl" in str(e).lower():
                raise RunnerDied(f"tensor-parallel rank(s) {dead or '?'} of {self.tp} failed during a step: {e}") from e
            raise
        self.last_forward_s = self.local.last_forward_s
        return out

    def release(self) -> None:
        """Stop the other ranks and free this rank's model and pool."""
        import shutil

        for sock in self._socks:
            try:
                sock.send(pickle.dumps(("stop", None)), flags=1)  # zmq.NOBLOCK
            except Exception:  # noqa: BLE001 - a rank already gone
                pass
            sock.close(linger=0)
        self._socks = []
        for p in self._procs:
            try:
                p.wait(5.0)
            except Exception:  # noqa: BLE001 - still running: end it
                p.kill()
                p.wait(2.0)
            if p.stdin is not None:
                p.stdin.close()
        self._procs = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.local is not None:
            self.local.release()
        elif self.pool is not None:
            self.pool.release()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
