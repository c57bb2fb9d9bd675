"""The text pipeline's settings (service/translator/config.py): read from the environment in one place
(service/config.py's table, under AppArgs.text)."""
from __future__ import annotations

from service.config import env_overrides
from service.translator import TextConfig


def text_from(environ: dict) -> TextConfig:
    """The TextConfig the environment ``environ`` gives (AppArgs.text with nothing else set)."""
    return TextConfig(**env_overrides(environ).get("text", {}))


def test_the_environment_turns_stages_off_and_names_the_stored_list():
    assert text_from({}) == TextConfig() == TextConfig(protect_spans=True, truecase=True, keep_file="")
    env = {"MT_PROTECT_SPANS": "0", "MT_TRUECASE": "0", "MT_KEEP_FILE": "/etc/mt/keep.txt"}
    assert text_from(env) == TextConfig(protect_spans=False, truecase=False, keep_file="/etc/mt/keep.txt")
    assert text_from({"MT_PROTECT_SPANS": "1", "MT_TRUECASE": "yes"}) == TextConfig()
