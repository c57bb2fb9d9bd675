"""The data plane the service runs on by default (``service/ray_env.py``): Ray Serve's throughput
mode with HAProxy in front of the ingress replicas. The shared test service runs in it (unless
``MT_TEST_PROXY=ray``), so every service test covers it; these check what the mode itself changes:
requests really pass HAProxy, a request id passes through it in both directions, a streaming
client that disconnects still cancels its sentences in the engine (test_service_load), overload still
answers 503 + Retry-After (test_service_load), a request id Serve cannot decode is a 400. The settings themselves are checked without Ray.
"""
from __future__ import annotations

import os
import time

import httpx
import pytest

from conftest import metric_sum, post, sse_events
from service.ray_env import (HAPROXY_DEFAULT_PORTS, HEADER_CHECK, HEADER_CHECK_VAR, THROUGHPUT, apply_serve_env,
                             remove_workdir, serve_env)


def test_serve_env_modes(tmp_path):
    env = serve_env("haproxy", stats_port=18404, metrics_port=19101, workdir=str(tmp_path))
    assert {k: env[k] for k in THROUGHPUT} == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404" and env["RAY_SERVE_HAPROXY_METRICS_PORT"] == "19101"
    assert env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"] == str(tmp_path / "haproxy.cfg")
    assert all(v.startswith(str(tmp_path)) for k, v in env.items()
               if k.startswith("RAY_SERVE_HAPROXY") and k.endswith(("_LOC", "_PATH", "_BASE", "_FILE")))
    assert serve_env("ray")[HEADER_CHECK_VAR] == env[HEADER_CHECK_VAR] == HEADER_CHECK
    # two instances on one machine never share HAProxy's files
    first, second = serve_env(), serve_env()
    assert first["RAY_SERVE_HAPROXY_SOCKET_PATH"] != second["RAY_SERVE_HAPROXY_SOCKET_PATH"]
    for env in (first, second):
        remove_workdir(env)
    assert not set(THROUGHPUT) & set(serve_env("ray"))
    with pytest.raises(ValueError, match="proxy: expected one of"):
        serve_env("nginx")


def test_apply_serve_env_ray_clears_throughput_settings(monkeypatch):
    for k in THROUGHPUT:
        monkeypatch.setenv(k, "1")
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "7")   # an operator's own value wins
    monkeypatch.delenv(HEADER_CHECK_VAR, raising=False)
    applied = apply_serve_env("ray")
    assert not set(THROUGHPUT) & set(os.environ)
    assert applied == {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "7", HEADER_CHECK_VAR: HEADER_CHECK}


