"""``python -m service.loadtest --compare-echo``: the service against a trivial echo app with the same
Ray Serve settings and layout, under the same closed-loop load; prints both and the ratio.

The echo app has the service's layout (proxy -> FastAPI ingress -> a second deployment through a
deployment handle) and deployment options (``gateway_options`` / ``translator_options`` of the
same ``AppArgs``), answers ``POST /v1/translate`` with each text as its own "translation", and does
nothing else: what it sustains is the ceiling that Ray Serve's data plane puts on this machine, and
the ratio says how much of it the service's own per-request work (validation, splitting,
tokenization, the engine, JSON) leaves. Both run in one Ray instance started here (``ServeApp``, the
``--proxy`` data plane), one after the other.
"""
# No `from __future__ import annotations`: Serve's ingress rebinds the routes, and FastAPI must see
# the ``Request`` class itself, not its name (service/api/gateway.py does the same).
import dataclasses
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

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

    def __init__(self, backend):
        self.backend = backend

    @echo_api.post("/v1/translate")
    async def translate(self, request: Request):
        return JSONResponse(await self.backend.translate.remote(await request.json()))

    @echo_api.get("/readyz")
    async def readyz(self):
        return {"status": "ready"}


def build_echo_app(app_args: Optional[dict] = None) -> serve.Application:
    """The echo app with the deployment options the service's ``build_app(app_args)`` would use."""
    from service.app import AppArgs, gateway_options, translator_options
    args = AppArgs.model_validate(app_args or {})
    backend = translator_options(args, args.models[0])
    backend.pop("user_config", None)
    backend["name"] = "EchoBackend"
    return serve.deployment(EchoGateway, **gateway_options(args)).bind(
        serve.deployment(EchoBackend, **backend).bind())


def _deploy_echo(app: ServeApp, app_args: dict) -> None:
    import time

    import httpx
    serve.run(build_echo_app(app_args), name=app.name, route_prefix="/", blocking=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(app.url + "/readyz", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the echo app did not become ready within 120 s")


async def _measure(cfg: LoadConfig, url: str, label: str, quiet: bool) -> dict[str, Any]:
    run = dataclasses.replace(cfg, url=url)
    s = (await run_load(run, None, Progress(not quiet, label=f"{label}: "))).summary()
    print(f"--- {label}\n{format_summary(s)}", flush=True)
    return s


def compare_echo(cfg: LoadConfig, app_args: Optional[dict] = None, proxy: str = "haproxy",
                 quiet: bool = False) -> dict[str, Any]:
    """Starts Ray (``proxy`` data plane), runs ``cfg`` against the service (``build_app(app_args)``)
    and then against the echo app, prints both summaries and the ratio of their throughputs.
    Returns {"service": summary, "echo": summary, "ratio": service / echo req/s, "proxy": proxy}.
    Raises ValueError for a streaming ``cfg`` (the echo app does not stream)."""
    import asyncio
    if cfg.stream:
        raise ValueError("--compare-echo: the echo app does not stream; drop --stream")
    app_args = app_args or {}
    app = ServeApp(proxy=proxy, namespace="mt-compare-echo")
    try:
        app.deploy(app_args)
        service = asyncio.run(_measure(cfg, app.url, "service", quiet))
        app.delete()
        _deploy_echo(app, app_args)
        echo = asyncio.run(_measure(cfg, app.url, "echo app", quiet))
    finally:
        app.close()
    ratio = service["requests_per_s"] / echo["requests_per_s"] if echo["requests_per_s"] else float("nan")
    print(f"service / echo app (proxy {proxy}, same Serve options and layout): "
          f"{service['requests_per_s']:.1f} / {echo['requests_per_s']:.1f} req/s = {ratio:.2f}")
    return {"service": service, "echo": echo, "ratio": ratio, "proxy": proxy}
