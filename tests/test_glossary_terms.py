"""Glossary terms only where they belong, as often as their source occurs, before the sentence's
end, on every leg of a pivot (service/translator/glossary.py, model/inference/constraints.py,
service/pipeline/pivot.py): the rules without a model, then real outputs of the shipped de-en and
en-fr models (model/checkpoints/), direct and pivoted de -> en -> fr."""
from __future__ import annotations

import asyncio
import dataclasses
import re

import pytest

from model.checkpoint import SHIPPED_CHECKPOINTS
from model.inference.constraints import ConstrainedBeamSearch, ConstraintState
from service.protocol import GenerationOptions, InvalidRequest, TranslateJob

SHIPPED = all((SHIPPED_CHECKPOINTS[m] / "model.safetensors").exists() for m in ("de-en", "en-fr"))
needs_models = pytest.mark.skipif(not SHIPPED, reason="the shipped de-en and en-fr models are not in this checkout")


def count(term: str, text: str) -> int:
    """Occurrences of ``term`` in ``text`` as whole words, case as written."""
    return len(re.findall(rf"(?<!\w){re.escape(term)}(?!\w)", text))


# ---- the rules, without a model ----------------------------------------------------------------------
def test_a_phrase_listed_twice_needs_two_occurrences_and_one_inside_another_counts():
    twice = ((5,), (5,))
    s = ConstraintState((False, False)).advance(twice, 5)
    assert s.met == (True, False) and not s.all_met() and s.allowed(twice) == [5]
    assert s.advance(twice, 9).advance(twice, 5).all_met()
    nested = ((7, 8), (7,))                    # "two bikes" and "two": "two bikes" holds both
    s = ConstraintState((False, False)).advance(nested, 7)
    assert (s.met, s.current, s.done) == ((False, True), 0, 1)
    assert s.advance(nested, 8).all_met()
    search = ConstrainedBeamSearch(4, 3, 10, constraints=twice)
    assert not search.met([5, 9]) and search.met([5, 9, 5])


@needs_models
def test_matching_skips_protected_spans_and_counts_every_occurrence():
    from model.tokenizer import Tokenizer
    from service.translator.glossary import Glossary, sentence_ends
    from service.translator.protect import Protector
    from service.translator.spans import Terms
    tok = Tokenizer(SHIPPED_CHECKPOINTS["de-en"] / "tokenizer.model")
    g = Glossary([("Hund", "puppy"), ("Łódź", "Lodz")], "de", tok, 100)
    protector = Protector(tok)
    url = protector.prepare("Besuchen Sie https://www.hund.de/hund mit dem Hund.")
    assert [url.source[m.start:m.end] for m in g.find(url.source, url.covered)] == ["Hund"]     # not in the URL
    kept = protector.prepare("Der Hund schläft.", Terms(["Hund"]))
    assert g.terms(kept.source, kept.covered) == ()                   # a do-not-translate term stays one
    assert g.terms("Der Hund bellt und der Hund springt.") == (tuple(tok.encode("puppy")),) * 2
    city = protector.prepare("Ein Hund läuft durch Łódź.")            # "Ł": a letter the model lacks
    assert city.spans == ["Łódź"] and g.put_back(city).spans == ["Lodz"]
    assert g.terms(city.source, city.covered) == (tuple(tok.encode("puppy")),)
    assert tok.pieces(sentence_ends(tok)) == [".", "!", "?"]
    with pytest.raises(InvalidRequest, match="conflicts"):   # inflections of one term: one entry (one stem)
        Glossary([("bicycle", "bike"), ("bicycles", "bikes")], "en", tok, 100)


def test_pivot_legs_keep_each_occurrence_as_written_and_the_last_leg_matches_it():
    from service.pipeline import pivot
    from service.translator import ModelCard
    from model.config import ModelConfig
    cfg = ModelConfig.from_name("tiny", vocab_size=500, max_len=64)
    route = pivot.routes([ModelCard("de-en", "", "de", "en", cfg), ModelCard("en-fr", "", "en", "fr", cfg)])["de", "fr"]
    job = TranslateJob(["Zwei HUNDE und die Verträge."], GenerationOptions(), keep=("ACME",),
                       glossary=(("Hund", "chien"), ("Vertrag", "contrat"), ("Katze", "chat")))
    first, last = pivot.leg_job(job, route, 0), pivot.leg_job(job, route, 1, ["Two HUNDE and the Verträge."])
    assert first.keep == ("ACME", "HUNDE", "Verträge") and first.glossary == ()
    assert last.glossary == job.glossary + (("HUNDE", "chien"), ("Verträge", "contrat")) and last.keep == ("ACME",)
    from service.protocol import MAX_JOB_GLOSSARY_ENTRIES
    more = dataclasses.replace(job, glossary=job.glossary + tuple((f"Wort{i}", "x") for i in range(97)))
    assert pivot.leg_job(more, route, 1, ["x"]).glossary == more.glossary + last.glossary[3:]     # 100 + 2: all
    full = dataclasses.replace(job, glossary=job.glossary + tuple(
        (f"Wort{i}", "x") for i in range(MAX_JOB_GLOSSARY_ENTRIES - len(job.glossary) - 1)))
    assert pivot.leg_job(full, route, 1, ["x"]).glossary == (("HUNDE", "chien"), ("Verträge", "contrat"))  # past it


