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
