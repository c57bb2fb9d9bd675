"""One model behind its engine: the translator a Ray Serve replica (or the ingress itself) runs.

    card.py        ModelCard: what the gateway knows of a model without loading it
    translator.py  Translator: model + tokenizer + Engine; prepare, translate, stream
    text.py        splitting texts into sentences (Split, Piece) and rejoining them
    streaming.py   StreamState: sentence token ids -> in-order text deltas; merge_streams
    output.py      building the TranslateResponse: alternatives, block-diagonal attention
"""
from .card import ModelCard, model_card
from .translator import Translator, TranslatorInfo

__all__ = ["ModelCard", "model_card", "Translator", "TranslatorInfo"]
