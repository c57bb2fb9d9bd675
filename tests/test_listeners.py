"""What listens where (docs/security.md#what-listens-where): every TCP listener of ``python -m service``'s
process tree (Ray's servers and agents, Serve's proxies and replicas, HAProxy's stats page and
exporter) binds loopback, but HAProxy's HTTP frontend, which binds ``--host``. Each replica's gRPC
server for handle calls, which Serve binds to every interface (``[::]:0``, ray/serve/_private/replica.py),
binds the node's address through a worker setup hook (``service.ray_env.replica_grpc_on_node_address``).

Listeners are read from /proc for the service's own process tree only: other Ray instances run on
this machine."""
from __future__ import annotations

import collections
import ipaddress
import os
import socket
import subprocess
import sys
from typing import NamedTuple

import httpx
import pytest

from conftest import ROOT, build_tiny_checkpoint, free_port
from service.ray_env import (FRONTEND_HOST_VAR, HAPROXY_BINARY_VAR, HAPROXY_DEFAULT_PORTS, LOOPBACK_RAY, STATS_HOST_VAR,
                             haproxy_wrapper, serve_http_host)
from test_service_main import python_m_service


class Listener(NamedTuple):
    address: str     # as bound: 0.0.0.0 / :: = every interface
    port: int
    pid: int
    process: str     # its command line (Ray's workers name themselves: ray::ServeReplica:...)


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (by parent pid, read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue            # exited meanwhile
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)     # /proc/net/tcp*: 32-bit words in host (little-endian) order
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def tcp_listeners(pids: list[int]) -> list[Listener]:
    """The listening TCP sockets (IPv4 and IPv6) that ``pids`` hold open."""
    listening = {}      # socket inode -> (address, port)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":                        # TCP_LISTEN
                    address, port = cols[1].split(":")
                    listening[cols[9]] = (_address(address), int(port, 16))
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                process = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                found.add(Listener(*listening[target[8:-1]], pid, process[:80]))
    return sorted(found, key=lambda x: (x.port, x.pid))


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def test_tcp_listeners_reads_this_process_sockets():
    with socket.socket() as loop, socket.socket(socket.AF_INET6) as every:
        loop.bind(("127.0.0.1", 0))
        loop.listen()
        every.bind(("::", 0))
        every.listen()
        mine = {(x.address, x.port) for x in tcp_listeners(process_tree(os.getpid()))}
        assert {("127.0.0.1", loop.getsockname()[1]), ("::", every.getsockname()[1])} <= mine
    assert is_loopback("127.0.0.1") and is_loopback("::ffff:127.0.0.1") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.0.2.2")


