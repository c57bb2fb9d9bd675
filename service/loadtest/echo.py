"""``python -m service.loadtest --compare-echo``: the service against a trivial echo app with the same
Ray Serve settings and layout, under the same closed-loop load; prints both and the ratio.

The echo app has the service's layout and deployment options (``gateway_options`` /
``translator_options`` of the same ``AppArgs``): with ``ingress: separate``, proxy -> FastAPI
ingress -> a second deployment through a deployment handle (over the transport the ingress process's
Serve settings choose, ``ray_env.handle_transport``, as the service's gateway does); with ``ingress:
translator``, one deployment that answers itself. It answers ``POST /v1/translate`` with each text
as its own "translation" and does nothing else: what it sustains is the ceiling that Ray Serve's
data plane puts on this machine, and the ratio says how much of it the service's own per-request
work (validation, splitting, tokenization, the engine, JSON) leaves. Both run in one Ray instance
started here (``ServeApp``, the ``--proxy`` data plane), one after the other; the load comes from a
separate process, as a real client's would. ``--rounds N`` repeats the pair N times, alternating
which app goes first, and prints the median of the rounds' ratios.
"""
# No `from __future__ import annotations`: Serve's ingress rebinds the routes, and FastAPI must see
# the ``Request`` class itself, not its name (service/api/gateway.py does the same).
import dataclasses
import queue as queue_module
import statistics
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from service.ray_env import handle_transport

from .config import LoadConfig
from .generator import Progress, run_load
from .serve_app import ServeApp
from .stats import format_summary

echo_api = FastAPI(title="echo")


class EchoBackend:
    """The second deployment: returns the texts as they came."""

    async def translate(self, body: dict) -> dict:
        text = body.get("text", "")
        texts = text if isinstance(text, list) else [text]
        return {"model": "echo", "translations": [{"text": t} for t in texts],
                "usage": {"source_tokens": 0, "generated_tokens": sum(len(t.split()) for t in texts)}}


@serve.ingress(echo_api)
class EchoGateway:
    """The ingress: parses the JSON body, calls the backend, answers JSON (no validation)."""

    def __init__(self, backend=None):
        self.remote = backend is not None          # None: the backend runs in this replica (one deployment)
        self.backend = handle_transport(backend) if self.remote else EchoBackend()

    @echo_api.post("/v1/translate")
    async def translate(self, request: Request):
        body = await request.json()
        out = await (self.backend.translate.remote(body) if self.remote else self.backend.translate(body))
        return JSONResponse(out)

    @echo_api.get("/readyz")
    async def readyz(self):
        return {"status": "ready"}


def build_echo_app(app_args: Optional[dict] = None) -> serve.Application:
    """The echo app with the deployment options the service's ``build_app(app_args)`` would use."""
    from service.app import AppArgs, gateway_options, translator_options
    args = AppArgs.model_validate(app_args or {})
    backend = translator_options(args, args.models[0])
    backend.pop("user_config", None)
    if args.ingress == "translator":     # as the service: one deployment, the translator's options
        backend["name"] = "Gateway"
        return serve.deployment(EchoGateway, **backend).bind(None)
    backend["name"] = "EchoBackend"
    return serve.deployment(EchoGateway, **gateway_options(args)).bind(
        serve.deployment(EchoBackend, **backend).bind())


def _deploy_echo(app: ServeApp, app_args: dict) -> None:
    import time

    import httpx
    from service.app import LOGGING_CONFIG
    serve.run(build_echo_app(app_args), name=app.name, route_prefix="/", blocking=False,
              logging_config=LOGGING_CONFIG)   # the service's logging too
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(app.url + "/readyz", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the echo app did not become ready within 120 s")


def _load_child(cfg: LoadConfig, label: str, quiet: bool, queue) -> None:
    import asyncio
    try:
        queue.put((asyncio.run(run_load(cfg, None, Progress(not quiet, label=f"{label}: "))).summary(), None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((None, f"{type(e).__name__}: {e}"))


def _measure(cfg: LoadConfig, url: str, label: str, quiet: bool) -> dict[str, Any]:
    """The closed-loop load against ``url``, from a process of its own: a client sharing the Ray driver's
    process (its core-worker threads and the GIL) sends fewer requests than a real one, and the more
    CPU the app under test needs, the more that skews the ratio."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_load_child, args=(dataclasses.replace(cfg, url=url), label, quiet, queue))
    child.start()
    got = None
    try:
        while got is None:   # the run is bounded by its requests or duration; a dead child ends the wait
            try:
                got = queue.get(timeout=2)
            except queue_module.Empty:
                if not child.is_alive():
                    got = (None, f"the load process exited with status {child.exitcode}")
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    s, error = got
    if error:
        raise RuntimeError(f"the {label} load failed: {error}")
    print(f"--- {label}\n{format_summary(s)}", flush=True)
    return s


def compare_echo(cfg: LoadConfig, app_args: Optional[dict] = None, proxy: str = "haproxy",
                 quiet: bool = False, rounds: int = 1) -> dict[str, Any]:
    """Starts Ray (``proxy`` data plane), runs ``cfg`` against the service (``build_app(app_args)``)
    and against the echo app, prints both summaries and the ratio of their throughputs. With ``rounds``
    > 1 it does that ``rounds`` times, the service first in odd rounds and the echo app first in even
    ones, and prints each round's ratio and their median (this machine's speed drifts between minutes:
    a ratio of runs minutes apart, medianed over rounds, moves less than one pair of runs).
    Returns {"service": summary, "echo": summary (of the median round), "ratio": the median of the
    rounds' service / echo req/s, "ratios": each round's, "proxy": proxy}.
    Raises ValueError for a streaming ``cfg`` (the echo app does not stream) or rounds < 1."""
    if cfg.stream:
        raise ValueError("--compare-echo: the echo app does not stream; drop --stream")
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    app_args = app_args or {}
    app = ServeApp(proxy=proxy, namespace="mt-compare-echo")
    results: list[tuple[float, dict, dict]] = []
    try:
        for k in range(rounds):
            got: dict[str, dict] = {}
            for label in (("service", "echo app") if k % 2 == 0 else ("echo app", "service")):
                if label == "service":
                    app.deploy(app_args)
                else:
                    _deploy_echo(app, app_args)
                got[label] = _measure(cfg, app.url, label if rounds == 1 else f"{label} (round {k + 1})", quiet)
                app.delete()
            service, echo = got["service"], got["echo app"]
            ratio = service["requests_per_s"] / echo["requests_per_s"] if echo["requests_per_s"] else float("nan")
            results.append((ratio, service, echo))
            if rounds > 1:
                print(f"round {k + 1}: service / echo app = {service['requests_per_s']:.1f} / "
                      f"{echo['requests_per_s']:.1f} req/s = {ratio:.2f}", flush=True)
    finally:
        app.close()
    ranked = sorted(results, key=lambda r: r[0])
    ratio, service, echo = ranked[(len(ranked) - 1) // 2]          # the median round (the lower one of two)
    ratios = [r[0] for r in results]
    median = statistics.median(ratios)
    what = f"{service['requests_per_s']:.1f} / {echo['requests_per_s']:.1f} req/s = {ratio:.2f}" if rounds == 1 \
        else f"median of {rounds} rounds {median:.2f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
    print(f"service / echo app (proxy {proxy}, same Serve options and layout): {what}")
    return {"service": service, "echo": echo, "ratio": median, "ratios": ratios, "proxy": proxy}
