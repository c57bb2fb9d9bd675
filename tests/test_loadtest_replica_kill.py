"""The pure parts of ``python -m service.loadtest.replica_kill``: its tally and the process walk that
finds the service's own replicas (the run itself starts the service: docs/deploy.md#replica-loss)."""
from __future__ import annotations

import os
import subprocess
import sys

from service.loadtest.replica_kill import Tally, descendants, ingress_replicas


def test_the_tally_counts_each_kind_and_keeps_the_causes():
    t = Tally()
    t.add("plain", "answered")
    t.add("plain", "lost", "RemoteProtocolError Server disconnected")
    t.add("stream", "failed", "error event replica_lost")
    assert t.row("plain") == {"sent": 2, "answered": 1, "failed": 0, "lost": 1}
    assert t.row("stream") == {"sent": 1, "answered": 0, "failed": 1, "lost": 0}
    assert t.causes == {"plain lost: RemoteProtocolError Server disconnected": 1,
                        "stream failed: error event replica_lost": 1}


def test_only_processes_below_the_service_are_found():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in descendants(os.getpid())
        assert child.pid not in descendants(child.pid)
        assert ingress_replicas(child.pid) == []        # no ray::ServeReplica:*:Gateway below the child
        assert set(ingress_replicas(os.getpid())) <= set(descendants(os.getpid()))   # (a shared service's, if any)
    finally:
        child.kill()
        child.wait()
