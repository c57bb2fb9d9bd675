"""The Translator (service/translator/translator.py: model + engine behind the replicas) in-process:
reconfigure, the limits it checks itself, and the engine's guard behind it."""
from __future__ import annotations

import asyncio

import pytest

from conftest import build_tiny_checkpoint
from service.engine import EngineValidationError
from service.protocol import ServiceError
from service.replica import to_service_error
from service.api.schemas import TranslateRequest
from service.protocol import StreamToken, TooLarge, Unavailable
from service.translator import Translator, model_card


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    return model_card("tiny", build_tiny_checkpoint(tmp_path_factory.mktemp("tr"), "de", "en", max_len=64))


def request(texts, **kw):
    """The job of a /v1/translate body, built without the gateway's checks (the translator's own run)."""
    req = {"text": texts, "beam_size": 2, "n_best": 1, "length_penalty": 1.0, "max_new_tokens": 6,
           "min_new_tokens": 0, "return_attention": False}
    req.update(kw)
    return TranslateRequest(**req).job()


def test_reconfigure_applies_user_config_in_place(card):
    async def main():
        t = Translator(card)
        assert not t.ready()
        with pytest.raises(Unavailable) as e:     # before the first reconfigure: loading
            await t.translate(request(["Hallo."]))
        assert to_service_error(e.value, t.name).status == 503
        await t.reconfigure({"max_num_seqs": 4})
        engine = t.engine
        first = await t.translate(request(["Ein Hund läuft.", "Zwei Männer."]))
        await t.reconfigure({"max_num_seqs": 4, "policy": "prefill_first", "prefill_every": 2})
        assert t.engine is engine and engine.config.policy == "prefill_first" and engine.config.prefill_every == 2
        await t.reconfigure({"max_num_seqs": 8, "max_waiting": 16})   # a new KV-cache shape, same engine
        assert t.engine is engine and engine.config.max_num_seqs == 8 and t.info().engine["max_waiting"] == 16
        from model.inference.linear import default_dtype, onednn_available   # the CPU default is int8 (MT_LINEAR_DTYPE)
        want = str(default_dtype()).removeprefix("torch.") if onednn_available() else "float32"
        assert t.info().engine["linear_dtype"] == want
        kv = t.info().engine["kv_cache"]          # GET /v1/models: the paged cache's block usage
        assert kv["kv_blocks"] == engine.runner.cache.slots.num_blocks and kv["free_kv_blocks"] == kv["kv_blocks"]
        assert kv["kv_cache_usage"] == 0.0 and kv["kv_cache_bytes"] == engine.runner.cache.nbytes
        again = await t.translate(request(["Ein Hund läuft.", "Zwei Männer."]))
        assert again.translations == first.translations
        with pytest.raises(EngineValidationError, match="policy"):
            await t.reconfigure({"policy": "random"})
        with pytest.raises(EngineValidationError, match="colour"):
            await t.reconfigure({"colour": 1})
        assert t.engine_config.max_num_seqs == 8     # a rejected config changes nothing
        await t.stop()
    asyncio.run(main())


def test_limits_are_service_errors_naming_field_and_limit(card):
    """beam_size and
    max_new_tokens reach the engine's guard (the gateway checks them first: test_api_schemas.py),
    whose errors map to the same statuses. Attention indices and Unicode: test_api_schemas.py,
    test_api_libretranslate.py."""
    async def main():
        t = Translator(card)
        await t.reconfigure({"max_num_seqs": 4, "max_waiting": 5})
        cases = [
            (request(["x"], beam_size=5), 422, "beam_size", "4"),
            (request(["x"], max_new_tokens=64), 422, "max_new_tokens", "63"),
        ]
        for req, status, field, words in cases:
            with pytest.raises(Exception) as e:
                await t.translate(req)
            err = to_service_error(e.value, t.name)
            assert isinstance(err, ServiceError), e.value
            assert (err.status, err.field) == (status, field), err.message
            assert words in err.message and field.split(".")[0] in err.message
        await t.stop()
    asyncio.run(main())


def test_a_request_of_more_sentences_than_the_queue_holds_goes_in_as_earlier_ones_end(card):
    """max_waiting 5: a request of 12 sentences is never all in the engine; it is answered whole,
    each sentence as alone, plain and streamed (the deltas add up to the answer)."""
    async def main():
        t = Translator(card)
        await t.reconfigure({"max_num_seqs": 4, "max_waiting": 5})
        sentences = [f"Ein Hund läuft {n} Meter." for n in range(12)]
        whole = await t.translate(request([" ".join(sentences)]))
        alone = [(await t.translate(request([s]))).translations[0].text for s in sentences]
        assert whole.translations[0].text == " ".join(alone)
        streamed = [item async for item in t.stream(request([" ".join(sentences)]))]
        assert streamed[-1].translations == whole.translations
        assert "".join(e.text for e in streamed if isinstance(e, StreamToken)) == whole.translations[0].text
        assert (t.engine.stats().waiting_requests, t.engine.stats().running_requests) == (0, 0)
        await t.stop()
    asyncio.run(main())


def test_a_sentence_longer_than_the_model_reads_is_cut_and_each_part_translated_as_alone(card):
    """A sentence over the model's source window (64 tokens here) is cut at clauses or words into
    parts that fit (text.cut_long); the translation is each part's translation, as when the parts
    are sent as texts of their own, joined by the text's whitespace."""
    async def main():
        t = Translator(card)
        await t.reconfigure({"max_num_seqs": 8})
        long = ", ".join(["Ein Hund läuft über die Straße"] * 12) + ". Kurz."
        splits, pieces, _ = t.prepare(request([long]))
        parts = splits[0].pieces
        assert len(parts) >= 4 and parts[-1] == "Kurz." and splits[0].join(parts) == long
        assert all(len(p.src_ids) <= t.engine.max_src_len for p in pieces)
        res = await t.translate(request([long]))
        alone = await t.translate(request(parts))
        assert res.translations[0].text == splits[0].join([tr.text for tr in alone.translations])
        assert res.translations[0].tokens == [tok for tr in alone.translations for tok in tr.tokens]
        await t.stop()
    asyncio.run(main())


