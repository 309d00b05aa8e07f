#!/usr/bin/env bash
# The README's test command: install into a fresh virtualenv, bring up RabbitMQ and Redis, run the
# whole suite (lint, types, tests). Exit non-zero on any failure, including "no tests collected".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPLITMQ_VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# torch first and exactly: a resolver left alone may pull a multi-GB CUDA build.
"$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
"$VENV/bin/pip" install -q --disable-pip-version-check -e ".[dev]"

bash scripts/services.sh || {
  if [ "${CI:-}" = "true" ]; then echo "test: required services are missing (CI=true)" >&2; exit 1; fi
  echo "test: some services are missing; their tests will be skipped (set CI=true to fail instead)"
}

# The local cluster (tests/cluster) boots in the background while lint and types run; pytest
# waits for it. One that was already up is used and left up; one started here is taken down.
cluster_job=""
cluster_log=$(mktemp)
if bash scripts/cluster.sh status >/dev/null 2>&1; then
  echo "test: the local cluster is already up; using it"
else
  bash scripts/cluster.sh up >"$cluster_log" 2>&1 &
  cluster_job=$!
fi
cleanup() {
  if [ -n "$cluster_job" ]; then
    wait "$cluster_job" 2>/dev/null || true
    bash scripts/cluster.sh down >/dev/null 2>&1 || echo "test: cluster.sh down failed" >&2
  fi
  rm -f "$cluster_log"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bash scripts/browser.sh || {
  if [ "${CI:-}" = "true" ]; then echo "test: Chromium is missing (CI=true)" >&2; exit 1; fi
  echo "test: Chromium is missing; the dashboard test will be skipped"
}

echo "== ruff"; "$VENV/bin/ruff" check .
echo "== ruff format"; "$VENV/bin/ruff" format --check .
echo "== import layers"; "$VENV/bin/lint-imports" --no-cache
echo "== mypy"; "$VENV/bin/mypy"
if [ -n "$cluster_job" ]; then
  echo "== local cluster"
  if wait "$cluster_job"; then
    cat "$cluster_log"
  else
    cat "$cluster_log" >&2
    if [ "${CI:-}" = "true" ]; then echo "test: the local cluster did not come up (CI=true)" >&2; exit 1; fi
    echo "test: the local cluster did not come up; its tests will try again, or skip without the packages"
  fi
fi
echo "== pytest"
# Two phases: everything but the `exclusive` tests on SPLITMQ_TEST_WORKERS pytest-xdist workers
# (default 2 where there are 2 cores or more; a file's tests stay on one worker, see
# tests/conftest.py), then the `exclusive` ones (failovers timed against Sentinel's and
# RabbitMQ's clocks, the flood's round-time ratio) in one process with the machine to themselves. SPLITMQ_TEST_WORKERS=0 runs
# everything in one process, one phase. Arguments go to both phases; "no tests collected" (exit
# 5) is a failure unless the other phase ran tests.
cores=$(nproc 2>/dev/null || echo 1)
workers="${SPLITMQ_TEST_WORKERS:-$([ "$cores" -ge 2 ] && echo 2 || echo 0)}"
pytest=("$VENV/bin/python" -m pytest)
set +e
if [ "$workers" = "0" ]; then
  "${pytest[@]}" "$@"
  rc=$?
  if [ $rc -eq 5 ]; then echo "test: pytest collected no tests - that is a failure" >&2; exit 1; fi
  exit $rc
fi
"${pytest[@]}" -n "$workers" --dist loadgroup -m "not exclusive" "$@"
rc_parallel=$?
echo "== pytest (exclusive: failovers, one process)"
"${pytest[@]}" -m exclusive "$@"
rc_exclusive=$?
set -e
if [ $rc_parallel -eq 5 ] && [ $rc_exclusive -eq 5 ]; then
  echo "test: pytest collected no tests - that is a failure" >&2
  exit 1
fi
for rc in $rc_parallel $rc_exclusive; do
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then exit $rc; fi
done
exit 0