def _haproxy_requests(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return metric_sum(text, "haproxy_frontend_http_requests_total", proxy="http_frontend")


@pytest.mark.slow
def test_requests_pass_haproxy_and_keep_their_request_id(service_url):
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        pytest.skip("the shared service runs with MT_TEST_PROXY=ray")
    port = int(os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"])
    before = _haproxy_requests(port)
    r = post(service_url, {"text": "Ein Hund läuft."}, headers={"X-Request-ID": "mode-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "mode-1"
    assert r.json()["translations"][0]["text"]
    s = post(service_url, {"text": "Ein Hund läuft.", "stream": True}, headers={"X-Request-ID": "mode-2"})
    assert s.status_code == 200 and s.headers["x-request-id"] == "mode-2"
    assert s.headers["content-type"].startswith("text/event-stream")
    assert [e for e, _ in sse_events(s.text)][-1] == "response"
    bad = post(service_url, {"text": "x", "model": "nope"}, headers={"X-Request-ID": "mode-3"})
    assert bad.status_code == 404 and bad.headers["x-request-id"] == "mode-3"
    assert _haproxy_requests(port) >= before + 3


@pytest.mark.slow
def test_the_shared_service_runs_the_default_layout(service_info):
    """What python -m service --num-cpus 2 runs: one deployment, two ingress replicas that hold both
    models' translators (MT_TEST_INGRESS=separate: a Gateway and one deployment per model)."""
    from ray import serve

    from conftest import LAYOUT
    from service.app import AppArgs, deployment_options
    args = AppArgs.model_validate(service_info.args)
    assert args.ingress == LAYOUT
    app = serve.status().applications["mt"]
    assert set(app.deployments) == set(deployment_options(args))
    if LAYOUT == "translator":
        assert set(app.deployments) == {"Gateway"}
        deadline = time.time() + 120          # ready at the first replica's answer; the second may still load
        while (running := _running(serve.status().applications["mt"], "Gateway")) < 2 and time.time() < deadline:
            time.sleep(1)
        assert running == 2


def _running(app, deployment: str) -> int:
    states = app.deployments[deployment].replica_states
    return {str(getattr(k, "value", k)): v for k, v in states.items()}.get("RUNNING", 0)


@pytest.mark.slow
def test_a_request_id_serve_cannot_decode_is_a_400_and_harms_no_other_request(service_url):
    """Serve's ingress decodes X-Request-ID as UTF-8 before the app runs (a Latin-1 one was a plain-text
    500); its proxy callback (service/api/middleware/headers.py) answers 400 naming the header, in either data plane,
    also for an id over MAX_REQUEST_ID_CHARS or two different ids, with one fresh id in the response instead
    of the refused one."""
    for path, body in (("/v1/translate", {"text": "Ein Hund läuft."}), ("/translate", {"q": "Ein Hund.", "source": "de",
                                                                                       "target": "en"})):
        # not UTF-8; over MAX_REQUEST_ID_CHARS; two different ones
        for headers in ([("X-Request-ID", "caf\u00e9".encode("latin-1"))], [("X-Request-ID", b"r" * 1000)],
                        [("X-Request-ID", b"first"), ("X-Request-ID", b"second")]):
            r = post(service_url, body, path=path, headers=headers)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert "x-request-id" in (error if isinstance(error, str) else error["message"]).lower()
            ids = r.headers.get_list("x-request-id")   # a fresh id, not a refused one
            assert len(ids) == 1 and ids[0].encode("latin-1") not in [v for _, v in headers], ids
    good = post(service_url, {"text": "Ein Hund läuft."}, headers={"X-Request-ID": "caf\u00e9".encode()})
    assert good.status_code == 200 and good.json()["translations"][0]["text"]


def test_echo_backend_answers_each_text():
    import asyncio

    from service.loadtest.echo import EchoBackend
    out = asyncio.run(EchoBackend().translate({"text": ["Ein Hund.", "Zwei Katzen laufen."]}))
    assert [t["text"] for t in out["translations"]] == ["Ein Hund.", "Zwei Katzen laufen."]
    assert out["usage"]["generated_tokens"] == 5


@pytest.mark.parametrize("grpc", [True, False])
def test_handles_call_over_the_transport_of_the_process_that_holds_them(grpc, monkeypatch):
    """A handle made where ray.serve was imported before the throughput settings calls by actor
    calls; the gateway (and the echo app, with the same function) switch it to what their own
    process's Serve settings say."""
    from ray.serve._private import constants
    from ray.serve.handle import DeploymentHandle

    from service.api.backends import RemoteBackend
    from service.ray_env import handle_transport
    monkeypatch.setattr(constants, "RAY_SERVE_USE_GRPC_BY_DEFAULT", grpc)
    # as the driver made it, with the opposite choice (a stand-in router: no Serve instance here)
    made = DeploymentHandle("Translator-de-en", "mt", _create_router=lambda **kw: object()).options(_by_reference=grpc)
    for h in (handle_transport(made), RemoteBackend({"de-en": made}).handles["de-en"]):
        assert h.handle_options._by_reference is (not grpc)
        assert (h.deployment_name, h.app_name) == ("Translator-de-en", "mt")
        assert h.options(stream=True).handle_options._by_reference is (not grpc)   # kept by later options
    assert made.handle_options._by_reference is grpc     # the original is left as it was


@pytest.mark.parametrize("extra", [["--stream"], ["-r", "5"], ["--engine", "model/checkpoints/de-en"]])
def test_compare_echo_runs_one_closed_http_loop(extra, capsys):
    from service.loadtest.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--compare-echo", "-d", "5", *extra])
    assert e.value.code == 2
    assert "--compare-echo runs one closed loop" in capsys.readouterr().err


def test_haproxy_ports_move_off_a_taken_default_and_its_directory_is_removed(monkeypatch, tmp_path):
    import socket
    from service.ray_env import haproxy_ports
    for var, _ in HAPROXY_DEFAULT_PORTS.values():
        monkeypatch.delenv(var, raising=False)
    holders = []
    for port in (8404, 8500):   # as another instance's HAProxy and fallback proxy would (or taken already)
        holders.append(socket.socket())
        try:
            holders[-1].bind(("127.0.0.1", port))
            holders[-1].listen()
        except OSError:
            pass
    try:
        ports = haproxy_ports()
        assert ports["stats_port"] not in (8404, 0) and ports["fallback_http_port"] not in (8500, 0)
        env = serve_env("haproxy", **ports)
        assert env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] == str(ports["fallback_http_port"])
        remove_workdir(env)
    finally:
        for h in holders:
            h.close()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")      # the operator's choice stands
    assert "stats_port" not in haproxy_ports()
    env = serve_env("haproxy")
    workdir = env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]
    assert os.path.isdir(workdir)
    remove_workdir(env)
    assert not os.path.exists(workdir)
    remove_workdir({"RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(tmp_path)})    # not one it made: kept
    assert tmp_path.is_dir()


def test_spare_ports_lie_outside_the_ranges_the_os_and_ray_hand_out():
    """A port the OS picks for any process (32768-60999) could be taken by one of Ray's while Serve
    starts; HAProxy's replacement ports come from 20000-32767, free when drawn."""
    from service.ray_env import SPARE_PORTS, _in_use, spare_port
    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert SPARE_PORTS.stop <= low and SPARE_PORTS.start >= 20000
    ports = [spare_port() for _ in range(20)]
    assert all(p in SPARE_PORTS and not _in_use(p) for p in ports) and len(set(ports)) > 1