def _serve_haproxy_config(tmp_path, host: str) -> str:
    """The haproxy.cfg Serve writes (its own template and code) for HTTP on ``host``:8000, stats on
    18404, exporter on 19101; its path."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions
    cfg = HAProxyConfig(http_options=HTTPOptions(host=host, port=8000), stats_port=18404, metrics_port=19101,
                        socket_path=str(tmp_path / "admin.sock"), server_state_base=str(tmp_path),
                        server_state_file=str(tmp_path / "state"), metrics_socket_path=str(tmp_path / "m.sock"))
    path = str(tmp_path / "haproxy.cfg")
    HAProxyApi(cfg, config_file_path=path)._generate_config_file_internal()
    return path


@pytest.mark.parametrize("host, env, want", [
    ("127.0.0.1", {}, {"127.0.0.1:8000", "127.0.0.1:18404", "127.0.0.1:19101"}),
    ("0.0.0.0", {}, {"*:8000", "127.0.0.1:18404", "127.0.0.1:19101"}),
    # python -m service --host 0.0.0.0: Serve on 127.0.0.1, HAProxy's frontend alone on every interface
    ("127.0.0.1", {FRONTEND_HOST_VAR: "0.0.0.0"}, {"0.0.0.0:8000", "127.0.0.1:18404", "127.0.0.1:19101"}),
    ("127.0.0.1", {STATS_HOST_VAR: "*"}, {"127.0.0.1:8000", "*:18404", "*:19101"}),     # Serve's binding, as chosen
    ("127.0.0.1", {STATS_HOST_VAR: "10.0.0.5"}, {"127.0.0.1:8000", "10.0.0.5:18404", "10.0.0.5:19101"}),
])
def test_haproxy_wrapper_binds_each_listener_where_chosen(tmp_path, monkeypatch, host, env, want):
    """Serve's config binds HAProxy's stats page and exporter to every interface and its frontend to
    Serve's HTTP host; the wrapper Serve runs as HAProxy rewrites those lines (only) before HAProxy
    reads them, the same on every reload."""
    config = _serve_haproxy_config(tmp_path, host)
    fake = tmp_path / "fake-haproxy"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\n')
    fake.chmod(0o755)
    for var in (STATS_HOST_VAR, FRONTEND_HOST_VAR):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    wrapper = haproxy_wrapper(str(tmp_path), binary=str(fake))
    with open(config) as f:
        before = [line for line in f if not line.strip().startswith("bind ")]
    for _ in range(2):                     # a reload runs it again on the same file (sh: the script, no HAProxy)
        subprocess.run(["/bin/sh", wrapper, "-db", "-f", config, "-dR"], check=True, timeout=30)
    with open(config) as f:
        lines = f.readlines()
    assert {line.split()[1] for line in lines if line.strip().startswith("bind ")} == want
    added = [line.strip() for line in lines if line not in before and not line.strip().startswith("bind ")]
    assert added == ["# mt: forwarded headers"] + [f"http-request del-header {h}" for h in FORWARDED] + [
        "option forwardfor", "option http-buffer-request"]   # once, whatever the reloads
    assert [line for line in lines if not line.strip().startswith("bind ") and line.strip() not in added] == before
    assert (tmp_path / "args").read_text().split() == ["-dS", "-db", "-f", config, "-dR"]


FORWARDED = ("x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "forwarded")


def test_haproxy_wrapper_keeps_forwarded_headers_of_trusted_proxies_only(tmp_path, monkeypatch):
    """A client's own X-Forwarded-* and Forwarded are dropped at HAProxy's frontend unless it is a
    trusted proxy, HAProxy adds the client's address, and the replicas' ASGI server trusts HAProxy and
    those proxies (FORWARDED_ALLOW_IPS); the real HAProxy accepts the config."""
    from service.ray_env import TRUSTED_PROXIES_VAR, serve_env
    config = _serve_haproxy_config(tmp_path, "127.0.0.1")
    monkeypatch.setenv(TRUSTED_PROXIES_VAR, "10.0.0.5, 10.0.0.6")
    subprocess.run(["/bin/sh", haproxy_wrapper(str(tmp_path), binary="/bin/true"), "-f", config], check=True, timeout=30)
    text = open(config).read()
    front = text[text.index("frontend http_frontend"):].split("\n\n")[0]
    for h in FORWARDED:
        assert f"http-request del-header {h} unless {{ src 10.0.0.5 10.0.0.6 }}" in front
    assert front.count("option forwardfor") == 1
    assert serve_env(workdir=str(tmp_path / "w")).get("FORWARDED_ALLOW_IPS") in (None, "127.0.0.1,10.0.0.5,10.0.0.6")


@pytest.mark.slow
def test_the_real_haproxy_accepts_the_rewritten_config(tmp_path, monkeypatch):
    from service.ray_env import TRUSTED_PROXIES_VAR, real_haproxy
    binary = real_haproxy()
    if binary is None:
        pytest.skip("no HAProxy binary installed")
    config = _serve_haproxy_config(tmp_path, "127.0.0.1")
    monkeypatch.setenv(TRUSTED_PROXIES_VAR, "10.0.0.0/8")
    subprocess.run(["/bin/sh", haproxy_wrapper(str(tmp_path), binary="/bin/true"), "-f", config], check=True, timeout=30)
    r = subprocess.run([binary, "-c", "-f", config], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "Configuration file is valid" in r.stdout + r.stderr, r.stdout + r.stderr


def test_haproxy_wrapper_refuses_what_is_no_address(tmp_path, monkeypatch):
    config = _serve_haproxy_config(tmp_path, "127.0.0.1")
    monkeypatch.setenv(FRONTEND_HOST_VAR, "1.2.3.4/x")
    r = subprocess.run(["/bin/sh", haproxy_wrapper(str(tmp_path), binary="/bin/true"), "-f", config],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "not an address: 1.2.3.4/x" in r.stderr


def test_serve_http_host_moves_serve_to_loopback_behind_the_wrapper_only(tmp_path, monkeypatch):
    monkeypatch.delenv(FRONTEND_HOST_VAR, raising=False)
    assert serve_http_host("0.0.0.0", {}) == "0.0.0.0"                          # Serve's own proxy
    assert serve_http_host("0.0.0.0", {HAPROXY_BINARY_VAR: "/bin/true"}) == "0.0.0.0"    # the operator's HAProxy
    assert FRONTEND_HOST_VAR not in os.environ
    wrapper = haproxy_wrapper(str(tmp_path), binary="/bin/true")
    assert serve_http_host("0.0.0.0", {HAPROXY_BINARY_VAR: wrapper}) == "127.0.0.1"
    assert os.environ[FRONTEND_HOST_VAR] == "0.0.0.0"


def test_loopback_ray_makes_the_node_address_loopback():
    """Ray's one-machine setting (read when ray is imported) gives the node 127.0.0.1, which its
    servers and agents then bind; too late once ray is imported."""
    code = ("from service.ray_env import apply_loopback_ray; apply_loopback_ray(); "
            "import ray._private.services as s; print(s.get_node_ip_address())")
    env = {k: v for k, v in os.environ.items() if k not in LOOPBACK_RAY}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[-1] == "127.0.0.1", r.stderr[-2000:]
    code = "import ray; from service.ray_env import apply_loopback_ray; apply_loopback_ray()"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "before ray is imported" in r.stderr


@pytest.fixture
def replica_module(monkeypatch):
    """ray.serve._private.replica with a recording add_port_to_grpc_server (restored afterwards): the
    addresses it was called with; one named in ``refuse`` raises as grpc does for an address it cannot bind."""
    from ray.serve._private import replica
    calls, refuse = [], set()

    def add_port(server, address):
        calls.append(address)
        if address in refuse:
            raise RuntimeError(f"Failed to bind to address {address}")
        return 4242
    monkeypatch.setattr(replica, "add_port_to_grpc_server", add_port)
    return replica, calls, refuse


@pytest.mark.parametrize("node, bound", [("127.0.0.1", "127.0.0.1:0"), ("10.0.0.5", "10.0.0.5:0"),
                                         ("fd00::5", "[fd00::5]:0")])
def test_the_setup_hook_binds_the_replicas_grpc_to_the_node_address(replica_module, monkeypatch, node, bound):
    """Serve's replica calls add_port_to_grpc_server(server, "[::]:0") (ray 2.60.0, _on_initialized);
    after the hook it binds the node's address Ray advertises; an address of its own stays."""
    import ray

    from service.ray_env import replica_grpc_on_node_address
    replica, calls, _ = replica_module
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: node)
    replica_grpc_on_node_address()
    replica_grpc_on_node_address()          # a second run in the same process wraps it once
    assert replica.add_port_to_grpc_server(object(), "[::]:0") == 4242
    assert replica.add_port_to_grpc_server(object(), "192.0.2.9:7000") == 4242
    assert calls == [bound, "192.0.2.9:7000"]


