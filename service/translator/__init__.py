"""One model behind its engine: the translator a Ray Serve replica (or the ingress itself) runs.

    card.py        ModelCard: what the gateway knows of a model without loading it
    config.py      TranslatorSettings: the text pipeline's settings (TextConfig: spans, casing, the
                   stored keep list), the memory's file and the result cache
    translator.py  Translator: model + tokenizer + Engine; prepare, translate, stream

Its text pipeline, one module per stage:

    text.py        split: texts into sentences (Split, Piece), cutting the over-long ones; rejoining
    spans.py       protect: finding protected spans (SpanFinder, Terms)
    protect.py     protect: spans out, placeholders in (Protected, Protector)
    truecase.py    case: recasing for the model and the translation's style (Truecaser)
    memory.py      memory: the translation memory (MemoryStore.recall) and the result cache
    fuzzy.py       memory: fuzzy matches at a job's memory_threshold (FuzzyIndex, rapidfuzz)
    sources.py     protect -> case -> encode of one job's sentences, each once
    glossary.py    engine: a glossary's terms as decoding constraints
    placement.py   place spans: where each span goes in the translation (attention, align.py)
    assemble.py    assemble: a sentence's text from its tokens, case style and spans
    output.py      assemble: the TranslateResponse, alternatives, block-diagonal attention
    streaming.py   StreamState: sentence token ids -> in-order text deltas; merge_streams
"""
from .card import ModelCard, model_card
from .config import TextConfig, TranslatorSettings
from .translator import Translator, TranslatorInfo

__all__ = ["ModelCard", "model_card", "TextConfig", "Translator", "TranslatorInfo", "TranslatorSettings"]