def test_attention_over_the_response_limit_is_a_413_counting_the_weights(card, monkeypatch):
    """The weights a response would hold (texts x kinds x layers x heads x rows x cols) are counted
    before any matrix is built; over MAX_ATTENTION_VALUES the request is a 413 naming the count and
    the limit. Just at the limit, the same request passes and holds exactly that many weights."""
    from service.translator import output

    async def main():
        t = Translator(card)
        await t.reconfigure({"max_num_seqs": 4})
        req = request(["Ein Hund läuft. Zwei Männer.", "Hallo."], return_attention=True,
                      attention={"kinds": ["cross", "encoder"], "layers": [0], "heads": [0, 1]})
        res = await t.translate(req)
        held = sum(len(m) * len(m[0]) * len(m[0][0]) * len(m[0][0][0])
                   for tr in res.translations for m in tr.attention.values() if m)
        assert held > 0
        monkeypatch.setattr(output, "MAX_ATTENTION_VALUES", held)
        assert (await t.translate(req)).translations == res.translations
        monkeypatch.setattr(output, "MAX_ATTENTION_VALUES", held - 1)
        with pytest.raises(TooLarge) as e:
            await t.translate(req)
        err = to_service_error(e.value, t.name)
        assert (err.status, err.field) == (413, "return_attention")
        assert f"holds {held:,} weights" in e.value.message and f"at most {held - 1:,}" in e.value.message
        assert (await t.translate(request(["Ein Hund läuft. Zwei Männer."]))).translations   # no attention: fine
        await t.stop()
    asyncio.run(main())


def test_attention_that_cannot_fit_whatever_is_decoded_is_refused_before_decoding(card, monkeypatch):
    """The encoder's weights depend on the source alone: over the limit, the 413 comes before the
    engine runs (the engine is never called); at the limit the request is decoded as before."""
    from service.translator import output

    async def main():
        t = Translator(card)
        await t.reconfigure({"max_num_seqs": 4})
        req = request(["Ein Hund läuft. Zwei Männer.", "Hallo."], return_attention=True,
                      attention={"kinds": ["encoder"], "heads": [1]})
        res = await t.translate(req)
        held = sum(len(m) * len(m[0]) * len(m[0][0]) * len(m[0][0][0])
                   for tr in res.translations for m in tr.attention.values() if m)
        monkeypatch.setattr(output, "MAX_ATTENTION_VALUES", held)
        assert (await t.translate(req)).translations == res.translations
        monkeypatch.setattr(output, "MAX_ATTENTION_VALUES", held - 1)
        calls = []
        real = t._results
        monkeypatch.setattr(t, "_results", lambda *a: calls.append(a) or real(*a))
        with pytest.raises(TooLarge) as e:
            await t.translate(req)
        assert calls == [] and f"would hold at least {held:,} weights" in e.value.message
        await t.stop()
    asyncio.run(main())


def test_card_config_lists_every_model_config_field(tmp_path):
    """/v1/models shows a card's config: a config.json written before some fields existed still
    lists all of them, at their defaults."""
    import dataclasses
    import json
    from model.config import ModelConfig
    d = build_tiny_checkpoint(tmp_path / "old", "de", "en", max_len=64)
    cfg = json.loads((d / "config.json").read_text())
    dropped = {k: cfg.pop(k) for k in ("scale_embedding", "sinusoid_layout") if k in cfg}
    (d / "config.json").write_text(json.dumps(cfg))
    card = model_card("old", d)
    shown = card.config.to_dict()                     # what /v1/models shows
    assert sorted(shown) == sorted(f.name for f in dataclasses.fields(ModelConfig))
    defaults = ModelConfig.from_dict(cfg)
    assert dropped and all(shown[k] == getattr(defaults, k) for k in dropped)
    assert card.config.d_model == shown["d_model"] == cfg["d_model"]


def test_a_later_small_request_is_not_queued_behind_every_sentence_of_a_large_one(card):
    """The sentences of one request share an engine group, so admission takes turns between
    requests: with room for one sentence at a time, a one-text request (plain or streamed) sent
    after an eight-text one finishes long before it, with the translation it gets alone."""
    from service.translator.translator import StreamStart
    big = request([f"Ein Hund läuft {i} mal." for i in range(8)], max_new_tokens=6, min_new_tokens=6)
    small = request(["Zwei Männer."], max_new_tokens=6, min_new_tokens=6)

    async def main():
        t = Translator(card)
        await t.reconfigure({"max_num_seqs": 2})     # beam 2: one sentence in flight at a time
        alone = await t.translate(small)
        done = []

        async def run(name, job):
            out = await t.translate(job)
            done.append(name)
            return out

        async def streamed(name, job):
            out = [item async for item in t.stream(job)]
            done.append(name)
            assert isinstance(out[0], StreamStart)
            return out[-1]

        for second in (run, streamed):
            done.clear()
            first = asyncio.create_task(run("big", big))
            await asyncio.sleep(0)                     # the big request's sentences are queued first
            got = await asyncio.gather(first, second("small", small))
            assert done == ["small", "big"], done
            assert got[1].translations == alone.translations and len(got[0].translations) == 8
        await t.stop()
    asyncio.run(main())
