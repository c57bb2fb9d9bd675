"""The client-compatibility layer without Ray: DeepL's route logic (service/api/deepl.py) on a tiny
in-process Translator, DeepL-Auth-Key in the guard, DeepL's error shape, CORS (service/api/middleware/cors.py)
in front of the guard, /frontend/settings."""
from __future__ import annotations

import asyncio
import types

import pytest
from conftest import build_tiny_checkpoint
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from local_services import local_services

from service.api import deepl
from service.api.errors import LIBRE_PATHS, add_exception_handlers
from service.api.fields import read_fields
from service.api.libretranslate import read_admitted
from service.api.middleware.body import BodyMiddleware
from service.api.middleware.caller import caller_of
from service.api.middleware.cors import CorsMiddleware
from service.api.middleware.guard import Guard, GuardMiddleware, GuardSettings, deepl_auth_key
from service.api.suggest import frontend_settings
from service.pipeline.markup import HtmlText
from service.protocol import MAX_TEXT_CHARS, ServiceError
from service.translator import ModelCard, Translator, model_card

REQUEST = types.SimpleNamespace(scope={})     # what deepl.translate reads of a request: no key, no memory


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    return model_card("tiny", build_tiny_checkpoint(tmp_path_factory.mktemp("deepl"), "de", "en", max_len=64))


def test_language_codes_both_ways():
    assert [deepl.service_language(c) for c in ("EN-GB", "en-us", "DE", "pt_BR", "ZH-HANS")] == \
        ["en", "en", "de", "pt", "zh"]
    assert deepl.deepl_codes("en", target=True) == ["EN-GB", "EN-US"]
    assert deepl.deepl_codes("en", target=False) == ["EN"] and deepl.deepl_codes("de", target=True) == ["DE"]
    assert deepl.language_name("EN-US") == "English (American)" and deepl.language_name("DE") == "German"
    cards = [ModelCard(id="de-en", checkpoint="x", source_lang="de", target_lang="en", config=None),
             ModelCard(id="en-de", checkpoint="x", source_lang="en", target_lang="de", config=None)]
    assert deepl.languages(cards, "source") == [{"language": "DE", "name": "German"},
                                                {"language": "EN", "name": "English"}]
    assert [x["language"] for x in deepl.languages(cards, "target")] == ["DE", "EN-GB", "EN-US"]
    assert all(x["supports_formality"] is False for x in deepl.languages(cards, "target"))
    assert deepl_auth_key("DeepL-Auth-Key abc:fx") == "abc:fx" and deepl_auth_key("Bearer abc") is None
    with pytest.raises(ServiceError) as e:
        deepl.source_or_target("both")
    assert e.value.status == 400 and e.value.field == "type"


@pytest.mark.parametrize("fields, field", [
    ({"target_lang": "DE"}, "text"),
    ({"text": ["a"]}, "target_lang"),
    ({"text": ["a", 3], "target_lang": "DE"}, "text"),
    ({"text": "a", "target_lang": "DE", "tag_handling": "markdown"}, "tag_handling"),
    ({"text": "a", "target_lang": "DE", "split_sentences": "2"}, "split_sentences"),
    ({"text": "a", "target_lang": "DE", "preserve_formatting": "maybe"}, "preserve_formatting"),
])
def test_invalid_deepl_bodies_are_400_naming_the_field(fields, field):
    with pytest.raises(ServiceError) as e:
        deepl.parse(fields)
    assert (e.value.status, e.value.field) == (400, field) and f"'{field}'" in e.value.message, e.value.message


def test_deepl_body_defaults_and_ignored_fields():
    body = deepl.parse({"text": "Hallo", "target_lang": "EN-GB", "tag_handling": "html", "preserve_formatting": "1",
                        "formality": "more", "context": "a greeting"})
    assert body.text == ["Hallo"] and body.split_sentences == "nonewlines" and body.preserve_formatting is True
    assert deepl.ignored(body, {"text": "Hallo", "formality": "more", "context": "a greeting"}) == \
        {"X-Ignored-Fields": "formality, context"}
    assert deepl.ignored(deepl.parse({"text": "a", "target_lang": "DE", "formality": "default"}),
                         {"text": "a", "formality": "default"}) is None
    assert deepl.parse({"text": ["a"], "target_lang": "DE", "split_sentences": 0}).split_sentences == "0"


