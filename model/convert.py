"""Convert between this project's checkpoints and published formats.

    python -m model.convert --from-marian DIR --out CHECKPOINT_DIR [--dtype float16]
    python -m model.convert --from-transformers DIR --out CHECKPOINT_DIR [--dtype float16]
    python -m model.convert --to-marian CHECKPOINT_DIR --out DIR [--dtype float32]
    python -m model.convert --to-ct2 CHECKPOINT_DIR --out DIR [--quantization int8]

The formats are read and written by ``model/interop/`` (``marian.py``, ``marian_export.py``,
``ct2.py``, ``multilingual.py``). --from-transformers picks the importer by config.json's ``model_type``:
``marian`` (as --from-marian), ``m2m100`` (NLLB-200, M2M100), ``mbart`` (mBART-50) or ``t5`` / ``mt5``
(MADLAD-400, ``interop/t5.py``); another type is refused. A bad directory prints one line naming the file or field and exits with status 2, writing nothing.
--from-marian stores the source's weight dtype unless --dtype says otherwise, applies the model's
``generation_config.json`` (or refuses a setting it does not implement, naming it) and prints a
``note:`` line (stderr) for each way the import may translate differently from transformers: a
float16 / bfloat16 --dtype that rounds float32 weights, a generation setting it cannot reproduce.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from .checkpoint import load_metadata
from .interop.ct2 import convert_to_ct2
from .interop.marian import MarianImportError, convert_marian
from .interop.multilingual import FAMILIES, convert_multilingual, model_type
from .interop.t5 import T5_TYPES, convert_t5
from .interop.marian_export import export_marian


def convert_transformers(directory: str, out: str, dtype: Optional[str]) -> Path:
    """--from-transformers: the importer of config.json's ``model_type``. Raises ValueError naming
    another type (nothing written)."""
    kind = model_type(directory)
    if not (Path(directory) / "config.json").exists():
        raise MarianImportError(f"{Path(directory) / 'config.json'}: missing")
    if kind == "marian":
        return convert_marian(directory, out, dtype)
    if kind in FAMILIES:
        return convert_multilingual(directory, out, dtype)
    if kind in T5_TYPES:
        return convert_t5(directory, out, dtype)
    raise MarianImportError(f"{Path(directory) / 'config.json'}: model_type {kind!r} is not supported (choose from "
                            f"marian, {', '.join(FAMILIES)}, {', '.join(T5_TYPES)})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    way = ap.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-marian", metavar="DIR", help="import a local MarianMT (OPUS-MT) directory")
    way.add_argument("--from-transformers", metavar="DIR", help="import a local transformers directory by its "
                     "config.json model_type: marian (as --from-marian), m2m100 (NLLB-200, M2M100), mbart (mBART-50), "
                     "t5 / mt5 (MADLAD-400)")
    way.add_argument("--to-marian", metavar="CHECKPOINT_DIR", help="export our checkpoint as a MarianMT directory")
    way.add_argument("--to-ct2", metavar="DIR", help="convert our checkpoint, or a MarianMT export of one, to "
                     "CTranslate2 (model/interop/ct2.py; needs the ctranslate2 package)")
    ap.add_argument("--out", required=True, metavar="DIR", help="where to write the checkpoint / MarianMT directory")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                    help="stored weight dtype (default: --from-marian the source weights' own, float32 for the "
                         "published OPUS-MT models; otherwise float32). float16 and bfloat16 halve the file but "
                         "round the weights: translations can differ slightly (near-tied choices flip)")
    ap.add_argument("--quantization", default=None, help="--to-ct2: CTranslate2 weight type (e.g. int8)")
    args = ap.parse_args(argv)
    try:
        if args.to_ct2:
            out = convert_to_ct2(args.to_ct2, args.out, args.quantization)
        elif args.to_marian:
            out = export_marian(args.to_marian, args.out, args.dtype or "float32")
        elif args.from_transformers:
            out = convert_transformers(args.from_transformers, args.out, args.dtype)
        else:
            out = convert_marian(args.from_marian, args.out, args.dtype)
    except (ValueError, FileNotFoundError, ImportError) as e:   # Marian{Import,Export}Error, a missing file/package
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    if args.from_marian or args.from_transformers:
        meta = load_metadata(out)
        print(f"weights stored as {meta['dtype']} (source: {meta['source_dtype']})")
        for note in meta.get("notes", []):
            print(f"note: {note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
