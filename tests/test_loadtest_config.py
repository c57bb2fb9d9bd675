"""service/loadtest/config.py: the request mix, the loopback guard and a run's bounds (no service)."""
from __future__ import annotations

import random

import pytest

from conftest import DATA
from service.loadtest import LoadConfig, Mix, RequestMaker, check_url, load_sentences


def test_mix_parse_and_sample():
    mix = Mix.parse("1:3,4:1", "beam_size")
    assert mix.values == (1, 4) and mix.weights == (3.0, 1.0)
    rng = random.Random(1)
    draws = [mix.sample(rng) for _ in range(2000)]
    share = draws.count(1) / len(draws)
    assert set(draws) == {1, 4} and 0.70 < share < 0.80
    for bad in ("0", "1:-1", "a", "2:x", ""):
        with pytest.raises(ValueError):
            Mix.parse(bad)


def test_loopback_only_unless_allowed():
    for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000", "http://127.0.0.2"):
        check_url(url)
    for url in ("http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1", "127.0.0.1:8000"):
        with pytest.raises(ValueError):
            check_url(url)
    check_url("http://example.com", allow_remote=True)   # validation only: nothing is sent
    with pytest.raises(ValueError, match="bound"):
        LoadConfig(concurrency=1).validate()
    with pytest.raises(ValueError, match="exactly one"):
        LoadConfig(concurrency=1, rate=1.0, requests=1).validate()


def test_request_maker_is_reproducible_and_builds_the_body():
    sentences = load_sentences(DATA / "test_2016_flickr.de.gz")
    assert len(sentences) == 1000 and all(s == s.strip() and s for s in sentences)
    cfg = LoadConfig(concurrency=1, requests=1, texts="1:1,3:1", beam_size="1:1,4:1", attention=0.5,
                     max_new_tokens=7, model="de-en")
    make_a, make_b = RequestMaker(cfg, sentences, random.Random(5)), RequestMaker(cfg, sentences, random.Random(5))
    a, b = [make_a() for _ in range(50)], [make_b() for _ in range(50)]
    assert a == b and {len(s.texts) for s in a} == {1, 3} and {s.beam_size for s in a} == {1, 4}
    body = next(s for s in a if len(s.texts) == 3).body(cfg)
    assert isinstance(body["text"], list) and len(body["text"]) == 3
    assert (body["max_new_tokens"], body["model"], body["source_lang"], body["target_lang"]) == (7, "de-en", "de", "en")
    assert isinstance(next(s for s in a if len(s.texts) == 1).body(cfg)["text"], str)


def test_a_run_where_no_request_succeeds_exits_1_naming_the_errors(capsys):
    from service.loadtest.cli import main
    from service.loadtest.serve_app import free_port
    port = free_port()          # nothing listens there
    assert main(["--url", f"http://127.0.0.1:{port}", "-c", "1", "-d", "0.5", "-q"]) == 1
    assert "no request succeeded (errors: {'connection':" in capsys.readouterr().err
