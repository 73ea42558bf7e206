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

# With arguments: one pytest run with them (a file, -k, -x ...). Without: every test, in
# two shards side by side. Most tests wait on processes they started (ranks, launchers,
# timeouts) and leave a core idle; the other shard's work fills it. tnt-cli and tnt-keras
# go together, in that order: tnt-keras' conftest starts its rank launches at collection,
# and the tnt-cli tests, which mostly wait, run while they compute. Shard "a" streams; "b"
# is printed when both have ended.
# The slowest tests are listed: the suite must stay within CI's 15 minutes (README).
check_rc() {  # pytest exits 5 when it collected no test: broken test paths, so a failure
  if [ "$1" -eq 5 ]; then
    echo "error: pytest collected no tests in shard $2; check the test paths" >&2
    return 1
  fi
  return "$1"
}

echo "== pytest"
if [ "$#" -gt 0 ]; then
  "$VENV/bin/python" -m pytest --durations=25 "$@"
  check_rc $? "(all)"
  exit $?
fi

SHARD_A=(packages/tnt-cli/tests packages/tnt-keras/tests)
SHARD_B=(packages/tnt-core/tests packages/tnt-comm-gloo/tests packages/tnt-comm-mpi/tests tests)
# the shards together are pyproject.toml's testpaths, each once
"$VENV/bin/python" - "${SHARD_A[@]}" "${SHARD_B[@]}" <<'PY' || exit 1
import sys, tomllib
paths = tomllib.load(open("pyproject.toml", "rb"))["tool"]["pytest"]["ini_options"]["testpaths"]
if sorted(sys.argv[1:]) != sorted(paths):
    sys.exit(f"error: ci/test.sh's shards {sys.argv[1:]} are not pyproject.toml's testpaths {paths}")
PY
logs=$(mktemp -d)
pid_b=
trap 'if [ -n "$pid_b" ]; then kill "$pid_b" 2>/dev/null; fi; rm -rf "$logs"' EXIT
"$VENV/bin/python" -m pytest --durations=15 "${SHARD_B[@]}" >"$logs/b.log" 2>&1 &
pid_b=$!
echo "-- shard a: ${SHARD_A[*]}"
"$VENV/bin/python" -m pytest --durations=15 "${SHARD_A[@]}"
rc_a=$?
wait "$pid_b"
rc_b=$?
pid_b=
echo "-- shard b: ${SHARD_B[*]}"
cat "$logs/b.log"
failed=()
check_rc "$rc_a" a || failed+=("a (${SHARD_A[*]})")
check_rc "$rc_b" b || failed+=("b (${SHARD_B[*]})")
if [ "${#failed[@]}" -gt 0 ]; then
  echo "error: failed shard(s): ${failed[*]}; the output of each is above" >&2
  exit 1
fi
