#!/usr/bin/env bash
# Make sure a headless Chromium is there for the dashboard test (tests/integration/
# test_dashboard_browser.py); install Debian's package when missing and we may (root, apt).
# Exit 1 if there is none afterwards: the test then skips locally and fails under CI=true.
set -uo pipefail

for name in chromium chromium-browser google-chrome; do
  if command -v "$name" >/dev/null; then echo "browser: $name is installed"; exit 0; fi
done
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
  echo "browser: installing chromium (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq chromium; } >/dev/null 2>&1
  if command -v chromium >/dev/null; then echo "browser: chromium installed"; exit 0; fi
fi
echo "browser: Chromium is not installed and could not be installed here." >&2
echo "         Install it (Debian: apt-get install chromium) for the dashboard test." >&2
exit 1
