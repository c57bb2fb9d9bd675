"""Train a Transformer on a parallel corpus (Vaswani et al., 2017, section 5).

    python -m model.train --data-dir ../shared/data/multi30k --src-lang de --tgt-lang en \
        --out runs/de-en --preset small --epochs 20

Adam (β1 0.9, β2 0.98, ε 1e-9) with linear warmup then inverse-square-root decay (section 5.3),
label smoothing (section 5.4), batches sized by tokens and bucketed by length (section 5.1).
Each epoch ends with validation loss and greedy BLEU, a resumable state (``last.pt``) and the
epoch's weights (``epochs/epoch_NNN.safetensors``) for checkpoint averaging. ``--resume``
continues from ``last.pt``. Train on train, choose on val; never on a test set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .checkpoint import save_checkpoint, save_weights
from .config import ModelConfig
from .inference.generate import pad_batch, translate_lines
from .tokenizer import Tokenizer, read_lines
from .transformer import Transformer


def inverse_sqrt_lr(step: int, peak_lr: float, warmup: int) -> float:
    """lr = peak · min(step / warmup, sqrt(warmup / step)); the paper's schedule (eq. 3) with
    d_model^-0.5 · warmup^-0.5 folded into peak_lr."""
    step = max(step, 1)
    return peak_lr * min(step / warmup, math.sqrt(warmup / step))


def token_batches(src_lens: list[int], tgt_lens: list[int], max_tokens: int, rng: random.Random) -> list[list[int]]:
    """Group example indices into batches whose padded size max(src, tgt) × n stays <= max_tokens.

    Examples are sorted by length (ties broken at random) so each batch holds similar lengths;
    the batch order is shuffled.
    """
    order = sorted(range(len(src_lens)), key=lambda i: (src_lens[i], tgt_lens[i], rng.random()))
    batches, cur, cur_max = [], [], 0
    for i in order:
        m = max(src_lens[i], tgt_lens[i])
        if cur and max(cur_max, m) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, m)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def load_pairs(tok: Tokenizer, src_file: str, tgt_file: str, max_len: int) -> tuple[list, list]:
    """Encoded (source + EOS, BOS + target + EOS) pairs; pairs longer than max_len are dropped."""
    src_lines, tgt_lines = read_lines(src_file), read_lines(tgt_file)
    if len(src_lines) != len(tgt_lines):
        raise ValueError(f"{src_file} has {len(src_lines)} lines but {tgt_file} has {len(tgt_lines)}")
    srcs, tgts = [], []
    for s, t in zip(tok.encode_batch(src_lines), tok.encode_batch(tgt_lines)):
        if 0 < len(s) < max_len and 0 < len(t) < max_len - 1:
            srcs.append(s + [tok.eos_id])
            tgts.append([tok.bos_id] + t + [tok.eos_id])
    return srcs, tgts


def batch_loss(model: Transformer, src: torch.Tensor, tgt: torch.Tensor, label_smoothing: float
               ) -> tuple[torch.Tensor, int, float]:
    """(summed label-smoothed loss, target tokens, summed NLL) for one padded batch."""
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    logits = model(src, tgt_in)
    pad = model.cfg.pad_id
    log_probs = torch.log_softmax(logits.float(), dim=-1).reshape(-1, logits.size(-1))  # [B*T, V]
    target = tgt_out.reshape(-1)
    keep = target != pad
    nll = -log_probs.gather(1, target[:, None])[:, 0].masked_fill(~keep, 0.0).sum()
    # Label smoothing (section 5.4): mix the one-hot target with a uniform distribution, as
    # torch.nn.functional.cross_entropy(label_smoothing=...) does.
    smooth = -log_probs.mean(dim=-1).masked_fill(~keep, 0.0).sum()
    loss = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    return loss, int(keep.sum()), float(nll.detach())


@torch.no_grad()
def validate(model, tok, srcs, tgts, refs, max_tokens, beam_size=1) -> dict:
    """Teacher-forced validation loss / perplexity and greedy BLEU / chrF on raw references."""
    import sacrebleu
    model.eval()
    total_nll, total_tok = 0.0, 0
    rng = random.Random(0)
    for idx in token_batches([len(s) for s in srcs], [len(t) for t in tgts], max_tokens, rng):
        src = pad_batch([srcs[i] for i in idx], tok.pad_id)
        tgt = pad_batch([tgts[i] for i in idx], tok.pad_id)
        _, n, nll = batch_loss(model, src, tgt, 0.0)
        total_nll += nll
        total_tok += n
    out = {"val_loss": total_nll / total_tok, "val_ppl": math.exp(total_nll / total_tok)}
    if refs is not None:
        hyps = translate_lines(model, tok, refs[0], beam_size=beam_size)
        out["val_bleu"] = sacrebleu.corpus_bleu(hyps, [refs[1]]).score
        out["val_chrf"] = sacrebleu.corpus_chrf(hyps, [refs[1]]).score
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="../shared/data/multi30k", help="holds {train,val}.{lang}.gz")
    ap.add_argument("--src-lang", default="de")
    ap.add_argument("--tgt-lang", default="en")
    ap.add_argument("--out", default="runs/de-en", help="run directory (logs, states, exported checkpoint)")
    ap.add_argument("--preset", default="small", help="ModelConfig preset")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--dropout", type=float, default=None, help="override the preset's dropout")
    ap.add_argument("--attention-dropout", type=float, default=None)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=3000, help="padded tokens per batch, max(src, tgt) × n")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate after warmup")
    ap.add_argument("--warmup", type=int, default=1000, help="warmup steps")
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--clip-norm", type=float, default=0.0, help="gradient clipping (0 = off, as in the paper)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    ap.add_argument("--val-bleu-every", type=int, default=1, help="epochs between validation BLEU runs")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/last.pt")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many updates (0 = no limit)")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    (out / "epochs").mkdir(parents=True, exist_ok=True)
    data = Path(args.data_dir)
    f = lambda split, lang: str(data / f"{split}.{lang}.gz")  # noqa: E731
    log = open(out / "log.jsonl", "a")

    spm_prefix = out / "spm"
    if not Path(f"{spm_prefix}.model").exists():
        print(f"training SentencePiece ({args.vocab_size} pieces) on train.{args.src_lang}+{args.tgt_lang}", file=sys.stderr)
        Tokenizer.train(read_lines(f("train", args.src_lang)) + read_lines(f("train", args.tgt_lang)), spm_prefix,
                        args.vocab_size)
    tok = Tokenizer(f"{spm_prefix}.model")

    overrides = {"vocab_size": tok.vocab_size}
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    if args.attention_dropout is not None:
        overrides["attention_dropout"] = args.attention_dropout
    cfg = ModelConfig.from_name(args.preset, **overrides)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model = Transformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    step, epoch = 0, 0
    if args.resume and (out / "last.pt").exists():
        state = torch.load(out / "last.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, epoch = state["step"], state["epoch"]
        torch.set_rng_state(state["torch_rng"])
        print(f"resumed at epoch {epoch}, step {step}", file=sys.stderr)

    train_src, train_tgt = load_pairs(tok, f("train", args.src_lang), f("train", args.tgt_lang), cfg.max_len)
    val_src, val_tgt = load_pairs(tok, f("val", args.src_lang), f("val", args.tgt_lang), cfg.max_len)
    val_refs = (read_lines(f("val", args.src_lang)), read_lines(f("val", args.tgt_lang)))
    print(f"{len(train_src)} training pairs, {model.num_parameters() / 1e6:.1f}M parameters, config {cfg}", file=sys.stderr)
    command = "python -m model.train " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    src_lens, tgt_lens = [len(s) for s in train_src], [len(t) - 1 for t in train_tgt]
    while epoch < args.epochs:
        rng = random.Random(args.seed * 1000 + epoch)
        batches = token_batches(src_lens, tgt_lens, args.max_tokens, rng)
        model.train()
        t0, tokens_seen, loss_ema = time.time(), 0, None
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", file=sys.stderr, mininterval=2.0)
        for idx in bar:
            src = pad_batch([train_src[i] for i in idx], tok.pad_id)
            tgt = pad_batch([train_tgt[i] for i in idx], tok.pad_id)
            step += 1
            lr = inverse_sqrt_lr(step, args.lr, args.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            loss, n, nll = batch_loss(model, src, tgt, args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            (loss / n).backward()
            if args.clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
            opt.step()
            tokens_seen += n
            loss_ema = nll / n if loss_ema is None else 0.95 * loss_ema + 0.05 * nll / n
            bar.set_postfix(loss=f"{loss_ema:.3f}", ppl=f"{math.exp(loss_ema):.1f}",
                            tok_s=f"{tokens_seen / (time.time() - t0):.0f}", lr=f"{lr:.2e}", refresh=False)
            if args.max_steps and step >= args.max_steps:
                break
        epoch += 1
        train_seconds = time.time() - t0
        save_weights(model, out / "epochs" / f"epoch_{epoch:03d}.safetensors")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "epoch": epoch,
                    "torch_rng": torch.get_rng_state()}, out / "last.pt.tmp")
        os.replace(out / "last.pt.tmp", out / "last.pt")
        refs = val_refs if epoch % args.val_bleu_every == 0 or epoch == args.epochs else None
        t1 = time.time()
        metrics = validate(model, tok, val_src, val_tgt, refs, args.max_tokens)
        record = {"epoch": epoch, "step": step, "lr": lr, "train_nll": loss_ema, "train_seconds": round(train_seconds, 1),
                  "val_seconds": round(time.time() - t1, 1), **metrics}
        print(json.dumps(record), file=sys.stderr)
        log.write(json.dumps(record) + "\n")
        log.flush()
        if args.max_steps and step >= args.max_steps:
            break

    meta = {"source_lang": args.src_lang, "target_lang": args.tgt_lang,
            "training_data": f"Multi30k train ({len(train_src)} pairs) from {args.data_dir}",
            "command": command, "epochs": epoch, "steps": step}
    save_checkpoint(out / "final", model, f"{spm_prefix}.model", meta)
    print(f"wrote {out / 'final'}", file=sys.stderr)


if __name__ == "__main__":
    main()
