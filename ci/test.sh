#!/usr/bin/env bash
# Run every test of the repository in the project's virtual environment.
# pytest exits 5 when it collected no test: that means broken test paths, so it fails here.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
"$VENV/bin/python" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests; check testpaths in pyproject.toml" >&2
  exit 1
fi
exit "$rc"