def test_deepl_translate_on_a_translator_text_html_and_errors(card):
    async def main():
        t = Translator(card)
        await t.reconfigure({"max_num_seqs": 4})
        seen = []

        async def run(model, job):
            seen.append(job)
            return await t.translate(job)
        svc = local_services([card], run)
        ctx = svc
        texts = ["Ein Hund läuft.", "Zwei Männer spielen."]
        out, chars = await deepl.translate(deepl.parse({"text": texts, "source_lang": "DE", "target_lang": "EN-US"}), REQUEST, ctx)
        want = [tr.text for tr in (await t.translate(seen[0])).translations]
        assert [o["text"] for o in out] == want and chars == sum(map(len, texts))
        assert [o["detected_source_language"] for o in out] == ["DE", "DE"]
        assert [o["billed_characters"] for o in out] == [len(x) for x in texts]
        html = "<p>Ein <b>Hund</b> läuft.</p>"
        out, _ = await deepl.translate(deepl.parse({"text": html, "source_lang": "de", "target_lang": "en-gb",
                                                    "tag_handling": "html"}), REQUEST, ctx)
        h = HtmlText(html)
        segs = (await t.translate(seen[-1])).translations
        assert out[0]["text"] == h.rebuild([s.text for s in segs]) and out[0]["text"].startswith("<p>")
        assert seen[-1].split_sentences == "nonewlines"       # DeepL's default with tag handling
        same, _ = await deepl.translate(deepl.parse({"text": "Hallo", "source_lang": "EN", "target_lang": "EN-GB"}), REQUEST, ctx)                    # English into English: unchanged
        assert same == [{"detected_source_language": "EN", "text": "Hallo", "billed_characters": 5}]
        for fields, status, field in (({"text": "a", "target_lang": "FR"}, 400, "target_lang"),
                                      ({"text": "a", "source_lang": "JA", "target_lang": "EN-GB"}, 400, "source_lang"),
                                      ({"text": "a" * (MAX_TEXT_CHARS + 1), "source_lang": "DE", "target_lang": "EN-GB"},
                                       413, "text"),
                                      ({"text": "a", "source_lang": "DE", "target_lang": "EN-GB",
                                        "glossary_id": "g1"}, 404, "glossary_id")):
            with pytest.raises(ServiceError) as e:
                await deepl.translate(deepl.parse(fields), REQUEST, ctx)
            resp = deepl.error_response(e.value)
            assert (resp.status_code, e.value.field) == (status, field), e.value.message
            assert resp.body.startswith(b'{"message":')
        await t.stop()
    asyncio.run(main())


def make_client(guard: Guard, origins=("*",)) -> TestClient:
    """The gateway's middleware stack (Body, Guard, CORS from inside out) around DeepL and LibreTranslate routes."""
    app = FastAPI()
    app.add_middleware(BodyMiddleware)
    app.add_middleware(GuardMiddleware, get_guard=lambda: guard, libre_paths=LIBRE_PATHS)
    app.add_middleware(CorsMiddleware, get_origins=lambda: list(origins))
    add_exception_handlers(app)

    @app.post("/v2/translate")
    async def translate(request: Request):
        fields = await read_fields(request, deepl.LIST_FIELDS, 400)
        body = deepl.parse(fields)
        return {"texts": body.text, "scope": caller_of(request).scope}

    @app.post("/translate")
    async def libre(request: Request):
        fields, denied = await read_admitted(request)      # LibreTranslate's api_key field, as the route does
        return denied or {"translatedText": fields.get("q")}

    @app.get("/")
    async def page():
        return {"page": True}

    @app.get("/frontend/settings")
    async def settings():
        return {"keyRequired": guard.keys_on}
    return TestClient(app)


def test_deepl_auth_key_is_a_service_key_and_403s_in_deepls_shape():
    guard = Guard(GuardSettings(), env="k1,k2")
    client, memory_scope = make_client(guard), guard.hasher.scope
    ok = client.post("/v2/translate", data={"text": ["a", "b"], "target_lang": "DE"},
                     headers={"Authorization": "DeepL-Auth-Key k1"})
    assert ok.status_code == 200 and ok.json() == {"texts": ["a", "b"], "scope": memory_scope("k1")}
    other = client.post("/v2/translate", json={"text": ["a"], "target_lang": "DE"},
                        headers={"Authorization": "Bearer k2"})
    assert other.json()["scope"] == memory_scope("k2") != memory_scope("k1")
    for headers in ({}, {"Authorization": "DeepL-Auth-Key wrong"}, {"Authorization": "Basic azE="}):
        r = client.post("/v2/translate", json={"text": ["a"], "target_lang": "DE"}, headers=headers)
        assert r.status_code == 403 and set(r.json()) == {"message"} and "WWW-Authenticate" not in r.headers, r.text
    assert client.get("/frontend/settings").json() == {"keyRequired": True}   # open: the page learns it needs a key
    bad = client.post("/v2/translate", json={"text": ["a"]}, headers={"Authorization": "DeepL-Auth-Key k1"})
    assert bad.status_code == 400 and "target_lang" in bad.json()["message"]
    big = client.post("/v2/translate", content=b"x" * (5 << 20), headers={"Authorization": "DeepL-Auth-Key k1",
                                                                           "Content-Type": "application/json"})
    assert big.status_code == 413 and "message" in big.json()


