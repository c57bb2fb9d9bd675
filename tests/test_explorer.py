"""The attention explorer (``GET /``, service/api/explorer.py) in a real browser against the running
service: Debian's headless chromium driven by selenium through the system chromedriver
(deploy/install_browser.sh installs both when missing), background networking off. One browser for
the module. Every figure the page shows is compared with the API's answer to the same request.

A screenshot is saved as a test artifact: to ``$EXPLORER_SCREENSHOT`` when set, else into the test's
tmp dir (docs/explorer.png is one such screenshot).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest

from model.tokenizer import read_lines

pytest.importorskip("selenium")
from selenium import webdriver                                    # noqa: E402
from selenium.webdriver.chrome.service import Service             # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By                       # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait   # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
KINDS = ("cross", "encoder", "decoder")
DIGITS = 4                     # decimals of the tooltip's weight (explorer.js DIGITS)
WAIT_S = 60
TEST_DE = read_lines(ROOT / "model" / "data" / "multi30k" / "test_2016_flickr.de.gz")
ONE = TEST_DE[0]
THREE = " ".join(TEST_DE[1:4])                                    # three sentences: the sentence picker


def long_sentence() -> str:
    """One sentence of the 2 longest test sentences joined by a comma (60+ tokens)."""
    parts = sorted(TEST_DE, key=len)[-2:]
    return ", und ".join([parts[0].rstrip(".")] + [p[0].lower() + p[1:].rstrip(".") for p in parts[1:]]) + "."


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        r = subprocess.run(["bash", str(ROOT / "deploy" / "install_browser.sh")], capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, f"deploy/install_browser.sh failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="explorer-chromium-")
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1000"):
        opts.add_argument(arg)
    from service.ray_env import spare_port     # chromedriver's port: not one the OS could hand a Ray process
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER, port=spare_port()), options=opts)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def api(url: str, text: str, beam_size: int = 4, model: str = "de-en") -> dict:
    """The page's request, sent directly: the first translation with every kind of attention."""
    r = httpx.post(f"{url}/v1/translate", timeout=WAIT_S, json={
        "text": text, "model": model, "beam_size": beam_size, "return_attention": True,
        "attention": {"kinds": list(KINDS)}})
    r.raise_for_status()
    return r.json()["translations"][0]


def open_page(d, url: str, **query) -> None:
    d.get(f"{url}/" + (f"?{urlencode(query)}" if query else ""))
    WebDriverWait(d, WAIT_S).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")


def done(d) -> int:
    return int(d.find_element(By.TAG_NAME, "body").get_attribute("data-done") or 0)


def translate_typed(d, text: str) -> None:
    box = d.find_element(By.ID, "text")
    box.clear()
    box.send_keys(text)
    Select(d.find_element(By.ID, "model")).select_by_value("de-en")
    before = done(d)
    d.find_element(By.ID, "translate").click()
    WebDriverWait(d, WAIT_S).until(lambda d: done(d) > before)


def heatmaps(d, kind: str, cls: str = "heatmap") -> list:
    return d.find_elements(By.CSS_SELECTOR, f"canvas.{cls}[data-kind={kind}]")


def matrix(el) -> list:
    return json.loads(el.get_attribute("data-matrix"))


def labels(d, kind: str, axis: str) -> list[str]:
    return [s.get_attribute("textContent") for s in d.find_elements(
        By.CSS_SELECTOR, f".panel[data-kind={kind}] .detail figure:first-child .labels[data-axis={axis}] .tok")]


def tab(d, kind: str) -> None:
    d.find_element(By.CSS_SELECTOR, f".tabs button[data-tab={kind}]").click()


def hover_cell(d, canvas, row: int, col: int) -> str:
    """Move the mouse to the centre of a cell; the tooltip's weight text."""
    rows, cols = int(canvas.get_attribute("data-rows")), int(canvas.get_attribute("data-cols"))
    d.execute_script("arguments[0].scrollIntoView({block: 'center', inline: 'center'})", canvas)
    w, h = canvas.size["width"], canvas.size["height"]
    dx, dy = (col + 0.5) * w / cols - w / 2, (row + 0.5) * h / rows - h / 2    # from the element's centre
    ActionChains(d).move_to_element_with_offset(canvas, int(dx), int(dy)).perform()
    tip = d.find_element(By.ID, "tooltip")
    WebDriverWait(d, 5).until(lambda _: tip.is_displayed() and tip.get_attribute("data-row") == str(row)
                              and tip.get_attribute("data-col") == str(col))
    return tip.text


