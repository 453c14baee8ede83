"""How sub-server processes are started: the multiprocessing context `ProcessTransport` uses.

``"forkserver"`` (the default on Linux): multiprocessing's fork server, a process started once
per interpreter (by the first `ProcessTransport`, or early by `Router.default`) that imports torch, transformers, the
sub-server code and the served models' ``transformers`` modules, then forks one process per
sub-server on request. A sub-server then starts in tens of milliseconds instead of a fresh
interpreter's seconds of imports; every Router still gets fresh processes (nothing of a
closed Router's sub-server survives it). The fork server never runs a torch operation (no
thread pools, no CUDA), so forking it is safe; it ends when this interpreter ends.

``"spawn"``: a fresh interpreter per sub-server (seconds of imports each time); the default
where the fork server is unavailable (not Linux) and for models on an accelerator (CUDA in
a process forked from the fork server has not been verified on a GPU; ``start_method=
"forkserver"`` asks for it).

Either way the child does not re-run this interpreter's ``__main__`` script (a script needs no
``if __name__ == "__main__"`` guard): everything the child needs arrives pickled by value.

The fork server is one per interpreter (``multiprocessing.forkserver``): the modules it imports
are fixed when it starts, by whichever code starts it first; a fork server started by other code
without them still works, its sub-servers then import those modules themselves (slower). It
also keeps the environment variables of the moment it started.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import threading

START_METHODS = ("forkserver", "spawn")

# imported once by the fork server: everything a sub-server needs before it can unpickle its spec
PRELOAD = (
    "torch",
    "transformers",
    "tokenrouter_sdk.engine.transports.process_child",
    "tokenrouter_sdk.engine.core.subserver",
    "tokenrouter_sdk.backends.torch_runner",
)
# packages whose modules named by a spec (model classes, tokenizers, runners) are preloaded too
PRELOAD_PACKAGES = ("torch", "transformers", "tokenizers", "tokenrouter_sdk")

_START_LOCK = threading.Lock()


def default_start_method(specs: dict | None = None) -> str:
    """``"forkserver"`` on Linux when every spec's runner is on the CPU (or names no device),
    else ``"spawn"``."""
    if not sys.platform.startswith("linux"):
        return "spawn"
    for spec in (specs or {}).values():
        device = getattr(spec.get("runner"), "device", None)
        if device is not None and getattr(device, "type", str(device)) != "cpu":
            return "spawn"
    return "forkserver"


def spec_modules(specs: dict) -> list[str]:
    """Modules that unpickling ``specs`` imports and the fork server can preload: the modules of
    each spec's runner, its model (e.g. ``transformers.models.llama.modeling_llama``) and the
    tokenizer, when they belong to `PRELOAD_PACKAGES`."""
    mods = []
    for spec in specs.values():
        runner = spec.get("runner")
        for obj in (runner, getattr(runner, "model", None), spec.get("tokenizer")):
            mod = type(obj).__module__ if obj is not None else None
            if mod and mod.split(".")[0] in PRELOAD_PACKAGES:
                mods.append(mod)
    return mods


def get_context(method: str, specs: dict | None = None, modules=()):
    """The multiprocessing context for ``method`` (see the module docstring).

    For ``"forkserver"``, the fork server's preload list becomes `PRELOAD` plus
    `spec_modules(specs)` plus ``modules`` plus what was listed before (less ``"__main__"``,
    which would run this interpreter's script in the fork server); it takes effect when the
    fork server starts (the first use in this interpreter, or after it died).

    Raises:
        ValueError: an unknown method, or one this platform does not offer.
    """
    if method not in START_METHODS:
        raise ValueError(f"ProcessTransport start_method must be one of {START_METHODS}, got {method!r}")
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"start_method={method!r} is not available on this platform; use 'spawn'")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        from multiprocessing import forkserver

        before = getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", None) or []
        wanted = [*PRELOAD, *spec_modules(specs or {}), *modules, *before]
        ctx.set_forkserver_preload([m for m in dict.fromkeys(wanted) if m != "__main__"])
    return ctx


def prestart(method: str | None = None, modules=()) -> None:
    """Start the fork server now, without waiting for it: it imports torch, transformers and
    ``modules`` (seconds) while this process goes on (loading or pickling the models), and the
    first process it forks waits for the imports. Does nothing for ``"spawn"``; when the fork
    server runs already, ``modules`` are not added to it."""
    method = method or default_start_method()
    if method != "forkserver":
        return
    get_context(method, modules=modules)
    from multiprocessing import forkserver

    with no_main_reimport():
        forkserver.ensure_running()


def prestart_for(processes, modules=()) -> None:
    """`prestart` for a Router about to be built with this ``processes`` setting
    (`EngineConfig.processes`: None, a bool or a dict of `ProcessTransport` arguments), unless
    it will not use processes (False, or None with ``TOKENROUTER_PROCESSES`` saying no) or asks
    for ``"spawn"``. For CPU models (the fork server is the default only for them)."""
    if processes is None:
        if os.environ.get("TOKENROUTER_PROCESSES", "").strip().lower() in ("0", "false", "no", "off"):
            return
    elif not processes:
        return
    method = processes.get("start_method") if isinstance(processes, dict) else None
    if (method or default_start_method()) == "forkserver":
        prestart("forkserver", modules)


@contextlib.contextmanager
def no_main_reimport():
    """Start children without re-running the parent's ``__main__`` script: everything the child
    needs arrives pickled by value, and a script without a ``__main__`` guard must not build a
    second Router inside each child."""
    import multiprocessing.spawn as spawn

    orig = spawn.get_preparation_data

    def prep(name):
        d = orig(name)
        d.pop("init_main_from_path", None)
        d.pop("init_main_from_name", None)
        return d

    with _START_LOCK:
        spawn.get_preparation_data = prep
        try:
            yield
        finally:
            spawn.get_preparation_data = orig
