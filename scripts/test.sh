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

bash scripts/browser.sh || {
  if [ "${CI:-}" = "true" ]; then echo "test: Chromium is missing (CI=true)" >&2; exit 1; fi
  echo "test: Chromium is missing; the dashboard test will be skipped"
}

echo "== ruff"; "$VENV/bin/ruff" check .
echo "== ruff format"; "$VENV/bin/ruff" format --check .
echo "== import layers"; "$VENV/bin/lint-imports" --no-cache
echo "== mypy"; "$VENV/bin/mypy"
echo "== pytest"
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "test: pytest collected no tests - that is a failure" >&2; exit 1; fi
exit $rc
