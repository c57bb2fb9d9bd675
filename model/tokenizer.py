"""SentencePiece tokenizer shared by source and target (joint vocabulary, section 5.1).

Unknown characters: the model is trained with ``byte_fallback``, so a character that is not in the
vocabulary (an emoji, a CJK ideograph, ...) is encoded as its UTF-8 bytes (pieces ``<0xF0>`` ...)
and decodes back to itself; nothing maps to ``<unk>``. Input is NFKC-normalised and runs of
whitespace are collapsed (SentencePiece's ``nmt_nfkc`` rule), so ``decode(encode(s))`` equals the
NFKC form of ``s`` with single spaces and no leading/trailing whitespace.
"""
from __future__ import annotations

import gzip
import os
import tempfile
from typing import Iterable, Optional, Sequence

import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


def read_lines(path: str | os.PathLike) -> list[str]:
    """Lines of a UTF-8 text file, plain or gzipped (by the .gz suffix), without newlines."""
    path = str(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", newline="\n") as f:
        return [line.rstrip("\n").rstrip("\r") for line in f]


class Tokenizer:
    """A thin wrapper around a SentencePiece model with pad=0, unk=1, bos=2, eos=3."""

    def __init__(self, model_file: str | os.PathLike):
        self.model_file = str(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=self.model_file)
        if (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()) != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise ValueError(f"{model_file}: expected pad/unk/bos/eos ids 0/1/2/3")

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
    target_languages: tuple = ()            # one target language: no target-language token

    def encode(self, text: str) -> list[int]:
        """Piece ids of text, without BOS/EOS."""
        return self.sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids; pad/bos/eos are dropped."""
        return self.sp.decode([i for i in ids if i > EOS_ID])

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return [self.sp.id_to_piece(int(i)) for i in ids]

    @staticmethod
    def train(texts: Iterable[str], model_prefix: str | os.PathLike, vocab_size: int = 8000,
              model_type: str = "unigram", character_coverage: float = 1.0, seed_sentences: int = 1_000_000) -> "Tokenizer":
        """Train a joint SentencePiece model on texts (e.g. source and target training sides)."""
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as tmp:
            for t in texts:
                tmp.write(t.replace("\n", " ") + "\n")
        try:
            spm.SentencePieceTrainer.train(
                input=tmp.name, model_prefix=str(model_prefix), vocab_size=vocab_size, model_type=model_type,
                character_coverage=character_coverage, byte_fallback=True,
                pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                input_sentence_size=seed_sentences, shuffle_input_sentence=True,
                num_threads=os.cpu_count() or 1, minloglevel=2,
            )
        finally:
            os.unlink(tmp.name)
        return Tokenizer(f"{model_prefix}.model")


def target_language_codes(vocab) -> tuple[str, ...]:
    """The codes ``xx`` of the target-language tokens ``>>xx<<`` of a multilingual MarianMT vocabulary
    (pieces; sorted), () for a model with one target language."""
    return tuple(sorted(p[2:-2] for p in vocab if p.startswith(">>") and p.endswith("<<") and len(p) > 4))


class VocabTokenizer:
    """MarianMT's tokenization: SentencePiece models for the source and the target, whose pieces are
    mapped to model ids through ``vocab.json`` (piece -> id; the ids of ``</s>``, ``<unk>`` and
    ``<pad>`` come from it, not from the SentencePiece models), as transformers' ``MarianTokenizer``.

    ``encode`` splits with the source model (a leading ``>>xx<<`` target-language code stays one
    piece). Pieces missing from the vocabulary become ``<unk>``. The decoder's first input
    (``bos_id``) is ``decoder_start_id`` (the pad token in MarianMT models).

    ``decode`` gives ``MarianTokenizer.batch_decode(ids, skip_special_tokens=True)``'s text: ids to
    pieces through the target vocabulary (eos, unk, pad and the decoder start dropped), the pieces
    joined by a SentencePiece model's ``decode_pieces`` (the source model's with a shared
    vocabulary, the target model's with separate ones, as transformers 5 chooses), then every ``▁``
    left as a space and the ends stripped: a piece the joining model does not know (a source-only
    piece of a joint vocabulary, e.g. a name copied from the source) comes back raw from
    ``decode_pieces``, ``▁`` included. ``clean_up_spaces`` (``tokenizer_config.json``'s
    ``clean_up_tokenization_spaces``) removes the space before ``. ? ! ,`` and English clitics, as
    transformers' ``clean_up_tokenization``.
    Raises ValueError when a special token is missing from the vocabulary.
    """

    def __init__(self, source_spm: str | os.PathLike, target_spm: str | os.PathLike, vocab: dict[str, int],
                 target_vocab: dict[str, int] | None = None, decoder_start_id: int | None = None,
                 eos: str = "</s>", unk: str = "<unk>", pad: str = "<pad>", clean_up_spaces: bool = False):
        self.model_files = (str(source_spm), str(target_spm))
        self.sp_source = spm.SentencePieceProcessor(model_file=str(source_spm))
        self.sp_target = spm.SentencePieceProcessor(model_file=str(target_spm))
        self.vocab = vocab
        self.target_vocab = vocab if target_vocab is None else target_vocab
        for name, piece in (("eos", eos), ("unk", unk), ("pad", pad)):
            if piece not in self.vocab or piece not in self.target_vocab:
                raise ValueError(f"vocab.json has no {name} token {piece!r}")
        self.eos_id, self.unk_id, self.pad_id = self.target_vocab[eos], self.vocab[unk], self.target_vocab[pad]
        self.bos_id = self.pad_id if decoder_start_id is None else decoder_start_id
        self.id_to_piece = {i: p for p, i in self.target_vocab.items()}
        # multilingual models: the source starts with a target-language token >>xx<<
        self.target_languages = target_language_codes(self.vocab)
        self.special = {self.eos_id, self.target_vocab[unk], self.pad_id, self.bos_id}
        self.sp_decode = self.sp_source if target_vocab is None else self.sp_target
        self.clean_up_spaces = clean_up_spaces

    @property
    def vocab_size(self) -> int:
        """Size of the target vocabulary (the model's output layer)."""
        return len(self.target_vocab)

    def encode(self, text: str) -> list[int]:
        """Source ids of text, without EOS."""
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[: end + 2]], text[end + 2:]
        pieces = code + self.sp_source.encode(text, out_type=str)
        return [self.vocab.get(p, self.unk_id) for p in pieces]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of target ids; eos/unk/pad (and the decoder start) are dropped (see the class docstring)."""
        pieces = [self.id_to_piece[int(i)] for i in ids if int(i) not in self.special]
        text = self.sp_decode.decode_pieces(pieces).replace("\u2581", " ").strip()
        return clean_up_tokenization(text) if self.clean_up_spaces else text

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return [self.id_to_piece.get(int(i), "<unk>") for i in ids]


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before ``. ? ! ,`` and English clitics."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def encode_source(tok: Tokenizer, text: str, max_len: int, target_lang: Optional[str] = None) -> list[int]:
    """Piece ids of text plus EOS, truncated to max_len ids in all. ``target_lang`` (multilingual
    MarianMT models): the source starts with the token ``>>target_lang<<`` (the tokenizer's ``tag_format``:
    MADLAD-400's ``<2target_lang>``); see ``check_target_lang``."""
    tag = getattr(tok, "tag_format", ">>{}<<")
    ids = tok.encode(text if target_lang is None else f"{tag.format(target_lang)} {text}")[: max_len - 1]
    return ids + [tok.eos_id]


def encode_target(tok, text: str) -> list[int]:
    """Target ids of ``text`` (no BOS/EOS), as the decoder would generate it: a ``Tokenizer``'s one
    SentencePiece model; a ``VocabTokenizer``'s target model, pieces mapped through the target
    vocabulary (missing ones become ``<unk>``)."""
    if isinstance(tok, VocabTokenizer):
        unk = tok.target_vocab.get("<unk>", tok.unk_id)
        return [tok.target_vocab.get(p, unk) for p in tok.sp_target.encode(text, out_type=str)]
    return tok.encode(text)


def check_target_lang(tok: Tokenizer, target_lang: Optional[str]) -> None:
    """Raise ValueError unless target_lang fits the model: one of ``tok.target_languages`` for a
    multilingual model (required there), None otherwise (the languages are service codes for
    ``lang_tokenizer.LangTokenizer``)."""
    langs = tok.target_languages
    if target_lang is None and langs:
        raise ValueError(f"the model is multilingual: name a target language, one of {', '.join(langs)}")
    if target_lang is not None and target_lang not in langs:
        choices = f"one of {', '.join(langs)}" if langs else "none (the model has one target language)"
        raise ValueError(f"unknown target language {target_lang!r}; the model knows {choices}")
