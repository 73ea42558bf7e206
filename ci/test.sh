#!/usr/bin/env bash
# Run every check of the repository in the project's virtual environment: first the two
# quality gates (ruff, mypy; their configuration is in pyproject.toml), then every test.
# A failing gate stops the script before the tests, with the gate's findings as the output.
# pytest exits 5 when it collected no test: that means broken test paths, so it fails here.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

gates_failed=()
echo "== ruff check (lint; rules in pyproject.toml [tool.ruff])"
"$VENV/bin/ruff" check --no-cache . || gates_failed+=("ruff")
echo "== mypy (types; strict on tnt-core; pyproject.toml [tool.mypy])"
"$VENV/bin/mypy" || gates_failed+=("mypy")
if [ "${#gates_failed[@]}" -gt 0 ]; then
  echo "error: quality gate(s) failed: ${gates_failed[*]}; fix the findings above (tests not run)" >&2
  exit 1
fi

echo "== pytest"
# the slowest tests listed: the suite must stay within CI's 15 minutes (README)
"$VENV/bin/python" -m pytest --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests; check testpaths in pyproject.toml" >&2
  exit 1
fi
exit "$rc"
