"""Markup not translated, and DeepL's tag options, on every route that reads markup (one segmenter:
service/pipeline/markup.py): ``translate="no"`` and ``class="notranslate"`` come back byte for byte in
place on LibreTranslate's ``format=html``, DeepL's ``tag_handling`` and the HTML document route, and
``translate="yes"`` inside translates again; DeepL's ``ignore_tags``, ``splitting_tags``,
``non_splitting_tags`` and ``outline_detection`` change the segments as DeepL documents them, and a
value that cannot be applied is a 400 naming it. In-process: the translator upper-cases each segment
it gets and wraps it in brackets, so what was translated and where segments begin and end show."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from local_services import local_services

from model.config import ModelConfig
from service.api.http import build_app
from service.protocol import TranslateResponse, Translation, Usage
from service.translator import ModelCard

CARD = ModelCard("de-en", "", "de", "en", ModelConfig.from_name("tiny", vocab_size=500, max_len=64))

# a sentence with an element not translated inside it, a block not translated (Google's class), and a
# block not translated around an element that is (HTML's translate attribute, inherited)
PAGE = ('<p>Ein Hund <span translate="no">Foo Bar</span> läuft.</p>'
        '<p class="intro notranslate">Zwei Katzen.</p>'
        '<div translate="no">Code <b translate="yes">ein Test</b> hier</div>')
KEPT = ("Foo Bar", "Zwei Katzen", "Code", "hier")      # what the translator must never see


@pytest.fixture
def client():
    seen: list[list[str]] = []      # each job's segments

    async def run(model, job):
        seen.append(list(job.texts))
        return TranslateResponse(model=model, usage=Usage(source_tokens=0, generated_tokens=0), translations=[
            Translation(text=f"[{t.upper()}]", tokens=[], source_tokens=[], score=0.0, finish_reason="eos")
            for t in job.texts])
    c = TestClient(build_app(local_services([CARD], run)))
    c.seen = seen
    return c


def deepl(client, text, **fields) -> str:
    r = client.post("/v2/translate", json={"text": [text], "source_lang": "DE", "target_lang": "EN-GB", **fields})
    assert r.status_code == 200, r.text
    return r.json()["translations"][0]["text"]


def test_translate_no_and_notranslate_come_back_verbatim_in_place_on_every_route(client):
    want = ('<p>[EIN HUND <span translate="no">Foo Bar</span> LÄUFT.]</p>'
            '<p class="intro notranslate">Zwei Katzen.</p>'
            '<div translate="no">Code <b translate="yes">[EIN TEST]</b> hier</div>')
    r = client.post("/translate", json={"q": PAGE, "source": "de", "target": "en", "format": "html"})
    assert r.status_code == 200 and r.json()["translatedText"] == want, r.text
    assert deepl(client, PAGE, tag_handling="html") == want
    assert deepl(client, PAGE, tag_handling="xml") == want
    r = client.post("/v1/documents", files={"file": ("page.html", PAGE.encode())}, data={"target_lang": "en"})
    assert r.status_code == 200 and r.content.decode() == want, r.text
    # the sentence went as one segment, the element's place in it held by one sentinel; nothing kept was sent
    assert len(client.seen) == 4 and all(len(s) == 2 and s[1] == "ein Test" for s in client.seen)
    assert all(s[0].startswith("Ein Hund ") and s[0].endswith(" läuft.") and len(s[0]) == len("Ein Hund X läuft.")
               for s in client.seen)
    assert not any(k in text for s in client.seen for text in s for k in KEPT)


def test_deepl_ignore_tags_keeps_the_content_in_its_sentence(client):
    text = "Please open the page <x>Settings</x> to configure your system."
    assert deepl(client, text, tag_handling="xml") == \
        "[PLEASE OPEN THE PAGE <x>SETTINGS</x> TO CONFIGURE YOUR SYSTEM.]"
    assert deepl(client, text, tag_handling="xml", ignore_tags="x") == \
        "[PLEASE OPEN THE PAGE <x>Settings</x> TO CONFIGURE YOUR SYSTEM.]"
    assert len(client.seen[-1]) == 1 and "Settings" not in client.seen[-1][0]
    # a form's repeated field; HTML's names in any case; a block element ignored stays whole
    r = client.post("/v2/translate", data={"text": "<p>Ein Hund.</p><KEEP>Ein Hund.</KEEP>", "target_lang": "EN-GB",
                                           "source_lang": "DE", "tag_handling": "html", "ignore_tags": ["a", "keep"]})
    assert r.status_code == 200 and r.json()["translations"][0]["text"] == "<p>[EIN HUND.]</p><KEEP>Ein Hund.</KEEP>"


def test_deepl_non_splitting_and_splitting_tags_join_and_split_sentences(client):
    """DeepL's own example: each par splits the sentence in two, unless par is a non-splitting tag; a
    splitting tag splits where the element would otherwise sit inside the sentence."""
    text = "<par>The firm said it had been </par><par> conducting an internal investigation.</par>"
    out = deepl(client, text, tag_handling="xml")
    assert client.seen[-1] == ["The firm said it had been", "conducting an internal investigation."]
    assert out == "<par>[THE FIRM SAID IT HAD BEEN] </par><par> [CONDUCTING AN INTERNAL INVESTIGATION.]</par>"
    out = deepl(client, text, tag_handling="xml", non_splitting_tags=["par"])
    assert client.seen[-1][0] == "The firm said it had been conducting an internal investigation."
    assert out.count("[") == 1 and out.count("<par>") == 2 and "conducting" not in out, out
    text = "Drücken Sie <b>Weiter</b>, um fortzufahren."
    assert deepl(client, text, tag_handling="html") == "[DRÜCKEN SIE <b>WEITER</b>, UM FORTZUFAHREN.]"
    assert client.seen[-1][0] == "Drücken Sie Weiter, um fortzufahren."
    assert deepl(client, text, tag_handling="html", splitting_tags="b") == \
        "[DRÜCKEN SIE] <b>[WEITER]</b>[, UM FORTZUFAHREN.]"
    assert client.seen[-1] == ["Drücken Sie", "Weiter", ", um fortzufahren."]


def test_deepl_outline_detection_off_splits_at_the_splitting_tags_only(client):
    text = "<doc><title>Ein Titel</title><par>Der erste Teil</par> <par>und der zweite.</par></doc>"
    deepl(client, text, tag_handling="xml")
    assert client.seen[-1] == ["Ein Titel", "Der erste Teil", "und der zweite."]
    deepl(client, text, tag_handling="xml", outline_detection=False, splitting_tags="title")
    assert client.seen[-1][:2] == ["Ein Titel", "Der erste Teil und der zweite."]
    r = client.post("/v2/translate", data={"text": text, "target_lang": "EN-GB", "source_lang": "DE",
                                           "tag_handling": "xml", "outline_detection": "0", "splitting_tags": "title"})
    assert r.status_code == 200 and client.seen[-1][:2] == ["Ein Titel", "Der erste Teil und der zweite."]


@pytest.mark.parametrize("fields, field", [
    ({"tag_handling": "xml", "ignore_tags": "a b"}, "ignore_tags"),
    ({"tag_handling": "xml", "splitting_tags": ["p", 3]}, "splitting_tags"),
    ({"tag_handling": "xml", "non_splitting_tags": {"p": 1}}, "non_splitting_tags"),
    ({"tag_handling": "html", "outline_detection": "sometimes"}, "outline_detection"),
    ({"ignore_tags": "x"}, "ignore_tags"),                          # no tag handling: the tags are text
    ({"outline_detection": False}, "outline_detection"),
    ({"tag_handling": "html", "splitting_tags": "P", "non_splitting_tags": "p"}, "non_splitting_tags"),
])
def test_deepl_tag_options_that_cannot_apply_are_400_naming_the_field(client, fields, field):
    r = client.post("/v2/translate", json={"text": "<p>Ein Hund.</p>", "target_lang": "EN-GB", **fields})
    assert r.status_code == 400 and f"'{field}'" in r.json()["message"], r.text
    assert not client.seen


def test_deepl_tag_options_are_no_longer_named_ignored(client):
    r = client.post("/v2/translate", json={"text": "<p>Ein Hund.</p>", "target_lang": "EN-GB", "source_lang": "DE",
                                           "tag_handling": "xml", "ignore_tags": "x", "splitting_tags": "p",
                                           "non_splitting_tags": "b", "outline_detection": True, "context": "c"})
    assert r.status_code == 200 and r.headers["X-Ignored-Fields"] == "context"