def test_the_setup_hook_falls_back_to_serves_binding_with_a_warning(replica_module, monkeypatch, caplog):
    import ray

    from service.ray_env import replica_grpc_on_node_address
    replica, calls, refuse = replica_module
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.5")
    refuse.add("10.0.0.5:0")                # an address this machine does not have
    replica_grpc_on_node_address()
    assert replica.add_port_to_grpc_server(object(), "[::]:0") == 4242 and calls == ["10.0.0.5:0", "[::]:0"]
    assert "cannot bind the node's address 10.0.0.5" in caplog.text
    caplog.clear()
    monkeypatch.delattr(replica, "add_port_to_grpc_server")      # Ray's internals changed: nothing to wrap
    replica_grpc_on_node_address()
    assert not hasattr(replica, "add_port_to_grpc_server")
    assert "has no ray.serve._private.replica.add_port_to_grpc_server" in caplog.text and "2.60.0" in caplog.text


def test_the_workers_import_the_drivers_copy_of_service_from_their_start(monkeypatch):
    """python -m service's workers run the setup hook before Ray adds the driver's directory to their
    path: PYTHONPATH names this checkout first, once."""
    from service.ray_env import apply_worker_path
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    root = os.path.realpath(ROOT)
    assert apply_worker_path() == root and os.environ["PYTHONPATH"] == os.pathsep.join([root, "/elsewhere"])
    assert apply_worker_path() == root and os.environ["PYTHONPATH"] == os.pathsep.join([root, "/elsewhere"])


