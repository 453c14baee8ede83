"""Running the shards of a sweep on several workers, then merging them.

A sweep's points are independent, content-addressed files (`tokenrouter_sdk.eval.sweep`), so a
sweep spreads over workers as shards: ``tokenrouter eval ... --shard i/N`` runs the i-th share
(each with its own Router), ``tokenrouter eval --merge --out DIR`` (`merge_sweep`) computes
what needs every point. This module launches all N shards of one command and merges them:

- ``local``: N processes of this machine (``python -m tokenrouter_sdk.cli eval ... --shard i/N``),
  each with ``--threads`` torch threads;
- ``ray``: N Ray tasks (``num_cpus`` / ``num_gpus`` each) on a cluster (``ray.init(address)``);
  a task runs its shard into a folder of its node and returns the files, which the driver writes
  into ``--out``, so no shared file system is needed.

A job array (SLURM and the like) needs nothing from here: give each job ``--shard $i/N`` and the
same ``--out`` on a shared file system, then run the merge.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


def shard_argv(argv: list[str], i: int, n: int, out: str) -> list[str]:
    """``tokenrouter eval`` arguments of shard ``i`` (1-based) of ``n`` writing into ``out``."""
    return [*argv, "--shard", f"{i}/{n}", "--out", out, "--no-progress"]


def run_local(argv: list[str], n: int, out: str, *, threads: int = 1, timeout_s: float | None = None) -> None:
    """Run the ``n`` shards of ``tokenrouter eval argv`` as processes of this machine, at once.

    Raises:
        RuntimeError: a shard failed (names it and the end of its output).
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    procs = []
    logs = Path(out) / "shards"
    logs.mkdir(parents=True, exist_ok=True)
    for i in range(1, n + 1):
        log = open(logs / f"shard-{i}-of-{n}.log", "w")
        cmd = [sys.executable, "-m", "tokenrouter_sdk.cli", "eval", *shard_argv(argv, i, n, out)]
        procs.append((i, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    failed = []
    try:
        for i, p, log in procs:
            rc = p.wait(timeout=timeout_s)
            log.close()
            if rc:
                failed.append((i, rc, log.name))
    finally:
        for _, p, _ in procs:
            if p.poll() is None:
                p.kill()
    if failed:
        i, rc, path = failed[0]
        tail = Path(path).read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{len(failed)} of {n} shards failed; shard {i} exited {rc} (log {path}):\n{tail}")


def _ray_shard(argv: list[str], entry) -> dict[str, bytes]:
    """A Ray task: run one shard into a temporary folder with ``entry`` (``tokenrouter eval``'s
    ``main(argv) -> exit status``); return its files (relative path -> bytes)."""
    with tempfile.TemporaryDirectory(prefix="tokenrouter-shard-") as tmp:
        args = list(argv)
        k = args.index("--out")
        args[k + 1] = tmp
        rc = entry(args)
        if rc:
            raise RuntimeError(f"tokenrouter eval {' '.join(argv)} exited {rc}")
        return {
            p.relative_to(tmp).as_posix(): p.read_bytes()
            for p in Path(tmp).rglob("*")
            if p.is_file() and p.parent != Path(tmp)
        }  # points/ and shards/, not the shard's own results


def run_ray(
    argv: list[str], n: int, out: str, entry, *, address: str | None = None, num_cpus: float = 1, num_gpus: float = 0
) -> None:
    """Run the ``n`` shards as Ray tasks and write their files into ``out``; ``entry`` runs one
    (``tokenrouter_sdk.cli.eval.main``, passed in so that this module does not import the command).

    Raises:
        ImportError: Ray is not installed (names the extra).
    """
    try:
        import ray
    except ImportError as e:
        raise ImportError("sharded sweeps on Ray need Ray: pip install 'tokenrouter-sdk[ray]'") from e
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(_ray_shard)
        refs = [task.remote(shard_argv(argv, i, n, "OUT"), entry) for i in range(1, n + 1)]
        for files in ray.get(refs):
            for rel, data in files.items():
                path = Path(out) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
    finally:
        if started:
            ray.shutdown()
