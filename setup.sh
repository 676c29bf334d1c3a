#!/usr/bin/env bash
# Create .venv (once) and install the project with its test tools.
# torch 2.13.0 is installed first so the range in pyproject.toml is already met (a bare
# "torch" requirement may download a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e '.[dev]'
