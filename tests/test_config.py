"""The service's typed config (service/app.py ``AppArgs``, service/config.py): its sub-configs are
validated once, at start, naming the field; each MT_* variable of the one environment table reaches
its field, and a config's own value wins over it; components built directly read no environment; a
translator the service builds gets the configured settings."""
from __future__ import annotations

import asyncio

import pytest

from conftest import build_tiny_checkpoint
from service.api.document_store import DocumentSettings
from service.api.glossaries import SHARED, GlossaryStore
from service.api.services import IngressConfig, Services
from service.app import AppArgs, ingress_config, translator_settings
from service.config import ENV, env_overrides
from service.state import state_dir
from service.translator import TextConfig, model_card

MODELS = [{"name": "de-en"}]     # one model named, so that nothing is read from model/checkpoints


@pytest.fixture
def no_env(monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("bad, field", [
    ({"text": {"protect_span": False}}, "text.protect_span"),
    ({"text": {"truecase": "maybe"}}, "text.truecase"),
    ({"text": {"keep_file": "/nonexistent/keep.txt"}}, "text.keep_file"),
    ({"glossary_dir": "/nonexistent/glossaries"}, "glossary_dir"),
    ({"documents": {"ttl_s": -1}}, "documents.ttl_s"),
    ({"documents": {"store": "/tmp"}}, "documents.store"),
    ({"documents": '{"chunk_segments": 0}'}, "documents.chunk_segments"),
])
def test_a_bad_value_is_refused_at_start_naming_the_field(no_env, bad, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        AppArgs(models=MODELS, **bad)


def test_the_sub_configs_are_typed_and_json_text_still_parses(no_env, tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("Kölner Dom\n")
    args = AppArgs.model_validate({"models": MODELS, "documents": '{"ttl_s": 5}', "glossary_dir": str(tmp_path),
                                   "text": f'{{"truecase": false, "keep_file": "{keep}"}}'})
    assert isinstance(args.documents, DocumentSettings) and args.documents.ttl_s == 5
    assert args.text == TextConfig(truecase=False, keep_file=str(keep.resolve()))
    assert args.glossary_dir == str(tmp_path.resolve())
    assert AppArgs(models=MODELS).text == TextConfig() and AppArgs(models=MODELS).documents == DocumentSettings()


def test_every_variable_of_the_table_reaches_its_field(no_env, tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("x\n")
    values = {"MT_PROTECT_SPANS": "0", "MT_TRUECASE": "0", "MT_KEEP_FILE": str(keep),
              "MT_GLOSSARY_DIR": str(tmp_path), "MT_DOCUMENTS_DIR": str(tmp_path / "docs"),
              "MT_STATE_DIR": str(tmp_path / "state")}
    assert set(values) == set(ENV)
    for var, value in values.items():
        no_env.setenv(var, value)
    args = AppArgs(models=MODELS)
    assert args.text == TextConfig(protect_spans=False, truecase=False, keep_file=str(keep))
    assert args.glossary_dir == str(tmp_path) and args.documents.store_dir == str(tmp_path / "docs")
    assert args.state_dir == str(tmp_path / "state")
    config = ingress_config(args, {})
    assert config.guard.key_secret_file == str(tmp_path / "state" / "key-secret")
    assert config.translator.memory_file == str(tmp_path / "state" / "memory.sqlite3")
    assert config.translator.text == args.text and config.glossary_dir == str(tmp_path)
    assert env_overrides({"MT_TRUECASE": "", "MT_STATE_DIR": ""}) == {}     # empty: unset


def test_a_value_the_config_gives_wins_over_the_environment(no_env, tmp_path):
    no_env.setenv("MT_TRUECASE", "0")
    no_env.setenv("MT_PROTECT_SPANS", "0")
    no_env.setenv("MT_DOCUMENTS_DIR", str(tmp_path / "env"))
    no_env.setenv("MT_STATE_DIR", str(tmp_path / "env-state"))
    args = AppArgs(models=MODELS, text={"truecase": True}, documents='{"store_dir": "%s"}' % (tmp_path / "config"),
                   state_dir=str(tmp_path / "state"))
    assert args.text == TextConfig(protect_spans=False, truecase=True)     # the section's other field: the variable's
    assert args.documents.store_dir == str(tmp_path / "config") and args.state_dir == str(tmp_path / "state")
    assert ingress_config(args, {}).documents.store_dir == str(tmp_path / "config")
    no_env.setenv("MT_KEEP_FILE", "/nonexistent/keep.txt")
    with pytest.raises(ValueError, match=r"text\.keep_file"):     # a bad variable is refused at start too
        AppArgs(models=MODELS)


def test_components_built_directly_read_no_environment(no_env, tmp_path):
    (tmp_path / "shared.tsv").write_text("Hund\tdog\n")
    no_env.setenv("MT_GLOSSARY_DIR", str(tmp_path))
    no_env.setenv("MT_DOCUMENTS_DIR", str(tmp_path / "docs"))
    no_env.setenv("MT_STATE_DIR", str(tmp_path / "state"))
    assert GlossaryStore().list(SHARED) == [] and len(GlossaryStore(str(tmp_path)).list(SHARED)) == 1
    assert DocumentSettings().directory() != tmp_path / "docs"
    assert state_dir() != tmp_path / "state" and state_dir(str(tmp_path / "state")) == tmp_path / "state"
    assert IngressConfig().translator.text == TextConfig() and IngressConfig().glossary_dir is None


def test_a_translator_the_service_builds_gets_the_configured_settings(no_env, tmp_path):
    """AppArgs -> IngressConfig -> Services.build -> LocalBackend -> Translator, with MT_TRUECASE too."""
    ckpt = build_tiny_checkpoint(tmp_path, "de", "en", max_len=64)
    keep = tmp_path / "keep.txt"
    keep.write_text("Kölner Dom\nMulti30k\n")
    no_env.setenv("MT_TRUECASE", "0")
    args = AppArgs(models=[{"name": "tiny", "checkpoint": str(ckpt)}], text={"keep_file": str(keep)},
                   memory_cache_entries=8, memory_file=str(tmp_path / "m.sqlite3"), pivot_lang=None)
    assert translator_settings(args).text == TextConfig(truecase=False, keep_file=str(keep.resolve()))
    svc = Services.build([model_card("tiny", str(ckpt))], None, ingress_config(args, {}))
    t = svc.backend.translators["tiny"]
    try:
        assert t.protector.truecaser is None and len(t.keep) == 2
        assert t.cache.max_entries == 8 and t.memory is not None and svc.memory is not None
    finally:
        asyncio.run(t.stop())
