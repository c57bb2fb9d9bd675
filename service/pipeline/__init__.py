"""The request pipeline, free of HTTP and Ray: what every API (native, LibreTranslate, DeepL,
documents) does between parsing its wire format and writing its answer.

    languages.py   LanguageGraph: the served models and pivot routes; the one model resolution
    autodetect.py  source "auto": each text's language detected and routed to the model that reads it
    pivot.py       a pair no model serves, translated through a third language in two legs
    markup.py      HTML/XML text: the segments to translate and the markup rebuilt around them
    markup_parse.py  reading the markup: parts, what is not translated, where sentences end
    placement.py   where markup's elements go in a translation
    texts.py       Texts: a request's texts as the units its models translate (whole, or markup's segments)
    pipeline.py    Pipeline: deadlines, glossaries, limits, running jobs (direct or pivot legs) by model, merging
"""
from .languages import LanguageGraph
from .pipeline import Backend, Pipeline

__all__ = ["Backend", "LanguageGraph", "Pipeline"]
