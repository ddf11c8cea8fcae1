#!/usr/bin/env bash
# Set up (see setup.sh) and run the whole test suite: unit, property, real clients, and the
# corosync cluster tests in network namespaces (these need root; on CI they must run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests bench scripts
.venv/bin/ruff format --check src tests bench scripts
.venv/bin/mypy
# The dependency rule (pyproject.toml [tool.importlinter]): layers, pure packages, no cycles.
.venv/bin/lint-imports --no-cache --no-logo
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
# pytest's 5 means it collected no test at all: that is a failure for us, not a pass.
if [ "$rc" -eq 5 ]; then echo "test: no tests were collected"; exit 1; fi
exit "$rc"