@pytest.fixture(scope="module")
def typed(browser, service_url):
    """The page after typing ONE and pressing Translate; the API's translation of the same request."""
    open_page(browser, service_url)
    translate_typed(browser, ONE)
    return browser, api(service_url, ONE)


def test_typed_sentence_shows_the_apis_translation_and_score(typed, service_url):
    d, tr = typed
    assert d.find_element(By.ID, "error").is_displayed() is False
    assert d.find_element(By.ID, "translation").text == tr["text"]
    assert d.find_element(By.ID, "score").text == f"{tr['score']:.4f}"
    models = httpx.get(f"{service_url}/v1/models", timeout=WAIT_S).json()["data"]
    options = [o.get_attribute("value") for o in Select(d.find_element(By.ID, "model")).options]
    assert options == [m["id"] for m in models]      # every served model


def test_one_heatmap_per_layer_and_head_of_each_kind_with_the_apis_weights(typed, service_url):
    d, tr = typed
    config = next(m for m in httpx.get(f"{service_url}/v1/models", timeout=WAIT_S).json()["data"]
                  if m["id"] == "de-en")["config"]
    layers = {"cross": config["n_decoder_layers"], "encoder": config["n_encoder_layers"],
              "decoder": config["n_decoder_layers"]}
    for kind in KINDS:
        maps = heatmaps(d, kind)
        assert len(maps) == layers[kind] * config["n_heads"] == len(tr["attention"][kind]) * len(tr["attention"][kind][0])
        for el in maps:
            layer, head = int(el.get_attribute("data-layer")), int(el.get_attribute("data-head"))
            assert matrix(el) == tr["attention"][kind][layer][head]


def test_token_labels_are_the_apis_tokens(typed):
    d, tr = typed
    assert labels(d, "cross", "rows") == tr["tokens"] and labels(d, "cross", "cols") == tr["source_tokens"]
    assert labels(d, "encoder", "rows") == labels(d, "encoder", "cols") == tr["source_tokens"]
    assert labels(d, "decoder", "rows") == labels(d, "decoder", "cols") == tr["tokens"]


