"""Real-world text over HTTP, against the running service with the shipped model: protected spans,
capitals and indented HTML (issue 20's rows that concern them). The same behaviour is tested in
depth in-process (test_translator_protect.py, test_translator_case.py)."""
from __future__ import annotations

import httpx
import pytest


pytestmark = pytest.mark.slow      # every test runs against the shared Ray Serve app (service_url)


@pytest.fixture
def url(service_url, service_info) -> str:
    if not service_info.shipped:
        pytest.skip("the shipped model model/checkpoints/de-en is not in this checkout")
    return service_url


def test_spans_and_capitals_through_v1_translate(url):
    texts = ["Ein Hund 😆 rennt.", "Ein Hund rennt. 🐶", "Besuchen Sie https://example.com/path?x=1 heute.",
             "EIN HUND LÄUFT.", "Ein Hund läuft.", "Ein Hund rennt.", "Um 12:30 Uhr kostet es 3,50 €."]
    r = httpx.post(url + "/v1/translate", json={"text": texts, "beam_size": 4}, timeout=120)
    assert r.status_code == 200, r.text
    emoji, after, link, caps, plain, runs, price = [t["text"] for t in r.json()["translations"]]
    assert emoji.count("😆") == 1 and len(emoji.split()) <= 7
    assert after == runs + " 🐶"
    assert link.count("https://example.com/path?x=1") == 1
    assert caps == plain.upper()
    assert price.count("12:30") == 1 and price.count("3,50 €") == 1


def test_libretranslate_html_paragraph_with_indentation_is_one_sentence(url):
    html = "<p>\n\tEin Mann\n\tfährt Fahrrad.\n</p>"
    r = httpx.post(url + "/translate", json={"q": html, "source": "de", "target": "en", "format": "html"}, timeout=60)
    one = httpx.post(url + "/translate", json={"q": "Ein Mann fährt Fahrrad.", "source": "de", "target": "en"},
                     timeout=60)
    assert r.status_code == 200 and one.status_code == 200
    assert r.json()["translatedText"] == "<p>\n\t" + one.json()["translatedText"] + "\n</p>"
