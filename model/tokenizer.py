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
from typing import Iterable, Sequence

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
