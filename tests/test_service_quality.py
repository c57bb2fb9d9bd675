"""The shipped model through the running service: 20 test_2016_flickr sentences come back as
sensible English."""
from __future__ import annotations

import httpx
import pytest
import sacrebleu

from conftest import DATA
from model.tokenizer import read_lines

# BLEU of these 20 sentences through the service (beam 4) is 41.3 with the shipped checkpoint
# (mean of epochs 12-16; 38.2 with the interim mean of epochs 7-8); a random model scores about 0.
# The floor leaves room for the variance of 20 sentences between checkpoints.
BLEU_FLOOR = 33.0


pytestmark = pytest.mark.slow      # the shipped model through the shared Ray Serve app (service_url)


def test_twenty_test_sentences_become_sensible_english(service_url, service_info):
    if not service_info.shipped:
        pytest.skip("the shipped model model/checkpoints/de-en is not in this checkout")
    src = read_lines(DATA / "test_2016_flickr.de.gz")[:20]
    ref = read_lines(DATA / "test_2016_flickr.en.gz")[:20]
    r = httpx.post(service_url + "/v1/translate", json={"text": src, "beam_size": 4}, timeout=300)
    assert r.status_code == 200
    hyps = [t["text"] for t in r.json()["translations"]]
    assert len(hyps) == 20 and all(h.strip() for h in hyps)
    bleu = sacrebleu.corpus_bleu(hyps, [ref]).score
    assert bleu >= BLEU_FLOOR, (bleu, hyps[:5])