@pytest.mark.slow
@pytest.mark.cluster      # a Ray instance of its own: after the shared service is shut down
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_python_m_service_listens_on_loopback_but_for_its_http_frontend(no_shared_service, tmp_path, host):
    """Every listener of the service's tree binds loopback, but HAProxy's frontend, which binds
    ``--host``; the replicas' gRPC servers for handle calls too (the node's address: 127.0.0.1)."""
    ckpt = build_tiny_checkpoint(tmp_path / "m", "de", "en", max_len=64)
    port, metrics_port = free_port(), free_port()
    haproxy = {var: free_port() for var, _ in HAPROXY_DEFAULT_PORTS.values()}
    env = {k: v for k, v in os.environ.items() if k not in {*LOOPBACK_RAY, STATS_HOST_VAR, FRONTEND_HOST_VAR}}
    env.update({var: str(p) for var, p in haproxy.items()})
    with python_m_service(port, "--host", host, "--metrics-export-port", str(metrics_port), "--num-cpus", "2",
                          "--checkpoint", str(ckpt), env=env, ready_s=240, stop_s=90) as proc:
        stats = haproxy["RAY_SERVE_HAPROXY_STATS_PORT"]
        assert httpx.get(f"http://127.0.0.1:{stats}/stats", timeout=10).status_code == 200
        listeners = tcp_listeners(process_tree(proc.pid))
        ports = {x.port for x in listeners}
        assert {port, metrics_port, stats, haproxy["RAY_SERVE_HAPROXY_METRICS_PORT"]} <= ports, listeners
        frontend = [x for x in listeners if x.port == port]
        assert [x.address for x in frontend] == [host] and "haproxy" in frontend[0].process, frontend
        exposed = [x for x in listeners if not is_loopback(x.address) and x.port != port]
        assert exposed == [], "\n".join(map(str, exposed))
        # among them the replicas' gRPC servers for handle calls (Serve's "[::]:0"), on the node's address:
        # a replica that is up has its HTTP port, its worker's gRPC server and that one
        replicas = collections.Counter(x.pid for x in listeners if x.process.startswith("ray::ServeReplica"))
        assert max(replicas.values(), default=0) >= 3, "\n".join(map(str, listeners))
        # a client's own forwarded headers do not reach the replicas: its download URL keeps the request's scheme
        r = httpx.post(f"http://127.0.0.1:{port}/translate_file", files={"file": ("a.txt", b"Hallo.\n")},
                       data={"source": "de", "target": "en"}, timeout=120,
                       headers={"X-Forwarded-Proto": "https", "X-Forwarded-Host": "evil.example"})
        assert r.status_code == 200 and r.json()["translatedFileUrl"].startswith(f"http://127.0.0.1:{port}/"), r.text
