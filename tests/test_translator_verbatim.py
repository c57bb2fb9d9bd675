"""Texts and sentences without letters ("1.", "12345", "-", "...", emoji) come back verbatim without
touching the model (service/translator/text.py ``Split.translatable``), in responses and in streams;
a text the sentence splitter fails on is still translated. In-process Translator, tiny model."""
from __future__ import annotations

import asyncio

import pytest

from conftest import build_tiny_checkpoint
from service.api.schemas import TranslateRequest
from service.protocol import StreamStart, StreamToken, TranslateResponse
from service.translator import Translator, model_card

NO_LETTERS = ["1.", "12345", "-", "...", "€ 5,00 / 3 %", "🐶🐱", "  (1)\n2.  "]


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    return model_card("tiny", build_tiny_checkpoint(tmp_path_factory.mktemp("verbatim"), "de", "en", max_len=64))


def job(texts, **kw):
    return TranslateRequest(text=texts, beam_size=1, max_new_tokens=5, **kw).job()


async def with_translator(card, body):
    t = Translator(card)
    await t.reconfigure({"max_num_seqs": 4})
    calls = []
    inner_translate, inner_stream = t.engine.translate, t.engine.stream
    t.engine.translate = lambda ids, o, group=None: (calls.append(ids), inner_translate(ids, o, group))[1]
    t.engine.stream = lambda ids, o, group=None: (calls.append(ids), inner_stream(ids, o, group))[1]
    try:
        return await body(t), calls
    finally:
        await t.stop()


def test_texts_without_letters_skip_the_model(card):
    async def body(t):
        return await t.translate(job(NO_LETTERS))
    out, calls = asyncio.run(with_translator(card, body))
    assert calls == []
    assert [tr.text for tr in out.translations] == NO_LETTERS
    for tr in out.translations:
        assert (tr.tokens, tr.source_tokens, tr.score, tr.finish_reason, tr.alternatives) == ([], [], 0.0, "eos", [])
    assert (out.usage.source_tokens, out.usage.generated_tokens) == (0, 0)


def test_sentences_without_letters_pass_through_inside_a_text(card):
    text = "Ein Hund rennt.\n1.\nZwei Katzen schlafen. ...\n"

    async def body(t):
        return await t.translate(job([text, "Ein Hund rennt.", "Zwei Katzen schlafen."]))
    out, calls = asyncio.run(with_translator(card, body))
    assert len(calls) == 4        # two sentences of text 0, one each of texts 1 and 2
    whole, a, b = out.translations
    assert whole.text == f"{a.text}\n1.\n{b.text} ...\n"
    assert whole.source_tokens == a.source_tokens + b.source_tokens
    assert whole.tokens == a.tokens + b.tokens


def test_stream_deltas_equal_the_final_text(card):
    texts = ["1.", "Ein Hund rennt.\n- 12345 -\nZwei Katzen.", "...", "🐶 Ein Hund."]

    async def body(t):
        return [item async for item in t.stream(job(texts))]
    items, calls = asyncio.run(with_translator(card, body))
    assert isinstance(items[0], StreamStart) and isinstance(items[-1], TranslateResponse)
    final = [tr.text for tr in items[-1].translations]
    assert final[0] == "1." and final[2] == "..." and "\n- 12345 -\n" in final[1]
    got = {}
    for ev in items[1:-1]:
        assert isinstance(ev, StreamToken)
        got[ev.index] = got.get(ev.index, "") + ev.text
    assert [got.get(i, "") for i in range(len(texts))] == final
    assert len(calls) == 3        # "🐶 Ein Hund." has letters: one piece for the model
