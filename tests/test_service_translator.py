"""The Translator (model + engine behind the replicas) in-process: reconfigure, validation, splitting."""
from __future__ import annotations

import asyncio

import pytest

from conftest import build_tiny_checkpoint
from service.engine import EngineValidationError
from service.schemas import ServiceError
from service.translator import Translator, model_card


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    return model_card("tiny", build_tiny_checkpoint(tmp_path_factory.mktemp("tr"), "de", "en", max_len=64))


def request(texts, **kw):
    req = {"texts": texts, "beam_size": 2, "n_best": 1, "length_penalty": 1.0, "max_new_tokens": 6,
           "min_new_tokens": 0, "return_attention": False, "attention": {"kinds": ["cross"]}}
    req.update(kw)
    return req


def test_reconfigure_applies_user_config_in_place(card):
    async def main():
        t = Translator(card)
        assert not t.ready()
        with pytest.raises(ServiceError) as e:     # before the first reconfigure: loading
            await t.translate(request(["Hallo."]))
        assert e.value.status == 503
        await t.reconfigure({"max_num_seqs": 4})
        engine = t.engine
        first = await t.translate(request(["Ein Hund läuft.", "Zwei Männer."]))
        await t.reconfigure({"max_num_seqs": 4, "policy": "prefill_first", "prefill_every": 2})
        assert t.engine is engine and engine.config.policy == "prefill_first" and engine.config.prefill_every == 2
        await t.reconfigure({"max_num_seqs": 8, "max_waiting": 16})   # a new KV-cache shape, same engine
        assert t.engine is engine and engine.config.max_num_seqs == 8 and t.info()["engine"]["max_waiting"] == 16
        from model.linear import default_dtype, onednn_available   # the CPU default is int8 (MT_LINEAR_DTYPE)
        want = str(default_dtype()).removeprefix("torch.") if onednn_available() else "float32"
        assert t.info()["engine"]["linear_dtype"] == want
        again = await t.translate(request(["Ein Hund läuft.", "Zwei Männer."]))
        assert again["translations"] == first["translations"]
        with pytest.raises(EngineValidationError, match="policy"):
            await t.reconfigure({"policy": "random"})
        with pytest.raises(EngineValidationError, match="colour"):
            await t.reconfigure({"colour": 1})
        assert t.engine_config.max_num_seqs == 8     # a rejected config changes nothing
        await t.stop()
    asyncio.run(main())


def test_limits_are_service_errors_naming_field_and_limit(card):
    async def main():
        t = Translator(card)
        await t.reconfigure({"max_num_seqs": 4, "max_waiting": 5})
        cases = [
            (request(["x"], beam_size=5), 422, "beam_size", "4"),
            (request(["x"], max_new_tokens=64), 422, "max_new_tokens", "63"),
            (request([" ".join(["Hund"] * 80)]), 413, "text", "64"),
            (request(["Ein Satz. " * 6]), 413, "text", "5 sentences"),
            (request(["x"], return_attention=True, attention={"kinds": ["cross"], "layers": [2]}), 422,
             "attention.layers", "0..1"),
            (request(["x", "\ud800"], field="q", is_list=True), 422, "q", "Unicode"),
        ]
        for req, status, field, words in cases:
            with pytest.raises(ServiceError) as e:
                await t.translate(req)
            assert (e.value.status, e.value.field) == (status, field), e.value.message
            assert words in e.value.message and field.split(".")[0] in e.value.message
        await t.stop()
    asyncio.run(main())


def test_readyz_answers_quickly_while_a_model_loads(monkeypatch):
    """A model whose replica is not up yet must not hold the readiness probe: 503 within ~the probe
    timeout; a model that answered once stays ready while it is merely slow."""
    import json
    import time
    from service import deployment

    class GatewayState:   # what Gateway.readyz uses of its instance
        cards = {"de-en": {}, "fr-en": {}}

        def __init__(self):
            self._ready_seen = set()

        async def _call(self, name, method):
            assert method == "ready"
            if name == "de-en":
                return True
            await asyncio.sleep(3600)    # no replica yet: the call would wait for one

    monkeypatch.setattr(deployment, "READY_PROBE_S", 0.2)
    state = GatewayState()

    async def probe():
        t0 = time.monotonic()
        resp = await deployment.Gateway.readyz(state)
        return resp.status_code, json.loads(resp.body), time.monotonic() - t0

    status, body, took = asyncio.run(probe())
    assert status == 503 and body["models"] == {"de-en": "ready", "fr-en": "loading"} and took < 2.0
    assert state._ready_seen == {"de-en"}
    state._ready_seen.add("fr-en")       # it answered before: now busy, not loading
    status, body, _ = asyncio.run(probe())
    assert status == 200 and body["status"] == "ready"
