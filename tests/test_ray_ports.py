"""The Ray metrics agent's port under ``python -m service`` (service/ray_env.py ``metrics_export_port``):
a second instance on one machine must not start Ray on the first one's port (its dashboard agent
exits with 'Address already in use' and Ray's start fails after a timeout, naming no port)."""
from __future__ import annotations

import socket

import pytest

from service.ray_env import SPARE_PORTS, metrics_export_port


def _held_port() -> socket.socket:
    """A socket listening on a port the OS picked, as another instance's metrics agent would."""
    sock = socket.socket()
    sock.bind(("0.0.0.0", 0))
    sock.listen()
    return sock


def test_a_taken_default_metrics_port_gives_a_free_spare_one():
    with _held_port() as held:
        taken = held.getsockname()[1]
        port = metrics_export_port(None, default=taken)
        assert port != taken and port in SPARE_PORTS
        with socket.socket() as probe:              # free now: the agent can bind it
            probe.bind(("0.0.0.0", port))
    with _held_port() as held:
        free = held.getsockname()[1]
    assert metrics_export_port(None, default=free) == free       # free default: kept


def test_a_taken_requested_metrics_port_is_refused_naming_the_option():
    with _held_port() as held:
        taken = held.getsockname()[1]
        with pytest.raises(ValueError, match=rf"--metrics-export-port: port {taken} is taken"):
            metrics_export_port(taken)
    assert metrics_export_port(taken) == taken                   # released: accepted as asked


@pytest.mark.slow       # runs python -m service (it exits before Ray starts)
@pytest.mark.parametrize("args, words", [
    (["--ingress", "both"], "ingress Input should be 'translator' or 'separate'"),
    (["--metrics-export-port", "{taken}"], "--metrics-export-port: port {taken} is taken"),
])
def test_python_m_service_refusing_its_arguments_leaves_no_haproxy_directory(tmp_path, args, words):
    """`python -m service` with arguments it refuses exits with one line before Ray starts, and
    leaves nothing in the temporary directory (each run used to leave a /tmp/mt-haproxy-* behind)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT
    with _held_port() as held:
        taken = held.getsockname()[1]
        args = [a.format(taken=taken) for a in args]
        r = subprocess.run([sys.executable, "-m", "service", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 2 and words.format(taken=taken) in r.stderr, r.stderr[-2000:]
    assert "Started a local Ray instance" not in r.stderr + r.stdout
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("mt-haproxy-")] == []
