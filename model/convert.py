"""Convert between this project's checkpoints and published formats.

    python -m model.convert --from-marian DIR --out CHECKPOINT_DIR [--dtype float32]
    python -m model.convert --to-marian CHECKPOINT_DIR --out DIR [--dtype float32]
    python -m model.convert --to-ct2 CHECKPOINT_DIR --out DIR [--quantization int8]

The formats are read and written by ``model/interop/`` (``marian.py``, ``marian_export.py``,
``ct2.py``). A bad directory prints one line naming the file or field and exits with status 2.
"""
from __future__ import annotations

import argparse
import sys

from .interop.ct2 import convert_to_ct2
from .interop.marian import convert_marian
from .interop.marian_export import export_marian


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    way = ap.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-marian", metavar="DIR", help="import a local MarianMT (OPUS-MT) directory")
    way.add_argument("--to-marian", metavar="CHECKPOINT_DIR", help="export our checkpoint as a MarianMT directory")
    way.add_argument("--to-ct2", metavar="DIR", help="convert our checkpoint, or a MarianMT export of one, to "
                     "CTranslate2 (model/interop/ct2.py; needs the ctranslate2 package)")
    ap.add_argument("--out", required=True, metavar="DIR", help="where to write the checkpoint / MarianMT directory")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="stored weight dtype (float32 keeps the weights exactly)")
    ap.add_argument("--quantization", default=None, help="--to-ct2: CTranslate2 weight type (e.g. int8)")
    args = ap.parse_args(argv)
    try:
        if args.to_ct2:
            out = convert_to_ct2(args.to_ct2, args.out, args.quantization)
        elif args.to_marian:
            out = export_marian(args.to_marian, args.out, args.dtype)
        else:
            out = convert_marian(args.from_marian, args.out, args.dtype)
    except (ValueError, FileNotFoundError, ImportError) as e:   # Marian{Import,Export}Error, a missing file/package
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
