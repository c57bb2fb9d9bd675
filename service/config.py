"""The one place the service reads its ``MT_*`` switches from the environment: ``ENV`` maps each
variable to the ``AppArgs`` field it sets (service/app.py), and ``with_environment`` puts their
values under a config's own when ``AppArgs`` is validated, in the process that builds the app. The
environment replaces the defaults; a value the config gives wins (docs/deploy.md#configuration).
Components read their settings from the config they are handed, never from the environment.

Not here: ``MT_API_KEYS`` and ``MT_KEY_SECRET`` are secrets, read where they are used
(service/api/middleware/guard.py, caller.py) so that they stay out of configs and Serve's stored
deployment arguments; ``MT_LINEAR_DTYPE``, ``MT_CPU_KERNELS``, ``MT_FUSED_STEP`` replace
``EngineConfig`` defaults (model/inference/settings.py).
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping


def _switch(value: str) -> bool:
    return value != "0"          # "0" turns a stage off, any other value leaves it on


# variable -> (the AppArgs field it sets, a dotted path; how its text becomes the field's value)
ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "MT_PROTECT_SPANS": ("text.protect_spans", _switch),
    "MT_TRUECASE": ("text.truecase", _switch),
    "MT_KEEP_FILE": ("text.keep_file", str),
    "MT_GLOSSARY_DIR": ("glossary_dir", str),
    "MT_DOCUMENTS_DIR": ("documents.store_dir", str),
    "MT_STATE_DIR": ("state_dir", str),
}


def env_overrides(environ: Mapping[str, str] = os.environ) -> dict:
    """The AppArgs fields the environment sets, nested as in a config ({"text": {"truecase": False}});
    an empty variable sets nothing."""
    out: dict = {}
    for var, (path, parse) in ENV.items():
        if environ.get(var):
            *parents, name = path.split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[name] = parse(environ[var])
    return out


def _over(config: dict, env: dict) -> dict:
    """``config``'s values over ``env``'s, section by section (a section may come as JSON text, as
    ``serve run ... documents='{...}'`` passes it)."""
    out = dict(env)
    for key, value in config.items():
        if isinstance(env.get(key), dict) and isinstance(value, (str, dict)):
            value = json.loads(value) if isinstance(value, str) else value
            if isinstance(value, dict):
                value = _over(value, env[key])
        out[key] = value
    return out


def with_environment(config: Any, environ: Mapping[str, str] = os.environ) -> Any:
    """A config (AppArgs' input: a mapping of its fields) with the environment's values under its own."""
    if not isinstance(config, Mapping):
        return config
    return _over(dict(config), env_overrides(environ))
