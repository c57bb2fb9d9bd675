"""Translate text with a checkpoint: a library function and ``python -m model.translate``.

    python -m model.translate --checkpoint DIR [--beam-size N] < input.de > output.en

One output line per input line; empty (or whitespace-only) lines stay empty. Input is read and
translated in chunks of 1,024 lines, and each chunk's output is written before the next is read, so
output starts before a long pipe has been read to its end.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from typing import Optional, Sequence

import torch

from .decoding import generate
from .tokenizer import Tokenizer
from .transformer import Transformer


def encode_source(tok: Tokenizer, text: str, max_len: int, target_lang: Optional[str] = None) -> list[int]:
    """Piece ids of text plus EOS, truncated to max_len ids in all. ``target_lang`` (multilingual
    MarianMT models): the source starts with the token ``>>target_lang<<``; see ``check_target_lang``."""
    ids = tok.encode(text if target_lang is None else f">>{target_lang}<< {text}")[: max_len - 1]
    return ids + [tok.eos_id]


def check_target_lang(tok: Tokenizer, target_lang: Optional[str]) -> None:
    """Raise ValueError unless target_lang fits the model: one of ``tok.target_languages`` for a
    multilingual model (required there), None otherwise."""
    langs = tok.target_languages
    if target_lang is None and langs:
        raise ValueError(f"the model is multilingual: name a target language, one of {', '.join(langs)}")
    if target_lang is not None and target_lang not in langs:
        choices = f"one of {', '.join(langs)}" if langs else "none (the model has one target language)"
        raise ValueError(f"unknown target language {target_lang!r}; the model knows {choices}")


def default_max_new_tokens(src_len: int, max_len: int) -> int:
    """A generous target budget for a source of src_len ids: 2·src_len + 10, capped by the model."""
    return min(max_len - 1, 2 * src_len + 10)


def translate_lines(model: Transformer, tok: Tokenizer, lines: Sequence[str], beam_size: int = 1,
                    batch_size: int = 64, length_penalty: float = 1.0, progress=None,
                    max_new_tokens: Optional[int] = None, target_lang: Optional[str] = None) -> list[str]:
    """Translate lines in length-sorted batches; returns one string per line, in order.
    ``max_new_tokens``: one target budget for every line (EOS included), default
    ``default_max_new_tokens`` of each source. ``target_lang``: see ``check_target_lang`` (raises
    ValueError)."""
    cfg = model.cfg
    check_target_lang(tok, target_lang)
    out = [""] * len(lines)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    encoded = {i: encode_source(tok, lines[i], cfg.max_len, target_lang) for i in todo}
    todo.sort(key=lambda i: len(encoded[i]))
    for start in range(0, len(todo), batch_size):
        idx = todo[start: start + batch_size]
        srcs = [encoded[i] for i in idx]
        max_new = [default_max_new_tokens(len(s), cfg.max_len) if max_new_tokens is None else max_new_tokens
                   for s in srcs]
        hyps = generate(model, srcs, beam_size=beam_size, max_new_tokens=max_new, length_penalty=length_penalty)
        for i, h in zip(idx, hyps):
            out[i] = tok.decode(h[0].tokens)
        if progress is not None:
            progress(len(idx))
    return out


def load_for_cli(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """The checks ``model.translate`` and ``model.evaluate`` share (MT_LINEAR_DTYPE, --beam-size),
    then ``load_checkpoint(args.checkpoint)``; errors exit through ``ap.error``.
    Returns (model, tokenizer, metadata)."""
    from .checkpoint import load_checkpoint
    from .linear import default_dtype
    try:
        default_dtype()
    except ValueError as e:
        ap.error(str(e))
    if args.beam_size < 1:
        ap.error("--beam-size must be >= 1")
    try:
        loaded = load_checkpoint(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"--checkpoint {args.checkpoint}: {e}")
    try:
        check_target_lang(loaded[1], args.target_lang)
    except ValueError as e:
        ap.error(f"--target-lang: {e}")
    limit = loaded[0].cfg.max_len - 1
    if args.max_new_tokens is not None and not 1 <= args.max_new_tokens <= limit:
        ap.error(f"--max-new-tokens must be in 1..{limit} (the model's max_len - 1), got {args.max_new_tokens}")
    return loaded


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1."""
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {n}")
    return n


def finite_float(value: str) -> float:
    """argparse type: a finite number."""
    x = float(value)
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
    return x


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The options ``model.translate`` and ``model.evaluate`` share."""
    ap.add_argument("--beam-size", type=int, default=4)
    ap.add_argument("--batch-size", type=positive_int, default=64)
    ap.add_argument("--length-penalty", type=finite_float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="a fixed target budget per sentence, EOS included (default: 2 x source length + 10), "
                         "to compare outputs with other tools at one length")
    ap.add_argument("--target-lang", default=None,
                    help="multilingual MarianMT models: the target language (its >>xx<< token starts each source)")


def main(argv=None) -> None:
    from .checkpoint import DEFAULT_CHECKPOINT
    ap = argparse.ArgumentParser(prog="python -m model.translate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT),
                    help="checkpoint directory, or a MarianMT directory (converted at load)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    model, tok, _ = load_for_cli(ap, args)
    chunk = 1024
    lines = (line.rstrip("\n") for line in sys.stdin)
    while batch := list(itertools.islice(lines, chunk)):
        for line in translate_lines(model, tok, batch, args.beam_size, args.batch_size, args.length_penalty,
                                    max_new_tokens=args.max_new_tokens, target_lang=args.target_lang):
            sys.stdout.write(line + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
