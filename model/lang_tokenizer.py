"""Tokenizers of the multilingual encoder-decoder families (NLLB-200, M2M100, mBART-50), read from
their published files with a well-kept library: ``tokenizers`` where the model ships a
``tokenizer.json`` (NLLB-200, mBART-50), else SentencePiece and ``vocab.json`` (M2M100's
``sentencepiece.bpe.model``: pieces by SentencePiece, ids by vocab.json, as transformers'
``M2M100Tokenizer``), or SentencePiece alone with fairseq's id offset (an mBART-50 directory without
tokenizer.json, as transformers builds it). No piece table is copied here.

The families' rules, all one shape: a source is ``[src_lang] pieces </s>`` (NLLB's legacy
tokenizers: ``pieces </s> [src_lang]``); the decoder starts at ``</s>`` (``decoder_start_token_id``)
and the target-language token is forced as its first token. Language codes are the families'
(``deu_Latn``, ``__de__``, ``de_DE``) mapped to the service's (``service_code``): ISO 639-1 where one
exists, the family's full code otherwise (``zho_Hant``, ``ace_Arab``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

import langcodes

from .tokenizer import clean_up_tokenization

__all__ = ["LangTokenizer", "checkpoint_tokenizer", "service_codes"]


def _language_part(family_code: str) -> tuple[str, Optional[str]]:
    """(language, script or None) of ``deu_Latn``, ``__de__`` or ``de_DE``."""
    code = family_code.strip("_")
    lang, _, rest = code.partition("_")
    return lang, (rest if len(rest) == 4 and rest.istitle() else None)


def service_codes(family_codes: Sequence[str]) -> dict[str, str]:
    """family code -> the service's code: the ISO 639-1 code of its language (macrolanguages
    included: ``arb_Arab`` -> ``ar``) where one exists and no other code of the model claims it with
    the language's usual script (``zho_Hans`` -> ``zh``, ``zho_Hant`` stays ``zho_Hant``), else the
    family code without M2M100's underscores (``ast``, ``ace_Arab``)."""
    short: dict[str, str] = {}
    for code in family_codes:
        lang, _ = _language_part(code)
        tag = langcodes.standardize_tag(lang)
        if len(tag) != 2:
            tag = langcodes.standardize_tag(lang, macro=True)
        short[code] = tag if len(tag) == 2 else ""
    claims: dict[str, list[str]] = {}
    for code, tag in short.items():
        if tag:
            claims.setdefault(tag, []).append(code)
    out = {code: code.strip("_") for code in family_codes}
    for tag, codes in claims.items():
        usual = langcodes.get(tag).maximize().script
        best = [c for c in codes if _language_part(c)[1] in (None, usual)]
        if len(codes) == 1 or len(best) == 1:
            out[(codes if len(codes) == 1 else best)[0]] = tag
    return out


def fairseq_vocab(sp) -> dict[str, int]:
    """fairseq's ids of a SentencePiece model's pieces: ``<s> <pad> </s> <unk>`` 0..3, then piece i
    (i >= 3, after SentencePiece's own ``<unk> <s> </s>``) at i + 1 (the models' ``fairseq_offset``)."""
    return {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3} | {sp.id_to_piece(i): i + 1 for i in range(3, sp.get_piece_size())}