# ---- real outputs of the shipped models ------------------------------------------------------------------
# (text, glossary, keep): de-en, each decoded with the default beam
DIRECT = {
    "url": ("Besuchen Sie https://www.hund.de/hund heute.", (("Hund", "puppy"),), ()),
    "email": ("Schreiben Sie an hund@example.com noch heute.", (("Hund", "puppy"),), ()),
    "keep": ("Der Hund schläft im Garten.", (("Hund", "puppy"),), ("Hund",)),
    "unreadable": ("Ein Hund läuft durch Łódź.", (("Łódź", "Lodz"),), ()),
    "twice": ("Der Hund bellt und der Hund springt.", (("Hund", "puppy"),), ()),
    "end": ("Eine Frau mit einem Hund.", (("Hund", "puppy"),), ()),
    "nested": ("Zwei Fahrräder stehen vor dem Haus.", (("Fahrräder", "two bikes"), ("zwei", "two")), ()),
    "nested2": ("Ein Rad und zwei Fahrräder.", (("Fahrräder", "two bikes"), ("zwei", "two")), ()),
}
# (text, glossary): de -> en -> fr through the route de-en+en-fr
PIVOT = {
    "inflected": ("Zwei Hunde spielen im Park.", (("Hund", "chiot"),)),
    "twice": ("Ein Hund und ein Hund spielen.", (("Hund", "chiot"),)),
    "unreadable": ("Zwei Männer sitzen auf einer Bank.", (("Mann", "monsieur"),)),
}


@pytest.fixture(scope="module")
def outputs():
    """{("direct" | "pivot", case): (translation, the pivot's English text or None)}."""
    from local_services import local_services
    from service.translator import Translator, model_card
    if not SHIPPED:
        pytest.skip("the shipped de-en and en-fr models are not in this checkout")

    async def main():
        ts = {m: Translator(model_card(m, SHIPPED_CHECKPOINTS[m]), device="cpu") for m in ("de-en", "en-fr")}
        for t in ts.values():
            await t.reconfigure({"max_num_seqs": 16})

        async def run(model, job):
            return await ts[model].translate(job)
        svc = local_services([t.card for t in ts.values()], run)
        out = {}
        for case, (text, glossary, keep) in DIRECT.items():
            r = await ts["de-en"].translate(TranslateJob([text], GenerationOptions(), glossary=glossary, keep=keep))
            out["direct", case] = (r.translations[0].text, None)
        for case, (text, glossary) in PIVOT.items():
            job = TranslateJob([text], GenerationOptions(), glossary=glossary)
            t = (await svc.pipeline.run("de-en+en-fr", svc.pipeline.deadline(job))).translations[0]
            out["pivot", case] = (t.text, t.pivot.text)
        for t in ts.values():
            await t.stop()
        return out
    return asyncio.run(main())


def test_a_term_inside_a_protected_span_is_not_forced_in(outputs):
    url, _ = outputs["direct", "url"]
    assert "https://www.hund.de/hund" in url and count("puppy", url) == 0, url
    email, _ = outputs["direct", "email"]
    assert "hund@example.com" in email and count("puppy", email) == 0, email
    kept, _ = outputs["direct", "keep"]                      # do-not-translate wins over the glossary
    assert count("Hund", kept) == 1 and count("puppy", kept) == 0, kept
    city, _ = outputs["direct", "unreadable"]                # a word the model cannot read: its target, once
    assert count("Lodz", city) == 1 and "Łódź" not in city, city


def test_every_occurrence_is_written_before_the_final_punctuation(outputs):
    for case, n in (("twice", 2), ("end", 1)):
        text, _ = outputs["direct", case]
        assert count("puppy", text) == n, text
        assert re.findall(r"[.!?]", text) == ["."] and text.endswith("."), text     # nothing after the period


def test_a_term_is_not_written_more_often_than_its_source_occurs(outputs):
    for case in ("nested", "nested2"):             # "zwei" once: "two" once, "two bikes" holds it
        text, _ = outputs["direct", case]
        assert count("two bikes", text) == 1 and count("two", text) == 1, text


def test_a_pivot_writes_the_terms_on_the_leg_into_the_target_language(outputs):
    text, english = outputs["pivot", "inflected"]
    assert count("Hunde", english) == 1 and count("chiot", text) == 1 and "Hund" not in text, (english, text)
    text, english = outputs["pivot", "twice"]
    assert count("Hund", english) == 2 and count("chiot", text) == 2, (english, text)
    text, english = outputs["pivot", "unreadable"]           # "ä": a letter the en-fr model lacks
    assert count("Männer", english) == 1 and count("monsieur", text) == 1 and "Männer" not in text, (english, text)
