#!/usr/bin/env bash
# Sourced by deploy/install_*.sh: apt_install WHAT PACKAGE... installs Debian packages with apt-get
# (through sudo when not root), or fails saying to install WHAT by hand where apt-get is missing.
apt_install() {
    local what=$1
    shift
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "error: apt-get not found; install $what by hand" >&2
        exit 1
    fi
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    fi
    DEBIAN_FRONTEND=noninteractive $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "$@"
}
