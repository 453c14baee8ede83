"""The conventions every script in ``evals/`` follows: one argument parser and one way to write
results.

- Arguments: `parser` builds an ``argparse`` parser whose description is the script's docstring and
  which always has ``--out DIR``. Scripts import the package and torch only after parsing, so
  ``--help`` is instant and loads no model (``tests/unit/test_evals_scripts.py`` runs every
  script with ``--help``).
- Output: `Output` writes ``DIR/<script>[_<cells>].json`` (the arguments, the environment, the
  rows and any extra fields) and, for tabular results, ``DIR/<script>[_<cells>].csv`` (one line per
  row); the script prints its table too. ``<cells>`` names what varied (e.g. ``c1-8_t64``), so runs
  with other cells do not overwrite each other.

Scripts find this module by putting ``evals/`` on ``sys.path`` (the three lines at their top), so
they run from any folder: ``.venv/bin/python evals/<group>/<script>.py --help``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import time
from pathlib import Path

DEFAULT_OUT = Path("evals_out")


def parser(script: str, doc: str | None) -> argparse.ArgumentParser:
    """An argument parser for the script at path ``script`` (pass ``__file__``), described by its
    docstring ``doc``, with ``--out DIR`` (default ``evals_out/``)."""
    path = Path(script).resolve()
    p = argparse.ArgumentParser(
        prog=f"evals/{path.parent.name}/{path.name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"folder for the result files (default {DEFAULT_OUT}/): {path.stem}[_<cells>].json/.csv",
    )
    return p


def cells_tag(*names: str, **cells) -> str:
    """``cells_tag("sim", c=[1, 8], t=64)`` -> ``"sim_c1-8_t64"``: what varied in a run, for file
    names (names as they are, then each key followed by its value). Lists join with ``-``; None
    and empty values are left out."""
    parts = [str(n) for n in names if n]
    for key, v in cells.items():
        if v is None or v == [] or v == "":
            continue
        v = "-".join(str(x) for x in v) if isinstance(v, (list, tuple)) else str(v)
        parts.append(f"{key}{v}")
    return "_".join(parts).replace("/", "-").replace(" ", "")


def environment() -> dict:
    """Versions, torch threads, CPU count and load average (imports torch)."""
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if hasattr(os, "getloadavg"):
        env["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    env["cpu"] = cpu_description()
    return env


SIMD_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
    "sve",
    "asimd",
)


def cpu_description() -> dict:
    """The CPU a result was measured on (Linux ``/proc/cpuinfo`` and sysfs): model name, vendor,
    family/model/stepping, the SIMD flags that decide kernels (`SIMD_FLAGS` present), and each
    cache level's size of CPU 0 (``{"L1d": "48K", "L2": "1024K", "L3": "32768K"}``)."""
    info: dict = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU's block
                k, _, v = line.partition(":")
                info[k.strip()] = v.strip()
    except OSError:
        pass
    flags = set(info.get("flags", info.get("Features", "")).split())
    caches = {}
    for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind = (idx / "level").read_text().strip(), (idx / "type").read_text().strip()
            caches[f"L{level}{'d' if kind == 'Data' else 'i' if kind == 'Instruction' else ''}"] = (
                (idx / "size").read_text().strip()
            )
        except OSError:
            continue
    return {
        "model": info.get("model name", platform.processor() or platform.machine()),
        "vendor": info.get("vendor_id", ""),
        "family_model_stepping": "/".join(info.get(k, "?") for k in ("cpu family", "model", "stepping")),
        "simd": [f for f in SIMD_FLAGS if f in flags],
        "caches": caches,
    }


class Output:
    """Result files of one run: ``<out>/<script>[_<cells>].{json,csv}``.

    Args:
        args: the parsed arguments (``args.out`` is the folder; all of them go into the JSON).
        script: the script's path (``__file__``).
        cells: the cells tag (`cells_tag`), or "" for none.
    """

    def __init__(self, args: argparse.Namespace, script: str, cells: str = ""):
        self.args = args
        self.folder = Path(args.out)
        self.name = Path(script).stem + (f"_{cells}" if cells else "")

    def path(self, suffix: str) -> Path:
        """``<out>/<name><suffix>`` (the folder is created)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder / f"{self.name}{suffix}"

    def write(self, rows: list[dict] | None = None, **extra) -> list[Path]:
        """Write the JSON (arguments, `environment`, ``rows``, ``extra``) and, when ``rows`` is
        given, the CSV (columns: the union of the rows' keys, in first-seen order). Prints and
        returns the paths."""
        doc = {
            "script": self.name,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()},
            "environment": environment(),
        }
        if rows is not None:
            doc["rows"] = rows
        doc.update(extra)
        paths = [self.path(".json")]
        paths[0].write_text(json.dumps(doc, indent=1, default=str) + "\n")
        if rows:
            cols: list[str] = []
            for r in rows:
                cols += [k for k in r if k not in cols]
            paths.append(self.path(".csv"))
            with open(paths[1], "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=cols)
                w.writeheader()
                for r in rows:
                    w.writerow(
                        {
                            k: json.dumps(v, default=str) if isinstance(v, (dict, list, tuple)) else v
                            for k, v in r.items()
                        }
                    )
        print("wrote " + ", ".join(str(p) for p in paths), flush=True)
        return paths


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A fixed-width text table (text columns left-aligned, numbers right-aligned): ``columns`` are
    ``(key, header, format)``, e.g. ``("tok_s", "tok/s", ".1f")``; missing values print as ``-``."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else format(r[k], f) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    left = [f == "s" for _, _, f in columns]  # text columns read better left-aligned
    lines = ["  ".join(c.ljust(w) if lft else c.rjust(w) for c, w, lft in zip(row, widths, left)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
