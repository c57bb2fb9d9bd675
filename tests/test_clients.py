"""Clients against the running service (slow: the shared Ray service of conftest.py): DeepL's official
Python client (``deepl``) and LibreTranslate's (``libretranslatepy``), /frontend/settings, /suggest and
the translation memory on every route, /v1/memory import and export, CORS preflights."""
from __future__ import annotations

import httpx
import pytest

from conftest import DATA, metric_sum, translate, wait_for_metric
from model.tokenizer import read_lines

DE = read_lines(DATA / "val.de.gz")[:40]


def _clear(url: str, model: str = "de-en") -> None:
    r = httpx.delete(url + "/v1/memory", params={"model": model}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_deepl_client_translates_text_and_html_and_lists_languages(service_url):
    import deepl
    tr = deepl.Translator("any-key:fx", server_url=service_url)      # keys are off: any key is let through
    want = translate(service_url, [DE[1], DE[2]], source_lang="de", target_lang="en")["translations"]
    got = tr.translate_text([DE[1], DE[2]], source_lang="DE", target_lang="EN-US")
    assert [g.text for g in got] == [w["text"] for w in want]
    assert [g.detected_source_lang for g in got] == ["DE", "DE"] and got[0].billed_characters == len(DE[1])
    auto = tr.translate_text(DE[1], target_lang="EN-GB")                 # no source_lang: detected
    assert auto.text == want[0]["text"] and auto.detected_source_lang == "DE"
    html = f"<p>{DE[3]} <b>{DE[4]}</b></p>"
    lt = httpx.post(service_url + "/translate", json={"q": html, "source": "de", "target": "en", "format": "html"},
                    timeout=120).json()["translatedText"]
    got = tr.translate_text(html, source_lang="DE", target_lang="EN-GB", tag_handling="html")
    assert got.text == lt and got.text.startswith("<p>") and got.text.endswith("</p>")
    assert got.text.count("<b>") == got.text.count("</b>") == 1
    assert {"DE", "EN"} <= {lang.code for lang in tr.get_source_languages()}
    targets = {lang.code: lang for lang in tr.get_target_languages()}
    assert {"EN-GB", "EN-US", "DE"} <= set(targets) and targets["EN-GB"].supports_formality is False
    usage = tr.get_usage()
    assert usage.character.valid and usage.character.count >= len(DE[1]) + len(DE[2]) and not usage.any_limit_reached
    with pytest.raises(deepl.DeepLException, match="target_lang"):
        tr.translate_text(DE[1], target_lang="JA")
    r = httpx.post(service_url + "/v2/translate", data={"text": [DE[1], DE[2]], "target_lang": "EN-GB",
                                                        "source_lang": "DE", "formality": "more"}, timeout=120)
    assert r.status_code == 200 and [t["text"] for t in r.json()["translations"]] == [w["text"] for w in want]
    assert r.headers["x-ignored-fields"] == "formality"
    for body in ({"text": [DE[1]]}, {"text": [DE[1]], "target_lang": "EN-GB", "split_sentences": "2"},
                 {"text": [DE[1]], "target_lang": "EN-GB", "tag_handling": "markdown"}):
        r = httpx.post(service_url + "/v2/translate", json=body, timeout=60)
        assert r.status_code == 400 and set(r.json()) == {"message"}, r.text
    r = httpx.post(service_url + "/v2/translate", json={"text": [DE[1]], "target_lang": "EN-GB", "source_lang": "DE",
                                                        "glossary_id": "no-such"}, timeout=60)
    assert r.status_code == 404 and "glossary_id" in r.json()["message"], r.text


@pytest.mark.slow
def test_a_suggestion_changes_that_sentence_on_every_route_and_counts_in_the_metrics(service_url):
    from libretranslatepy import LibreTranslateAPI
    _clear(service_url)
    first, second = [d for d in sorted(DE, key=len) if d.endswith(".")][:2]   # short: the tiny en-de model takes them
    text = f"{first} {second}"
    before = translate(service_url, text, source_lang="de", target_lang="en")["translations"][0]["text"]
    alone = translate(service_url, second, source_lang="de", target_lang="en")["translations"][0]["text"]
    settings = httpx.get(service_url + "/frontend/settings", timeout=30).json()
    assert settings["suggestions"] is True and settings["keyRequired"] is False and settings["charLimit"] == 5000
    assert settings["language"]["source"] == {"code": "auto", "name": "Auto Detect"}
    r = httpx.post(service_url + "/suggest", data={"q": first, "s": "A corrected sentence.", "source": "de",
                                                   "target": "en"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"success": True}
    scrape_before = metric_sum(httpx.get(service_url + "/metrics", timeout=30).text, "ray_mt_memory_lookups_total",
                               result="memory")
    for _ in range(4):      # both ingress replicas answer in turn: each reads the one memory file
        native = translate(service_url, text, source_lang="de", target_lang="en")["translations"][0]["text"]
        assert native == "A corrected sentence. " + alone, (native, before)
    lt = LibreTranslateAPI(service_url)
    assert lt.translate(first, source="de", target="en") == "A corrected sentence."
    assert lt.translate(second, source="de", target="en") == alone                 # the other sentence: unchanged
    import deepl
    assert deepl.Translator("k", server_url=service_url).translate_text(
        first, source_lang="DE", target_lang="EN-GB").text == "A corrected sentence."
    html = httpx.post(service_url + "/translate", json={"q": f"<p>{first}</p>", "source": "de", "target": "en",
                                                       "format": "html"}, timeout=60).json()["translatedText"]
    assert html == "<p>A corrected sentence.</p>"
    other = translate(service_url, first, model="tiny-en-de")                       # another model's memory
    assert other["translations"][0]["text"] != "A corrected sentence."
    hits = metric_sum(wait_for_metric(service_url, lambda t: metric_sum(t, "ray_mt_memory_lookups_total",
                                                                       result="memory") >= scrape_before + 7),
                      "ray_mt_memory_lookups_total", result="memory")
    assert hits >= scrape_before + 7        # 4 native, LibreTranslate, DeepL, HTML: one stored sentence each
    for body, field in (({"q": first, "source": "de", "target": "en"}, "s"), ({"s": "x", "source": "de", "target": "en"},
                                                                             "q"),
                        ({"q": first, "s": "x", "source": "auto", "target": "en"}, "source"),
                        ({"q": first, "s": "x", "source": "de", "target": "ja"}, "ja")):
        r = httpx.post(service_url + "/suggest", json=body, timeout=30)
        assert r.status_code == 400 and field in r.json()["error"], r.text
    _clear(service_url)
    assert translate(service_url, text, source_lang="de", target_lang="en")["translations"][0]["text"] == before


@pytest.mark.slow
def test_memory_import_export_round_trip_tsv_and_tmx(service_url):
    _clear(service_url)
    pairs = [(DE[10], "First stored."), (DE[11], 'Second "stored"\twith a tab.')]
    tsv = "".join(f"{s}\t{t}\n" for s, t in pairs[:1]) + f'{pairs[1][0]}\t"{pairs[1][1].replace(chr(34), 2 * chr(34))}"\n'
    r = httpx.put(service_url + "/v1/memory", params={"model": "de-en"}, content=tsv.encode(),
                  headers={"Content-Type": "text/tab-separated-values"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"model": "de-en", "stored": 2}, r.text
    got = httpx.get(service_url + "/v1/memory", params={"source_lang": "de", "target_lang": "en"}, timeout=30).json()
    assert sorted((e["source"], e["target"]) for e in got["entries"]) == sorted(pairs)
    out = translate(service_url, [DE[10], DE[11]], source_lang="de", target_lang="en")["translations"]
    assert [t["text"] for t in out] == [p[1] for p in pairs]
    tmx = httpx.get(service_url + "/v1/memory", params={"model": "de-en", "format": "tmx"}, timeout=30)
    assert tmx.headers["content-type"].startswith("application/x-tmx+xml") and b"<tmx" in tmx.content
    _clear(service_url)
    r = httpx.put(service_url + "/v1/memory", params={"model": "de-en"}, content=tmx.content,
                  headers={"Content-Type": "application/x-tmx+xml"}, timeout=30)
    assert r.json()["stored"] == 2
    again = httpx.get(service_url + "/v1/memory", params={"model": "de-en", "format": "tsv"}, timeout=30)
    assert again.text.count("\n") >= 2 and "First stored." in again.text
    r = httpx.delete(service_url + "/v1/memory", params={"model": "de-en", "source": DE[10]}, timeout=30)
    assert r.json() == {"model": "de-en", "deleted": 1}
    bomb = (b'<?xml version="1.0"?><!DOCTYPE tmx [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;">]>'
            b'<tmx version="1.4"><body/></tmx>')
    for params, body, ctype, status, words in (
            ({"model": "de-en"}, bomb, "application/x-tmx+xml", 422, "DTD"),
            ({"model": "de-en"}, b"only one field\n", "text/tab-separated-values", 422, "line 1"),
            ({"model": "nope"}, b"a\tb\n", "text/tab-separated-values", 404, "model"),
            ({"model": "de-en", "colour": "x"}, b"a\tb\n", "text/tab-separated-values", 422, "colour"),
            ({"model": "de-en"}, b"a,b\n", "text/csv", 415, "Content-Type")):
        r = httpx.put(service_url + "/v1/memory", params=params, content=body, headers={"Content-Type": ctype},
                      timeout=30)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    r = httpx.get(service_url + "/v1/memory", params={"model": "de-en", "format": "xlsx"}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["field"] == "format"
    _clear(service_url)


@pytest.mark.slow
def test_cors_preflights_on_public_routes_and_the_explorer_unaffected(service_url):
    for path in ("/translate", "/v1/translate", "/v2/translate", "/suggest", "/detect", "/v1/memory"):
        r = httpx.options(service_url + path, headers={"Origin": "https://client.example",
                                                       "Access-Control-Request-Method": "POST",
                                                       "Access-Control-Request-Headers": "content-type"}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", (path, r.status_code)
    r = httpx.post(service_url + "/translate", json={"q": DE[1], "source": "de", "target": "en"},
                   headers={"Origin": "https://client.example"}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    page = httpx.get(service_url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "access-control-allow-origin" not in page.headers     # same-origin page: no Origin, no CORS headers
