#!/usr/bin/env bash
# Install a Prometheus server (Debian's `prometheus` package, which also ships `promtool`) when
# `prometheus` is not on PATH yet. Used by tests/test_prometheus.py and by anyone who wants to scrape
# the service outside docker-compose. Needs root (or sudo) and apt-get; idempotent.
#
# Only the binaries are used: the test runs `prometheus` as its own process with the scrape config
# from deploy/prometheus.yml. The Debian service the package would start is kept off (policy-rc.d),
# so nothing else listens on port 9090.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "prometheus already installed: $(command -v prometheus)"
    exit 0
fi
. "$(dirname "$0")/apt_install.sh"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

# Keep the package's init scripts from starting a system-wide Prometheus (exit 101 = "not allowed").
POLICY=/usr/sbin/policy-rc.d
CREATED_POLICY=0
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod +x "$POLICY"
    CREATED_POLICY=1
fi
cleanup() { if [ "$CREATED_POLICY" = 1 ]; then $SUDO rm -f "$POLICY"; fi; }
trap cleanup EXIT

apt_install "Prometheus (with promtool)" prometheus

# Debian's package may start the daemon where systemd is absent anyway; stop only that service.
if command -v service >/dev/null 2>&1; then
    $SUDO service prometheus stop >/dev/null 2>&1 || true
fi
prometheus --version 2>&1 | head -1
promtool --version 2>&1 | head -1
