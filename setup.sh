#!/usr/bin/env bash
# Set up this repo on a fresh machine: .venv with CPU torch, the package (editable, with test and
# gguf extras), and the default SmolLM2 pair converted once into the cache (~/.cache/tokenrouter,
# or $TOKENROUTER_CACHE). Idempotent: a second run only checks (a few seconds).
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
from tokenrouter_sdk.models import cache_dir, smollm2_folder
if not (cache_dir() / "smollm2-135m-instruct" / "config.json").exists():
    print("setup.sh: converting the default model (SmolLM2-135M-Instruct, once, ~1 min)", flush=True)
print("setup.sh: default model at", smollm2_folder())
PY