class LangTokenizer:
    """One family's tokenizer: ``encode`` (pieces, no specials), ``source_ids`` (the family's
    source template), ``forced_token`` (a target language's first token), ``decode``
    (transformers' ``batch_decode(skip_special_tokens=True)`` text), ``pieces``.

    Args:
        directory: holds ``tokenizer.json``, or ``sentencepiece.bpe.model`` + ``vocab.json``, or
            (``fairseq_offset``) ``sentencepiece.bpe.model`` alone.
        languages: family code -> token id of every language of the model.
        specials: ids of ``pad``, ``unk``, ``eos`` and ``bos`` (the decoder start).
        special_ids: every id ``decode`` drops (transformers' special tokens).
        legacy: NLLB's legacy template (``pieces </s> [src_lang]``).
        clean_up_spaces: tokenizer_config.json's ``clean_up_tokenization_spaces`` (transformers
            skips it for a BPE tokenizer.json, and so does this).
        fairseq_offset: no tokenizer.json or vocab.json: ids are fairseq's (``fairseq_vocab``), as
            transformers builds mBART-50's tokenizer from its SentencePiece model.
    Raises ValueError when a file cannot be read.
    """

    def __init__(self, directory: str | Path, languages: dict[str, int], specials: dict[str, int],
                 special_ids: Iterable[int] = (), legacy: bool = False, clean_up_spaces: bool = False,
                 fairseq_offset: bool = False):
        d = Path(directory)
        self.family_ids = dict(languages)
        self.codes = service_codes(list(languages))                       # family -> service
        self.lang_ids = {self.codes[c]: i for c, i in languages.items()}  # service -> token id
        self.pad_id, self.unk_id, self.eos_id, self.bos_id = (specials[k] for k in ("pad", "unk", "eos", "bos"))
        self.special = set(special_ids) | {self.pad_id, self.unk_id, self.eos_id, self.bos_id} | set(languages.values())
        self.target_languages = self.source_languages = tuple(sorted(self.lang_ids))
        self.legacy = legacy
        self.fast = (d / "tokenizer.json").exists() and not fairseq_offset
        if self.fast:
            from tokenizers import Tokenizer as HFTokenizer
            self.tk = HFTokenizer.from_file(str(d / "tokenizer.json"))
            self.size = self.tk.get_vocab_size(with_added_tokens=True)
            bpe = json.loads(self.tk.to_str()).get("model", {}).get("type") == "BPE"
            self.clean_up_spaces = clean_up_spaces and not bpe
        else:
            import sentencepiece as spm
            self.sp = spm.SentencePieceProcessor(model_file=str(d / "sentencepiece.bpe.model"))
            self.vocab = (fairseq_vocab(self.sp) if fairseq_offset
                          else json.loads((d / "vocab.json").read_text(encoding="utf-8")))
            self.id_to_piece = {i: p for p, i in self.vocab.items()} | {i: c for c, i in languages.items()}
            self.special_pieces = {self.id_to_piece[i] for i in self.special if i in self.id_to_piece}
            self.size = len(self.vocab) + len(languages)
            self.clean_up_spaces = clean_up_spaces

    @property
    def vocab_size(self) -> int:
        """Entries of the tokenizer (the model's output layer may have a few more rows)."""
        return self.size

    def encode(self, text: str) -> list[int]:
        """Piece ids of text, no language token or EOS."""
        if self.fast:
            return self.tk.encode(text, add_special_tokens=False).ids
        return [self.vocab.get(p, self.unk_id) for p in self.sp.encode(text, out_type=str)]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def resolve(self, code: Optional[str]) -> Optional[str]:
        """The service code of ``code``, a service code or the family's own (``deu_Latn``, ``__de__``,
        ``de``, ``de_DE``); other values unchanged."""
        if code in self.lang_ids:
            return code
        return self.codes.get(code, self.codes.get(f"__{code}__", code))

    def check_language(self, code: Optional[str], field: str) -> int:
        """The token id of ``code`` (see ``resolve``); ValueError naming ``field`` and the model's languages."""
        code = self.resolve(code)
        if code not in self.lang_ids:
            raise ValueError(f"{field}: {'no language given' if code is None else f'unknown language {code!r}'}; "
                             f"the model knows {', '.join(self.target_languages)}")
        return self.lang_ids[code]

    def source_ids(self, text: str, source_lang: Optional[str], max_len: int) -> list[int]:
        """The family's source ids of text: ``[src_lang] pieces </s>`` (legacy: ``pieces </s>
        [src_lang]``), the pieces truncated to max_len ids in all. Raises ValueError for a language
        the model lacks."""
        lang = self.check_language(source_lang, "source language")
        ids = self.encode(text)[: max(max_len - 2, 0)]
        return ids + [self.eos_id, lang] if self.legacy else [lang] + ids + [self.eos_id]

    def forced_token(self, target_lang: Optional[str]) -> int:
        """The decoder's forced first token for a target language (transformers' ``forced_bos_token_id``)."""
        return self.check_language(target_lang, "target language")

    def decode(self, ids: Iterable[int]) -> str:
        """Text of target ids as ``batch_decode(skip_special_tokens=True)``: special ids dropped (the
        language tokens too); tokenizer.json's decoder, or pieces joined by SentencePiece between
        special-token strings (an id without a piece reads ``<unk>``), then stripped."""
        ids = [int(i) for i in ids if int(i) not in self.special]
        if self.fast:
            text = self.tk.decode([i for i in ids if i < self.size], skip_special_tokens=True)
        else:
            text, run = "", []
            for piece in (self.id_to_piece.get(i, "<unk>") for i in ids):
                if piece in self.special_pieces or piece == "<unk>":
                    text += self.sp.decode(run) + piece
                    run = []
                else:
                    run.append(piece)
            text = (text + self.sp.decode(run)).strip()
        return clean_up_tokenization(text) if self.clean_up_spaces else text

    def pieces(self, ids: Iterable[int]) -> list[str]:
        if self.fast:
            return [self.tk.id_to_token(int(i)) or "<unk>" for i in ids]
        return [self.id_to_piece.get(int(i), "<unk>") for i in ids]


def checkpoint_tokenizer(d: Path, cfg, meta: dict) -> LangTokenizer:
    """The tokenizer of one of our checkpoints imported by ``interop.multilingual.convert_multilingual``
    (its metadata's ``multilingual`` record; ``cfg`` its ModelConfig). Raises FileNotFoundError for a
    missing file."""
    rec = meta["multilingual"]
    for name in rec["tokenizer"]:
        if not (d / name).exists():
            raise FileNotFoundError(f"checkpoint {d} has no {name}")
    languages = {family: rec["forced_bos"][service] for family, service in rec["languages"].items()}
    specials = {"pad": cfg.pad_id, "unk": cfg.unk_id, "eos": cfg.eos_id, "bos": cfg.bos_id}
    tok = LangTokenizer(d, languages, specials, rec["special_ids"], rec["legacy_source"],
                        fairseq_offset=rec.get("fairseq_offset", False))
    tok.clean_up_spaces = rec["clean_up_tokenization_spaces"]
    return tok
