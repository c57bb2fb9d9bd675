"""The text pipeline's settings (service/translator/config.py): read from the environment in one place."""
from __future__ import annotations

from service.translator import TextConfig


def test_the_environment_turns_stages_off_and_names_the_stored_list():
    assert TextConfig.from_env({}) == TextConfig() == TextConfig(protect_spans=True, truecase=True, keep_file="")
    env = {"MT_PROTECT_SPANS": "0", "MT_TRUECASE": "0", "MT_KEEP_FILE": "/etc/mt/keep.txt"}
    assert TextConfig.from_env(env) == TextConfig(protect_spans=False, truecase=False, keep_file="/etc/mt/keep.txt")
    assert TextConfig.from_env({"MT_PROTECT_SPANS": "1", "MT_TRUECASE": "yes"}) == TextConfig()
