#!/usr/bin/env bash
# Install Debian's headless-capable Chromium and its WebDriver (`chromium`, `chromium-driver`) when
# /usr/bin/chromium or /usr/bin/chromedriver is missing. Used by `make test` and by
# tests/test_explorer.py (the attention explorer's browser tests, driven by selenium with the system
# chromedriver). Needs root (or sudo) and apt-get; idempotent. Nothing is downloaded at test time:
# selenium is given the system driver, so its own driver manager never runs.
set -euo pipefail

CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
CHROMEDRIVER=${CHROMEDRIVER:-/usr/bin/chromedriver}
if [ -x "$CHROMIUM" ] && [ -x "$CHROMEDRIVER" ]; then
    echo "chromium already installed: $("$CHROMIUM" --version 2>/dev/null | head -1)"
    exit 0
fi
. "$(dirname "$0")/apt_install.sh"
apt_install "chromium and chromedriver" chromium chromium-driver
"$CHROMIUM" --version 2>/dev/null | head -1
"$CHROMEDRIVER" --version | head -1
