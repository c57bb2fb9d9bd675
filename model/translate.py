"""Translate text with a checkpoint: ``python -m model.translate`` (the library function is
``model.inference.generate.translate_lines``).

    python -m model.translate --checkpoint DIR [--beam-size N] < input.de > output.en
    python -m model.translate --checkpoint NLLB_DIR --source-lang de --target-lang fr [--max-new-tokens N]

One output line per input line; empty (or whitespace-only) lines stay empty. Input is read and
translated in chunks of 1,024 lines, and each chunk's output is written before the next is read, so
output starts before a long pipe has been read to its end.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys

import torch

from .checkpoint import DEFAULT_CHECKPOINT
from .inference.generate import translate_lines
from .inference.linear import default_dtype, linear_dtype
from .load import load_model
from .tokenizer import check_target_lang


def load_for_cli(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """The checks ``model.translate`` and ``model.evaluate`` share (MT_LINEAR_DTYPE, --beam-size),
    then ``load_model(args.checkpoint)``; errors exit through ``ap.error``; an imported model run with
    int8 / bfloat16 linear layers gets a note on stderr (outputs may differ from transformers'). --beam-size and
    --length-penalty left out take the model's generation defaults (metadata ``generation``: an
    imported model's ``num_beams`` / ``length_penalty``), else 4 and 1.
    Returns (model, tokenizer, metadata)."""
    try:
        default_dtype()
    except ValueError as e:
        ap.error(str(e))
    if args.beam_size is not None and args.beam_size < 1:
        ap.error("--beam-size must be >= 1")
    try:
        loaded = load_model(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"--checkpoint {args.checkpoint}: {e}")
    if "imported_from" in loaded[2] and (arithmetic := linear_dtype(loaded[0])) != "float32":
        print(f"note: {arithmetic} linear layers (MT_LINEAR_DTYPE; int8 is the CPU default) round activations: "
              f"translations can differ slightly from the imported model's in transformers (near-tied choices "
              f"flip); MT_LINEAR_DTYPE=float32 gives its outputs", file=sys.stderr)
    generation = loaded[2].get("generation", {})      # an imported model's generation config
    if args.beam_size is None:
        args.beam_size = generation.get("num_beams", 4)
    if args.length_penalty is None:
        args.length_penalty = generation.get("length_penalty", 1.0)
    tok = loaded[1]
    if hasattr(tok, "forced_token"):          # NLLB-200, M2M100, mBART-50: both languages named
        args.target_lang = tok.resolve(args.target_lang or loaded[2].get("default_target_lang"))
        args.source_lang = tok.resolve(getattr(args, "source_lang", None))
        if getattr(args, "source_lang", None) not in tok.source_languages:
            ap.error(f"--source-lang: {'required' if getattr(args, 'source_lang', None) is None else 'unknown'} "
                     f"for this multilingual model; choose from {', '.join(tok.source_languages)}")
    try:
        check_target_lang(tok, args.target_lang)
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
    ap.add_argument("--beam-size", type=int, default=None,
                    help="1 = greedy (default: an imported model's num_beams, else 4)")
    ap.add_argument("--batch-size", type=positive_int, default=64)
    ap.add_argument("--length-penalty", type=finite_float, default=None,
                    help="score = log-prob / length ** this (default: an imported model's length_penalty, else 1)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="a fixed target budget per sentence, EOS included (default: 2 x source length + 10), "
                         "to compare outputs with other tools at one length, as transformers' max_new_tokens: a "
                         "model that forces EOS at the limit (OPUS-MT) gives at most N - 1 tokens, then EOS")
    ap.add_argument("--target-lang", default=None,
                    help="multilingual models: the target language (MarianMT: its >>xx<< token starts each source; "
                         "NLLB-200, M2M100, mBART-50: its token is forced first), as the service names it (de, zho_Hant) "
                         "or as the family does (deu_Latn, de_DE)")
    ap.add_argument("--source-lang", default=None,
                    help="NLLB-200, M2M100, mBART-50: the source language (its token starts each source)")


def main(argv=None) -> None:
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
                                    max_new_tokens=args.max_new_tokens, target_lang=args.target_lang,
                                    source_lang=args.source_lang):
            sys.stdout.write(line + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