def test_hover_shows_the_apis_weight_and_both_tokens(typed):
    d, tr = typed
    zoom = heatmaps(d, "cross", "zoom")[0]
    layer, head = int(zoom.get_attribute("data-layer")), int(zoom.get_attribute("data-head"))
    m = tr["attention"]["cross"][layer][head]
    best = max(((r, c) for r in range(len(m)) for c in range(len(m[0]))), key=lambda rc: m[rc[0]][rc[1]])
    for r, c in (best, (0, 0), (len(m) - 1, len(m[0]) - 1), (len(m) // 2, len(m[0]) // 3)):
        text = hover_cell(d, zoom, r, c)
        shown = float(text.split("weight")[-1])
        assert abs(shown - m[r][c]) <= 0.5 * 10 ** -DIGITS + 1e-9, (r, c, text, m[r][c])
        assert tr["tokens"][r] in text and tr["source_tokens"][c] in text


def test_decoder_self_attention_has_no_weight_above_the_diagonal(typed):
    d, tr = typed
    tab(d, "decoder")
    assert d.find_element(By.CSS_SELECTOR, ".panel[data-kind=decoder]").is_displayed()
    assert not d.find_element(By.CSS_SELECTOR, ".panel[data-kind=cross]").is_displayed()
    for el in heatmaps(d, "decoder") + heatmaps(d, "decoder", "zoom") + heatmaps(d, "decoder", "average"):
        m = matrix(el)
        assert len(m) == len(m[0]) == len(tr["tokens"])
        assert all(m[i][j] == 0 for i in range(len(m)) for j in range(i + 1, len(m)))
        assert all(abs(sum(row) - 1) < 1e-3 for row in m)
    tab(d, "cross")


def test_clicking_a_target_token_shows_what_it_attends_to_in_every_head(typed):
    d, tr = typed
    t = len(tr["tokens"]) // 2
    d.find_elements(By.CSS_SELECTOR, ".panel[data-kind=cross] .labels[data-axis=rows] .tok")[t].click()
    picked = d.find_elements(By.CSS_SELECTOR, ".panel[data-kind=cross] .labels[data-axis=rows] .tok.picked")
    assert [p.get_attribute("textContent") for p in picked] == [tr["tokens"][t]] * len(picked) and picked
    minis = d.find_elements(By.CSS_SELECTOR, ".panel[data-kind=cross] figure.mini")
    cross = tr["attention"]["cross"]
    assert len(minis) == len(cross) * len(cross[0])
    for fig in minis:
        canvas = fig.find_element(By.TAG_NAME, "canvas")
        row = cross[int(canvas.get_attribute("data-layer"))][int(canvas.get_attribute("data-head"))][t]
        top = max(range(len(row)), key=row.__getitem__)
        assert fig.find_element(By.CSS_SELECTOR, "figcaption.top").text == f"{tr['source_tokens'][top]} {row[top]:.2f}"
    lines = d.find_elements(By.CSS_SELECTOR, "svg.alignment line.link")
    assert len(lines) == len(tr["tokens"])       # one alignment line per target token
    assert [ln.get_attribute("data-target") for ln in lines if "picked" in ln.get_attribute("class")] == [str(t)]


def test_shared_link_translates_on_load_and_fills_the_form(browser, service_url):
    open_page(browser, service_url, text=THREE, model="de-en", beam_size=1)
    d, tr = browser, api(service_url, THREE, beam_size=1)
    assert done(d) == 1 and d.find_element(By.ID, "translation").text == tr["text"]
    assert d.find_element(By.ID, "text").get_attribute("value") == THREE
    assert d.find_element(By.ID, "beam").get_attribute("value") == "1"
    # the sentence picker: one entry per sentence (plus "all"); a sentence shows its block only
    ends = [i + 1 for i, t in enumerate(tr["source_tokens"]) if t == "</s>"]
    picker = Select(d.find_element(By.ID, "sentence"))
    assert len(picker.options) == len(ends) + 1 >= 3
    picker.select_by_value("1")
    s0, s1 = ends[0], ends[1]
    cross = tr["attention"]["cross"][0][0]
    rows = [i for i, row in enumerate(cross) if sum(row[s0:s1]) > 0.5]
    assert labels(d, "cross", "cols") == tr["source_tokens"][s0:s1]
    assert labels(d, "cross", "rows") == [tr["tokens"][i] for i in rows]
    assert matrix(heatmaps(d, "cross")[0]) == [cross[i][s0:s1] for i in rows]


def test_sentence_of_60_tokens_renders_quickly(browser, service_url):
    text = long_sentence()
    tr = api(service_url, text, beam_size=1)
    assert len(tr["source_tokens"]) >= 60
    open_page(browser, service_url)
    t0 = time.perf_counter()
    browser.find_element(By.ID, "beam").clear()
    browser.find_element(By.ID, "beam").send_keys("1")
    translate_typed(browser, text)
    assert browser.find_element(By.ID, "translation").text == tr["text"]
    assert labels(browser, "encoder", "cols") == tr["source_tokens"]
    assert len(heatmaps(browser, "encoder")) == len(tr["attention"]["encoder"]) * len(tr["attention"]["encoder"][0])
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("query, words", [
    ({"model": "no-such-model"}, ["does not serve this model", "no-such-model"]),
    ({"text": "Hund " * 1100}, ["text is too long", "5000 characters"]),
    ({"beam_size": 99}, ["did not accept", "beam_size"]),
])
def test_api_errors_are_shown_in_plain_words(browser, service_url, query, words):
    open_page(browser, service_url, **{"text": ONE, **query})
    err = browser.find_element(By.ID, "error")
    assert err.is_displayed() and done(browser) == 1
    for w in words:
        assert w in err.text, err.text
    assert "{" not in err.text and "Traceback" not in err.text


def test_screenshot_artifact(browser, service_url, tmp_path):
    open_page(browser, service_url, text=" ".join(TEST_DE[4:6]), model="de-en")
    assert browser.find_element(By.ID, "translation").text
    path = Path(os.environ.get("EXPLORER_SCREENSHOT") or tmp_path / "explorer.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    print(f"explorer screenshot: {path}")


def test_overload_is_shown_in_plain_words_with_the_retry_time(browser, service_url):
    """A 503 is hard to provoke on demand: the page's fetch answers it as the gateway would."""
    open_page(browser, service_url)
    browser.execute_script(
        "window.fetch = async () => new Response(JSON.stringify({error: {type: 'overloaded', "
        "message: 'model de-en: queue full', field: null}}), {status: 503, headers: {'Retry-After': '2'}});")
    translate_typed(browser, ONE)
    err = browser.find_element(By.ID, "error").text
    assert "overloaded" in err and "try again in 2 s" in err and "{" not in err
