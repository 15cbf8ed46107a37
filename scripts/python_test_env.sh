#!/usr/bin/env bash
# Creates (once) the Python environment of tests/python/ (scripts/python_test.sh runs them in it):
# a venv over Debian's /usr/bin/python3 that sees python3-torch (CPU), plus transformers.
# SPADE_PYENV overrides the location (default ~/.cache/spade/pyenv).
set -euo pipefail
ENV="${SPADE_PYENV:-$HOME/.cache/spade/pyenv}"
TRANSFORMERS="transformers==4.46.3"   # the last releases that still accept torch 1.13
if [ -x "$ENV/bin/python" ] && "$ENV/bin/python" -c 'import torch, transformers' 2>/dev/null; then
  exit 0
fi
/usr/bin/python3 -c 'import torch' || { echo "python_test_env: Debian's python3-torch missing" >&2; exit 1; }
mkdir -p "$(dirname "$ENV")"
/usr/bin/python3 -m venv --system-site-packages "$ENV"
"$ENV/bin/python" -m pip install -q --disable-pip-version-check "$TRANSFORMERS"
"$ENV/bin/python" -c 'import torch, transformers; print("python_test_env: torch", torch.__version__, "transformers", transformers.__version__)'
