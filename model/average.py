"""Average the weights of several checkpoints (Vaswani et al., 2017, section 6.1: the base model
averages the last 5 checkpoints) and export a checkpoint directory.

    python -m model.average --run runs/de-en --epochs 14 15 16 17 18 --out model/checkpoints/de-en
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from .checkpoint import load_weights, save_checkpoint
from .config import ModelConfig
from .tokenizer import Tokenizer
from .transformer import Transformer


def average_files(paths: list[str | Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean (in float64, returned as float32) of safetensors files with equal keys."""
    total = None
    for p in paths:
        t = load_file(str(p))
        if total is None:
            total = {k: v.double() for k, v in t.items()}
        else:
            if set(t) != set(total):
                raise KeyError(f"{p} has different tensors")
            for k, v in t.items():
                total[k] += v.double()
    return {k: (v / len(paths)).float() for k, v in total.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="training run directory (holds epochs/ and spm.model)")
    ap.add_argument("--epochs", type=int, nargs="+", required=True, help="epoch numbers to average")
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--config", help="config.json to use (default: the run's final/ or --preset)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--metadata", default="{}", help="extra metadata as a JSON object")
    args = ap.parse_args(argv)
    run = Path(args.run)
    tok = Tokenizer(run / "spm.model")
    if args.config:
        cfg = ModelConfig.from_dict(json.loads(Path(args.config).read_text()))
    else:
        cfg = ModelConfig.from_name(args.preset, vocab_size=tok.vocab_size)
    paths = [run / "epochs" / f"epoch_{e:03d}.safetensors" for e in args.epochs]
    model = Transformer(cfg)
    tmp = run / "average.tmp.safetensors"
    from safetensors.torch import save_file
    save_file(average_files(paths), str(tmp))
    load_weights(model, tmp)
    tmp.unlink()
    meta = {"averaged_epochs": args.epochs, **json.loads(args.metadata)}
    save_checkpoint(args.out, model, run / "spm.model", meta, dtype=args.dtype)
    print(f"wrote {args.out} (mean of {len(paths)} checkpoints)")


if __name__ == "__main__":
    main()
