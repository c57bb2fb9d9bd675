"""The HTTP ingress on Ray Serve: ``Gateway``, a replica that builds its ``Services`` (the served
models, the request pipeline, the stores, the guard) and serves ``http.build_app(services)``.

Serve builds the app in the replica, after the constructor (``__serve_build_asgi_app__``), so the
routes reach this replica's services through FastAPI's dependency (``services.services``), not
through Serve's replica context or module state.
"""
from typing import Optional

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from service.translator import ModelCard

from .http import build_app
from .middleware.access_log import flush_serve_log
from .services import IngressConfig, Services


@serve.ingress()
class Gateway:
    """The HTTP ingress in front of one translator per model.

    Args:
        cards: the served models; the first is the default.
        handles: model id -> its translator deployment; None: run the translators in this process.
        config: everything else it is built from (``services.IngressConfig``: engine fields, threads,
            guard, deadline, pivot language, documents, CORS, the translators' settings, glossaries).
        pool: the model pool's {"handle", "directory", "models"} (``service/pool.py``); None: no pool.
    """

    def __init__(self, cards: list[ModelCard], handles: Optional[dict[str, DeploymentHandle]] = None,
                 config: Optional[IngressConfig] = None, pool: Optional[dict] = None):
        self.services = Services.build(cards, handles, config, pool)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self.services)

    async def reconfigure(self, user_config: dict) -> None:
        """Only used with ``ingress: translator``: the engine settings of the in-process translators
        ({"engine": fields for every model, "per_model": {model: overrides}})."""
        await self.services.reconfigure(user_config)

    def __del__(self):
        """Serve's shutdown hook, after its drain of ongoing requests: the last access lines reach the
        log file before the process is killed (``access_log.flush_serve_log``)."""
        flush_serve_log()
