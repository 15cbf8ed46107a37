#!/usr/bin/env bash
# Runs one tests/python/ script with the environment of scripts/python_test_env.sh when it
# exists, else with python3 (where the script skips, exit 77, if torch is missing).
ENV="${SPADE_PYENV:-$HOME/.cache/spade/pyenv}"
PY=python3
if [ -x "$ENV/bin/python" ]; then PY="$ENV/bin/python"; fi
exec "$PY" "$@"
