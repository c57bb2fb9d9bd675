"""The old name of ``service/app.py``, kept so that ``serve run service.deployment:app`` and
``service.deployment:build_app`` keep working.

    serve run service.deployment:app          # the shipped models (built on first access)
"""
from .app import AppArgs, ModelSpec, build_app, gateway_options, translator_options

__all__ = ["AppArgs", "ModelSpec", "build_app", "gateway_options", "translator_options"]


def __getattr__(name: str):
    # `serve run service.deployment:app`: built on first access, so importing this module needs no checkpoint.
    if name == "app":
        return build_app({})
    raise AttributeError(name)
