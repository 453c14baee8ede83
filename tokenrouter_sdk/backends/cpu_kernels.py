"""The engine's C++ CPU kernels, built with `torch.utils.cpp_extension` at first use:
``csrc/paged_attention.cpp``, paged attention that reads keys and values in place from the KV
pool and the one-call store of a step's new keys and values into it, ``csrc/step_ops.cpp``, the
fused float32 and bfloat16 norm, rotary and SiLU-gating ops of the
native forward's eager steps (`StepOps`), and ``csrc/skinny_gemm.cpp``, float32 projections of a
few rows over a weight packed for them (`tokenrouter_sdk.backends.projection`; whether they run
is measured, `tokenrouter_sdk.backends.autotune`), and ``csrc/decoder_layer.cpp``, a whole decoder
layer in one call over those kernels (`tokenrouter_sdk.backends.fused_layers`; ``csrc/kernels.h``
declares what one source calls from another). ``csrc/vec_math.h`` holds the float32
exponential both attention's softmax and SiLU gating use, written so that the compiler
vectorizes it (a scalar ``expf`` per element does not vectorize).

Attention: without the kernel a decode or extend step gathers every request's whole cached K/V
into a padded copy in each layer (``index_select``) and runs SDPA over the copy, so it reads and
writes its cache three times. The kernel reads each key's pool row once (all heads at once,
prefetched a few keys ahead) and splits long contexts into chunks merged by their log-sum-exp
(split-K, as flash-decoding: Dao et al., "Flash-Decoding for long-context inference", 2023), on
torch's own thread pool (``at::parallel_for``, so `torch.set_num_threads` and core lending apply).

Step ops: one fused call each for RMSNorm, the rotary embedding of q and of k, and SiLU gating,
each in place of several ATen calls whose fixed cost dominates at decode sizes. vLLM's CPU
backend has its own ops for the same work; `torch.compile` (``compile=True``) fuses it too, at a
compile cost. What the kernels save on the CPUs this project ran on is in ``docs/benchmarks.md``
("The C++ CPU kernels (cpu_kernels)").

Build: the first `paged_attention_op` call (a runner's first CPU step, or `start`) builds the
extension in a background thread with the C++ compiler (``c++``) and ninja (the ``ninja``
wheel), under torch's extension directory (`build_directory`; ``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), one process at a time (an OS lock, so a builder killed mid-build
never blocks the next one); a later process loads the cached library. The name of the build
hashes the sources, the flags, the torch version and the CPU's flags (it is compiled with
``-march=native``), so a changed source or another CPU gets its own build; it compiles copies of
the sources kept in its own folder, so two checkouts of the same sources share one build instead
of rebuilding it in turn. Until the kernels are loaded, and wherever they cannot be (no
compiler, another platform), `paged_attention_op` and `step_ops` return None and steps run
ATen ops; `error` says why. The state is per process, as the loaded library is.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path

import torch

SOURCES = tuple(
    Path(__file__).with_name("csrc") / n
    for n in ("paged_attention.cpp", "step_ops.cpp", "skinny_gemm.cpp", "decoder_layer.cpp")
)
HEADERS = tuple(Path(__file__).with_name("csrc") / n for n in ("vec_math.h", "kernels.h"))  # included by the sources
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")
LDFLAGS = ("-fopenmp",)  # links libgomp by its soname: the process uses the copy torch loaded
DTYPES = (torch.float32, torch.float64, torch.bfloat16)  # pools the in-place attention reads
STEP_DTYPES = (torch.float32, torch.bfloat16)  # what the fused step ops take


class _Build:
    """The kernel's build and load in this process (see the module docstring)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.done = threading.Event()
        self.op = None
        self.error: str | None = None

    def start(self) -> None:
        with self.lock:
            if self.thread is not None:
                return
            self.thread = threading.Thread(target=self._run, name="tokenrouter-kernel-build", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            if not _loaded():
                _find_ninja()
                _build_and_load(build_name())
            self.op = torch.ops.tokenrouter_cpu.paged_attention
        except Exception as e:  # no compiler or ninja, another platform: steps keep gathering
            self.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        self.done.set()


_BUILD = _Build()


def build_directory(name: str) -> Path:
    """Where the build of ``name`` lives: ``tokenrouter/<name>`` under torch's extension root
    (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``)."""

    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / "tokenrouter" / name


def _build_and_load(name: str) -> None:
    """`torch.utils.cpp_extension.load` of the sources into `build_directory`, one process at a
    time. torch serialises builders with a lock file that a builder killed mid-build (a notebook
    interrupted, a sub-server process stopped at shutdown) leaves behind, and every later load
    then waits for it forever. Here each builder first takes an OS lock (``flock``, released
    when its process dies, however it dies) and, holding it, removes torch's lock file: any such
    file is then a dead builder's."""
    from torch.utils import cpp_extension

    d = build_directory(name)
    d.mkdir(parents=True, exist_ok=True)

    def load() -> None:
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in stage_sources(d)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            is_python_module=False,
            verbose=False,
            build_directory=str(d),
        )

    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock only
        load()
        return
    with open(d / "tokenrouter.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (d / "lock").unlink(missing_ok=True)
            load()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def stage_sources(d: Path) -> list[Path]:
    """The sources as the build in ``d`` compiles them: copies in ``d / "src"`` (written only
    when their bytes differ), beside copies of the headers they include; returns the sources'. ninja rebuilds when a
    source's path in its build file changes, so
    compiling the package's own files would rebuild the cached library each time another checkout
    or environment with the same sources (the same build name) loaded it; the copies have one
    path per build."""
    src = d / "src"
    src.mkdir(parents=True, exist_ok=True)
    out = []
    for s in SOURCES + HEADERS:
        dst = src / s.name
        data = s.read_bytes()
        if not dst.exists() or dst.read_bytes() != data:
            tmp = dst.with_suffix(dst.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
        if s in SOURCES:
            out.append(dst)
    return out


def _find_ninja() -> None:
    """`torch.utils.cpp_extension` runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency)
    installs it next to the interpreter, which is not on PATH when a venv's python runs without
    activating the venv: add that folder at the end of PATH then."""
    import shutil

    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + ninja.BIN_DIR


def _loaded() -> bool:
    try:
        _ = torch.ops.tokenrouter_cpu.paged_attention  # raises until the library is loaded
    except (AttributeError, RuntimeError):
        return False
    return True


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor()


def build_name() -> str:
    """The extension's name: ``tokenrouter_cpu_`` and a hash of what the binary and its build
    file depend on: the sources' and headers' bytes (hashed again only when a file's path, size
    or modification time changed), the flags, torch's version, the CPU's flags, and where torch
    and Python's headers are installed (the build file names them, so two environments sharing
    one build would rebuild it in turn)."""
    import sysconfig

    files = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in SOURCES + HEADERS)
    where = f"{Path(torch.__file__).parent}|{sysconfig.get_paths()['include']}"
    return _hashed_name(files, " ".join(CFLAGS + LDFLAGS), torch.__version__, where)


@functools.lru_cache(maxsize=8)
def _hashed_name(files: tuple, flags: str, version: str, where: str) -> str:
    h = hashlib.sha256()
    for part in (
        *(Path(f).read_bytes() for f, _, _ in files),
        flags.encode(),
        version.encode(),
        _cpu_flags().encode(),
        where.encode(),
    ):
        h.update(part)
    return "tokenrouter_cpu_" + h.hexdigest()[:16]


def cached() -> bool:
    """Whether this build's library is on disk already (loading it takes well under a second;
    building it, seconds)."""
    name = build_name()
    return any(build_directory(name).glob(f"{name}*.so"))


def start() -> None:
    """Begin building or loading the kernel in a background thread (once per process)."""
    _BUILD.start()


def paged_attention_op(wait: bool = False, timeout: float | None = None):
    """The op ``torch.ops.tokenrouter_cpu.paged_attention(out, q, k_pool, v_pool, table, q_start,
    q_len, kv_len, scale, chunk=0, window=0, softcap=0.0, tile_from=4)`` once loaded, else None
    (`start` is called).

    The op: ``q`` and ``out`` [T, H, D] (contiguous, float32, float64 or bfloat16, CPU: bfloat16
    computed in float32 on the widened values and rounded once); ``k_pool`` and
    ``v_pool`` one layer's pool [slots, Hkv, D]; ``table`` [R, Lmax] int64: request r's key
    position l is in slot ``table[r, l]``; ``q_start``, ``q_len``, ``kv_len`` [R] int64: request
    r's queries are rows ``q_start[r]`` to ``q_start[r] + q_len[r] - 1`` of ``q`` and its query t
    sees keys ``l < kv_len[r] - q_len[r] + t + 1``; ``scale`` multiplies the scores; ``chunk``:
    keys per split-K task (0: the kernel picks, two tasks per thread at least, at most 2,048
    keys); ``window``: each query sees its last ``window`` keys (0: all); ``softcap``: scores
    capped to ``softcap * tanh(s / softcap)`` (0: none); ``tile_from``: a request of this many
    queries or more (0: none) is scored 16 keys at a time (float32 and bfloat16 with AVX-512: the same bits,
    faster for long extends; `kernel_choice.tile_choice` measures where). It writes those rows of
    ``out`` (others untouched). Raises RuntimeError on shapes, dtypes or lengths that do not fit.

    Args:
        wait: wait for the build (at most ``timeout`` seconds).
    """
    if not _BUILD.done.is_set():
        _BUILD.start()
        if not wait or not _BUILD.done.wait(timeout):
            return None
    return _BUILD.op


class StepOps:
    """The fused float32 and bfloat16 ops of the native forward's eager steps (``csrc/step_ops.cpp``;
    bfloat16 with the roundings of the ATen ops they replace), in the
    form `tokenrouter_sdk.backends.native_forward.decoder_step` calls them. Each replaces several
    ATen calls (RMSNorm alone is about eight), whose fixed cost is most of the time between a
    decode step's GEMMs."""

    @staticmethod
    def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
        """``norm(x)`` of a Llama-family RMSNorm: x [..., C] float32 or bfloat16 (the weight's
        dtype); returns a new [..., C]."""
        return torch.ops.tokenrouter_cpu.rms_norm(x, norm.weight, float(norm.variance_epsilon))

    @staticmethod
    def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``t * cos + roll(t, D / 2) * sin``: t [T, H, D] (unit stride in D), cos and sin [T, D]
        (sin with rotate_half's signs folded in); returns a contiguous [T, H, D]."""
        return torch.ops.tokenrouter_cpu.rope(t, cos, sin)

    @staticmethod
    def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``silu(g) * u``: g, u [N, F] (unit stride in F); returns a new [N, F]."""
        return torch.ops.tokenrouter_cpu.silu_mul(g, u)


_STEP_OPS = StepOps()


def step_ops() -> StepOps | None:
    """The fused step ops once the kernels are loaded, else None (`start` is called)."""
    return _STEP_OPS if paged_attention_op() is not None else None


def error() -> str | None:
    """Why the kernel is not available in this process (None while building or once loaded)."""
    return _BUILD.error