def test_cors_preflight_without_a_key_and_headers_on_every_answer():
    client = make_client(Guard(GuardSettings(), env="k1"))
    for path in ("/translate", "/v2/translate"):
        pre = client.options(path, headers={"Origin": "https://example.org", "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == "*"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    denied = client.post("/translate", data={"q": "a"}, headers={"Origin": "https://example.org"})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"   # readable error
    ok = client.post("/v2/translate", json={"text": ["a"], "target_lang": "DE"},
                     headers={"Origin": "https://example.org", "Authorization": "DeepL-Auth-Key k1"})
    assert ok.headers["access-control-allow-origin"] == "*" and "X-Request-ID" in ok.headers[
        "access-control-expose-headers"]
    assert "access-control-allow-origin" not in client.get("/", headers={"Authorization": "Bearer k1"}).headers
    only = make_client(Guard(GuardSettings()), origins=("https://app.example",))
    assert only.options("/translate", headers={"Origin": "https://evil.example",
                                               "Access-Control-Request-Method": "POST"}).status_code == 400
    good = only.post("/translate", data={"q": "a"}, headers={"Origin": "https://app.example"})
    assert good.headers["access-control-allow-origin"] == "https://app.example"
    none = make_client(Guard(GuardSettings()), origins=())
    assert "access-control-allow-origin" not in none.post("/translate", headers={"Origin": "https://x.example"}).headers


def test_frontend_settings_have_libretranslates_shape():
    cards = [ModelCard(id="de-en", checkpoint="x", source_lang="de", target_lang="en", config=None)]
    s = frontend_settings(cards, keys_on=True, suggestions=True).model_dump()
    assert set(s) == {"charLimit", "frontendTimeout", "apiKeys", "keyRequired", "suggestions", "filesTranslation",
                      "supportedFilesFormat", "language"}
    assert s["charLimit"] == MAX_TEXT_CHARS and s["keyRequired"] is True and s["suggestions"] is True
    assert s["language"] == {"source": {"code": "auto", "name": "Auto Detect"},
                             "target": {"code": "en", "name": "English"}}


def test_405_allow_names_every_route_of_the_path():
    app = FastAPI()
    add_exception_handlers(app)
    for method in ("get", "put", "delete"):
        getattr(app, method)("/v1/memory")(lambda: {})
    r = TestClient(app).patch("/v1/memory")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "PUT", "DELETE", "HEAD"}


def test_deepl_glossary_id_puts_the_stored_glossary_on_every_job_and_its_term_in_the_output(card):
    from service.api import glossaries
    store = glossaries.GlossaryStore()

    async def main():
        t = Translator(card)
        await t.reconfigure({"max_num_seqs": 8})
        client = glossaries.GlossaryClient(store)
        await client.create(glossaries.SHARED, glossaries.GlossaryCreate.model_validate(
            {"name": "terms", "source_lang": "de", "target_lang": "en", "entries": [{"source": "Hund", "target": "canine"}]}))
        seen = []

        async def run(model, job):
            seen.append(job)
            return await t.translate(job)
        ctx = local_services([card], run, glossaries=client)
        out, _ = await deepl.translate(deepl.parse({"text": ["Ein Hund läuft.", "Zwei Männer spielen."],
                                                    "source_lang": "DE", "target_lang": "EN-GB",
                                                    "glossary_id": "terms"}), REQUEST, ctx)
        assert seen[-1].glossary == (("Hund", "canine"),) and seen[-1].stored_glossary
        assert "canine" in out[0]["text"]
        seen.clear()        # without source_lang: the glossary of the detected language's pair
        await deepl.translate(deepl.parse({"text": "Ein Hund läuft über die Wiese.", "target_lang": "EN-GB",
                                           "glossary_id": "terms"}), REQUEST, ctx)
        assert seen[-1].glossary == (("Hund", "canine"),)
        for fields, status, field in (({"text": "a", "source_lang": "DE", "target_lang": "EN-GB", "glossary_id": "nope"},
                                       404, "glossary_id"),):
            with pytest.raises(ServiceError) as e:
                await deepl.translate(deepl.parse(fields), REQUEST, ctx)
            assert (e.value.status, e.value.field) == (status, field), e.value.message
        await t.stop()
    asyncio.run(main())


def test_frontend_settings_list_the_document_formats_translate_file_takes():
    """A LibreTranslate page shows its file tab only when filesTranslation is true, offering the
    extensions of supportedFilesFormat ('.docx', with the dot, as LibreTranslate sends them)."""
    from service.documents import FORMATS
    cards = [ModelCard(id="de-en", checkpoint="x", source_lang="de", target_lang="en", config=None)]
    s = frontend_settings(cards, keys_on=False, suggestions=True).model_dump()
    assert s["filesTranslation"] is True
    assert s["supportedFilesFormat"] == ["." + ext for ext in FORMATS]
    assert {".txt", ".html", ".docx", ".pptx", ".odt", ".md", ".srt", ".vtt"} <= set(s["supportedFilesFormat"])
