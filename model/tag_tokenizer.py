"""The tokenizer of T5-family translation models that name the target language in the source (MADLAD-400:
``<2fr> text``), read from the published ``tokenizer.json`` with the ``tokenizers`` library, as
transformers' ``T5Tokenizer`` reads it. A source is ``<2xx> pieces </s>`` (``model.tokenizer.encode_source``
writes the tag with ``tag_format``, as it writes MarianMT's ``>>xx<<``); the decoder starts at the
configuration's ``decoder_start_token_id`` (pad) and nothing is forced.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from .tokenizer import clean_up_tokenization

__all__ = ["TAG", "TagTokenizer", "checkpoint_tag_tokenizer"]

TAG = re.compile(r"<2([A-Za-z]{2,3}(?:[_-][A-Za-z0-9]+)*)>")    # <2de>, <2zh_Latn>: the language tags


class TagTokenizer:
    """``encode`` (pieces, no specials), ``decode`` (transformers' ``batch_decode(skip_special_tokens=True)``
    text), ``pieces``; ``target_languages``: the codes of the vocabulary's ``<2xx>`` pieces.

    Args:
        directory: holds ``tokenizer.json``.
        specials: ids of ``pad``, ``unk``, ``eos`` and ``bos`` (the decoder start).
        special_ids: every id ``decode`` drops (transformers' special tokens).
        clean_up_spaces: tokenizer_config.json's ``clean_up_tokenization_spaces``.
    Raises ValueError when tokenizer.json cannot be read, OSError when it is missing.
    """

    tag_format = "<2{}>"

    def __init__(self, directory: str | Path, specials: dict[str, int], special_ids: Iterable[int] = (),
                 clean_up_spaces: bool = False):
        from tokenizers import Tokenizer as HFTokenizer
        path = Path(directory) / "tokenizer.json"
        if not path.exists():
            raise OSError(f"{path}: missing")
        try:
            self.tk = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - any unreadable tokenizer.json is one clear error
            raise ValueError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
        self.size = self.tk.get_vocab_size(with_added_tokens=True)
        self.pad_id, self.unk_id, self.eos_id, self.bos_id = (specials[k] for k in ("pad", "unk", "eos", "bos"))
        self.special = set(special_ids) | {self.pad_id, self.unk_id, self.eos_id, self.bos_id}
        vocab = self.tk.get_vocab(with_added_tokens=True)
        self.tags = {m.group(1): i for p, i in vocab.items() if (m := TAG.fullmatch(p))}   # code -> id
        self.target_languages = self.source_languages = tuple(sorted(self.tags))
        self.clean_up_spaces = clean_up_spaces

    @property
    def vocab_size(self) -> int:
        """Entries of the tokenizer (the model's output layer may have a few more rows)."""
        return self.size

    def encode(self, text: str) -> list[int]:
        """Piece ids of text, no EOS."""
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of target ids as ``batch_decode(skip_special_tokens=True)``: special ids dropped."""
        ids = [int(i) for i in ids if int(i) not in self.special and int(i) < self.size]
        text = self.tk.decode(ids, skip_special_tokens=True)
        return clean_up_tokenization(text) if self.clean_up_spaces else text

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return [self.tk.id_to_token(int(i)) or "<unk>" for i in ids]


def checkpoint_tag_tokenizer(d: Path, cfg, meta: dict) -> TagTokenizer:
    """The tokenizer of one of our checkpoints written by ``interop.t5.convert_t5`` (its metadata's
    ``t5`` record; ``cfg`` its ModelConfig). Raises FileNotFoundError for a missing tokenizer.json."""
    if not (d / "tokenizer.json").exists():
        raise FileNotFoundError(f"checkpoint {d} has no tokenizer.json")
    specials = {"pad": cfg.pad_id, "unk": cfg.unk_id, "eos": cfg.eos_id, "bos": cfg.bos_id}
    rec = meta["t5"]
    return TagTokenizer(d, specials, rec["special_ids"], rec["clean_up_tokenization_spaces"])
