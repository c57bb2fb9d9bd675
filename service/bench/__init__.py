"""Benchmarks of the engine and of the service's layout (figures, not tests).

    engine.py     python -m service.bench_engine: parts (a)-(d) on the shipped model, profiles, tables
    protocol.py   part (e): the shared benchmark protocol on random weights, process x thread layouts
    langid.py     python -m service.bench.langid: language identification libraries on Multi30k val
    same_weights.py  part (f): the shipped model exported, in the engine, transformers and CTranslate2
    ingress.py    python -m service.bench.ingress: a separate ingress against the translator as ingress
    fuzzy_memory.py  python -m service.bench.fuzzy_memory: fuzzy translation-memory lookups at 10k/100k segments
"""
