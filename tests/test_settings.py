"""The CPU compute choices: ``EngineConfig.linear_dtype`` / ``cpu_kernels`` / ``fused_step``, applied
to the model and its engine when the engine starts (``service/engine/process.py``, the runner), one
engine's never another's, their defaults and the environment variables that override them
(``model/inference/settings.py``, the one place that reads them), and the one table of environment
variables in docs/deploy.md."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch

from conftest import build_tiny_checkpoint
from model.inference import settings
from model.inference.linear import PackedLinear, linear_dtype, onednn_available
from service.engine import Engine, EngineConfig, EngineValidationError
from service.engine.process import prepare_model
from model.transformer import padding_mask
from tiny_model import make_model

ROOT = Path(__file__).resolve().parent.parent


def test_environment_overrides_the_defaults_and_a_config_wins(monkeypatch):
    assert settings.from_env({}) == settings.InferenceSettings() == \
        settings.InferenceSettings(linear_dtype="int8", cpu_kernels=True, fused_step=True)
    env = {"MT_LINEAR_DTYPE": "fp32", "MT_CPU_KERNELS": "0", "MT_FUSED_STEP": "off"}
    assert settings.from_env(env) == settings.InferenceSettings("float32", False, False)
    assert settings.from_env({"MT_LINEAR_DTYPE": " ", "MT_FUSED_STEP": "yes"}) == settings.InferenceSettings()
    with pytest.raises(ValueError, match="MT_LINEAR_DTYPE must be float32, bfloat16 or int8, got 'int4'"):
        settings.from_env({"MT_LINEAR_DTYPE": "int4"})
    with pytest.raises(ValueError, match="MT_CPU_KERNELS must be 1 or 0"):
        settings.from_env({"MT_CPU_KERNELS": "maybe"})
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert (EngineConfig().linear_dtype, EngineConfig().cpu_kernels, EngineConfig().fused_step) == ("float32", False, False)
    config = EngineConfig.from_dict({"linear_dtype": "int8", "cpu_kernels": True})
    assert (config.linear_dtype, config.cpu_kernels, config.fused_step) == ("int8", True, False)
    with pytest.raises(EngineValidationError, match="linear_dtype"):
        EngineConfig(linear_dtype="fp16")
    with pytest.raises(EngineValidationError, match="fused_step"):
        EngineConfig(fused_step="no")


def test_prepare_model_applies_the_choices_and_a_running_engine_keeps_them():
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN prepacked linears")
    model = make_model(torch.float32)
    src, tgt = torch.tensor([[5, 6, 7, 8, 3]]), torch.tensor([[2, 9, 10]])
    mask = padding_mask(src, model.cfg.pad_id)
    logits = {}
    for dtype in ("float32", "int8"):
        prepare_model(model, EngineConfig(linear_dtype=dtype))
        assert linear_dtype(model) == dtype
        with torch.no_grad():
            logits[dtype], _ = model.decode(tgt, model.cross_kv(model.encode(src, mask)[0]), mask)
    assert not torch.equal(logits["float32"], logits["int8"])     # int8 arithmetic, close to float32
    torch.testing.assert_close(logits["int8"], logits["float32"], rtol=0.1, atol=0.1 * float(logits["float32"].abs().max()))
    defaults = settings.current()
    for on in (False, True):
        prepare_model(model, EngineConfig(cpu_kernels=on, fused_step=on))
        assert all(m.packed.cpu_kernels is on for m in model.modules() if isinstance(m, PackedLinear))
        assert settings.current() == defaults          # nothing of the process changes
    running = EngineConfig(linear_dtype="int8")
    prepare_model(model, EngineConfig(linear_dtype="int8", max_num_seqs=8), running)    # other knobs: in place
    for change in ({"linear_dtype": "float32"}, {"cpu_kernels": False}, {"fused_step": False}):
        with pytest.raises(EngineValidationError, match="another value needs a new engine"):
            prepare_model(model, EngineConfig(**{"linear_dtype": "int8", **change}), running)


def test_two_engines_of_one_process_compute_as_each_is_configured():
    """The switches are per engine: one with the kernels and the fused step off beside one with them on."""
    engines = [Engine(make_model(torch.float32), EngineConfig(max_num_seqs=4, cpu_kernels=on, fused_step=on))
               for on in (False, True)]
    off, on = (e.runner for e in engines)
    assert not off.cache.cpu_kernels and not off.cache.kernel_ok() and not off.fused_step
    assert on.cache.cpu_kernels and on.fused_step
    with pytest.raises(EngineValidationError, match="another value needs a new engine"):
        asyncio.run(engines[0].reconfigure(EngineConfig(max_num_seqs=4, cpu_kernels=True, fused_step=False)))


def test_a_translator_loads_its_model_in_the_configured_linear_dtype(tmp_path):
    """The service's path: the translator's first reconfigure (Serve's user_config) decides."""
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN prepacked linears")
    from service.translator import Translator, model_card
    card = model_card("tiny", build_tiny_checkpoint(tmp_path, "de", "en", max_len=64))

    async def run(dtype: str) -> str:
        t = Translator(card, device="cpu")
        try:
            await t.reconfigure({"max_num_seqs": 4, "linear_dtype": dtype})
            await t.reconfigure({"max_num_seqs": 4, "linear_dtype": dtype, "max_waiting": 8})   # in place
            with pytest.raises(EngineValidationError, match="linear_dtype"):
                await t.reconfigure({"max_num_seqs": 4, "linear_dtype": "int8" if dtype == "float32" else "float32"})
            return t.info().engine["linear_dtype"]
        finally:
            await t.stop()
    assert asyncio.run(run("float32")) == "float32"
    assert asyncio.run(run("int8")) == "int8"


def test_the_docs_list_every_environment_variable_in_one_table():
    """Every MT_* variable the code reads is a row of docs/deploy.md's one table, and no other doc
    has such a table."""
    sources = [p for d in ("model", "service") for p in (ROOT / d).rglob("*.py")]
    read = {v for p in sources for v in re.findall(r"\"(MT_[A-Z_]+)\"", p.read_text())}
    assert set(settings.ENV.values()) <= read
    doc = (ROOT / "docs" / "deploy.md").read_text()
    rows = set(re.findall(r"^\| `(MT_[A-Z_]+)` \|", doc, re.M))
    assert rows == read, (sorted(read - rows), sorted(rows - read))
    for other in (ROOT / "docs").glob("*.md"):
        if other.name != "deploy.md":
            assert not re.search(r"^\| `MT_[A-Z_]+` \|", other.read_text(), re.M), other.name
