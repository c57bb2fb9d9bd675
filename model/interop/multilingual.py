"""Import of the multilingual encoder-decoder families from a local transformers directory:
``model_type`` ``m2m_100`` (NLLB-200 and M2M100; ``m2m100`` accepted too) and ``mbart`` (mBART-50),
onto the one network's flags (``ModelConfig``):

| family | blocks | positions | embeddings | output |
|---|---|---|---|---|
| m2m100 (NLLB, M2M100) | pre-LN, final LayerNorm per stack | fairseq sinusoid, offset pad_id + 1 | scaled | tied |
| mbart (mBART-50) | pre-LN, final LayerNorm per stack | learned per stack, offset 2 | scaled, ``layernorm_embedding`` | tied + final_logits_bias |

A directory is config.json, model.safetensors or pytorch_model.bin, generation_config.json (else
config.json's generation fields) and the tokenizer (``model/lang_tokenizer.py``): tokenizer.json
(NLLB, mBART-50), sentencepiece.bpe.model + vocab.json (M2M100) or an mBART-50
sentencepiece.bpe.model alone, with tokenizer_config.json. The
generation config is applied as for MarianMT (``marian.generation_rules``); its
``forced_bos_token_id``, a fixed target language, must be a language token and becomes the default
target. Anything else this project cannot reproduce, and any missing or mismatched file, raises
``MultilingualImportError`` naming the file and field.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint import save_checkpoint, unique_state_dict
from ..config import ACTIVATIONS, ModelConfig
from ..lang_tokenizer import LangTokenizer
from ..transformer import Transformer
from .marian import MarianImportError, _read_json, generation_rules, read_generation, read_marian_weights, source_dtype
from .marian_layout import stack_layers

FAMILIES = {"m2m_100": "NLLB-200 / M2M100", "m2m100": "NLLB-200 / M2M100", "mbart": "mBART-50"}   # model_type
TOKENIZERS = {"NllbTokenizer": "nllb", "NllbTokenizerFast": "nllb", "M2M100Tokenizer": "m2m100",
              "MBart50Tokenizer": "mbart50", "MBart50TokenizerFast": "mbart50"}
CODE_PATTERNS = {"nllb": r"[a-z]{3}_[A-Z][a-z]{3}", "m2m100": r"__[a-z]{2,3}__", "mbart50": r"[a-z]{2}_[A-Z]{2}"}
CODE_PATTERNS["mbart50-spm"] = CODE_PATTERNS["mbart50"]    # mBART-50 without tokenizer.json
TOKENIZER_FILES = {"nllb": ("tokenizer.json",), "mbart50": ("tokenizer.json",),
                   "m2m100": ("sentencepiece.bpe.model", "vocab.json"), "mbart50-spm": ("sentencepiece.bpe.model",)}


class MultilingualImportError(MarianImportError):
    """A directory this importer cannot read or reproduce; the message names the file and field."""


def model_type(directory: str | Path) -> Optional[str]:
    """``config.json``'s model_type, or None when there is no readable config."""
    try:
        return json.loads((Path(directory) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def is_multilingual_dir(directory: str | Path) -> bool:
    return model_type(directory) in FAMILIES


def multilingual_config(hf: dict, where: str) -> ModelConfig:
    """Our ModelConfig of a transformers M2M100Config / MBartConfig dict (search rules unset).
    Raises MultilingualImportError naming the field this network cannot reproduce."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        raise MultilingualImportError(f"{where}: model_type {kind!r} is not supported (choose from marian, "
                                      f"{', '.join(FAMILIES)})")

    def field(name):
        if name not in hf:
            raise MultilingualImportError(f"{where}: field {name!r} is missing")
        return hf[name]

    for a, b in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if field(a) != field(b):
            raise MultilingualImportError(f"{where}: {a} ({hf[a]}) != {b} ({hf[b]}) is not supported")
    act = field("activation_function")
    if act not in ACTIVATIONS:
        raise MultilingualImportError(f"{where}: activation_function {act!r} is not supported (choose from "
                                      f"{ACTIVATIONS})")
    unsupported = {"add_bias_logits": True, "normalize_before": False, "add_final_layer_norm": False,
                   "static_position_embeddings": True, "is_encoder_decoder": False}
    for name, bad in unsupported.items():
        if hf.get(name) is bad:
            raise MultilingualImportError(f"{where}: {name}={json.dumps(bad)} is not supported")
    pad, mbart = field("pad_token_id"), kind == "mbart"
    try:
        return ModelConfig(
            vocab_size=field("vocab_size"), d_model=field("d_model"), n_heads=hf["encoder_attention_heads"],
            d_ff=hf["encoder_ffn_dim"], n_encoder_layers=field("encoder_layers"),
            n_decoder_layers=field("decoder_layers"), dropout=float(hf.get("dropout", 0.0)),
            attention_dropout=float(hf.get("attention_dropout", 0.0)), activation=act, norm_first=True,
            positional="learned" if mbart else "sinusoidal", sinusoid_layout="fairseq",
            position_offset=2 if mbart else pad + 1, layernorm_embedding=mbart, share_positions=not mbart,
            scale_embedding=bool(hf.get("scale_embedding", False)), max_len=field("max_position_embeddings"),
            share_embeddings=True, separate_output=hf.get("tie_word_embeddings", True) is False,
            final_logits_bias=mbart, pad_id=pad, eos_id=field("eos_token_id"),
            bos_id=field("decoder_start_token_id"), unk_id=3)
    except (TypeError, ValueError) as e:
        raise MultilingualImportError(f"{where}: {e}") from None


def multilingual_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    """Our unique state dict from a transformers M2M100 / MBart ForConditionalGeneration state dict.
    Raises MultilingualImportError naming a missing tensor."""
    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise MultilingualImportError(f"{where}: tensor {name!r} is missing")
        return hf[name].float()

    shared = next((n for n in ("model.shared.weight", "model.encoder.embed_tokens.weight", "lm_head.weight")
                   if n in hf), "model.shared.weight")
    out = {"src_embed.tok.weight": get(shared)}
    if cfg.separate_output:
        out["out_proj.weight"] = get("lm_head.weight")
    if cfg.final_logits_bias:
        out["logits_bias"] = get("final_logits_bias").reshape(-1) if "final_logits_bias" in hf \
            else torch.zeros(cfg.target_vocab_size)
    stacks = (("encoder", "src_embed", "enc_norm", cfg.n_encoder_layers),
              ("decoder", "tgt_embed", "dec_norm", cfg.n_decoder_layers))
    for kind, embed, norm, n in stacks:
        for p in ("weight", "bias"):
            out[f"{norm}.{p}"] = get(f"model.{kind}.layer_norm.{p}")
            if cfg.layernorm_embedding:
                out[f"{embed}.norm.{p}"] = get(f"model.{kind}.layernorm_embedding.{p}")
        if cfg.positional == "learned":
            out[f"{embed}.pos.weight"] = get(f"model.{kind}.embed_positions.weight")
        out.update(stack_layers(kind, n, get))
    return out


def _tokenizer_files(d: Path, hf: dict) -> tuple[str, dict]:
    """(tokenizer flavour, tokenizer_config.json) of a directory whose tokenizer files are all there."""
    tok_cfg = _read_json(d / "tokenizer_config.json")
    cls = tok_cfg.get("tokenizer_class")
    flavour = TOKENIZERS.get(cls)
    allowed = ("mbart50",) if hf["model_type"] == "mbart" else ("nllb", "m2m100")
    if flavour not in allowed:
        names = [c for c, f in TOKENIZERS.items() if f in allowed]
        raise MultilingualImportError(f"{d / 'tokenizer_config.json'}: tokenizer_class {cls!r} is not supported for "
                                      f"model_type {hf['model_type']!r} (choose from {', '.join(names)})")
    if flavour == "mbart50" and not (d / "tokenizer.json").exists() and (d / "sentencepiece.bpe.model").exists():
        return "mbart50-spm", tok_cfg            # SentencePiece alone, fairseq's ids (lang_tokenizer.fairseq_vocab)
    for name in TOKENIZER_FILES[flavour]:
        if not (d / name).exists():
            raise MultilingualImportError(f"{d / name}: missing (the {cls} tokenizer needs "
                                          f"{', '.join(TOKENIZER_FILES[flavour])})")
    return flavour, tok_cfg


def _languages(d: Path, flavour: str, tok_cfg: dict) -> dict[str, int]:
    """family code -> token id of every language token of the tokenizer files."""
    pattern = re.compile(CODE_PATTERNS[flavour])
    if flavour in ("m2m100", "mbart50-spm"):
        vocab = _read_json(d / "vocab.json") if flavour == "m2m100" else _fairseq(d)
        listed = tok_cfg.get("additional_special_tokens") or tok_cfg.get("extra_special_tokens") or []
        listed = [t.get("content") if isinstance(t, dict) else t for t in listed]
        codes = [t for t in listed if isinstance(t, str) and pattern.fullmatch(t)]
        return {c: len(vocab) + i for i, c in enumerate(codes)}
    from tokenizers import Tokenizer as HFTokenizer
    try:
        tk = HFTokenizer.from_file(str(d / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - any unreadable tokenizer.json is one clear error
        raise MultilingualImportError(f"{d / 'tokenizer.json'}: cannot read ({type(e).__name__}: {e})") from None
    return {t.content: i for i, t in tk.get_added_tokens_decoder().items() if pattern.fullmatch(t.content)}


def _fairseq(d: Path) -> dict[str, int]:
    import sentencepiece as spm
    from ..lang_tokenizer import fairseq_vocab
    try:
        return fairseq_vocab(spm.SentencePieceProcessor(model_file=str(d / "sentencepiece.bpe.model")))
    except (OSError, RuntimeError) as e:
        raise MultilingualImportError(f"{d / 'sentencepiece.bpe.model'}: cannot read ({e})") from None


def load_tokenizer(d: Path, cfg: ModelConfig, flavour: str, tok_cfg: dict, languages: dict[str, int],
                   special_ids: list[int], legacy: bool) -> LangTokenizer:
    clean_up = tok_cfg.get("clean_up_tokenization_spaces") is True
    specials = {"pad": cfg.pad_id, "unk": cfg.unk_id, "eos": cfg.eos_id, "bos": cfg.bos_id}
    try:
        return LangTokenizer(d, languages, specials, special_ids, legacy, clean_up,
                             fairseq_offset=flavour == "mbart50-spm")
    except (OSError, RuntimeError, ValueError) as e:
        raise MultilingualImportError(f"{d}: cannot load the {flavour} tokenizer ({e})") from None


def _special_ids(d: Path, flavour: str, tok_cfg: dict, cfg: ModelConfig) -> list[int]:
    """Ids of the tokenizer's special tokens (``batch_decode(skip_special_tokens=True)`` drops them)."""
    if flavour == "mbart50-spm":                 # specials, languages and <mask> after them
        n = len(_fairseq(d))
        mask = [n + len(_languages(d, flavour, tok_cfg))]
        return [0, 1, 2, 3] + mask
    if flavour == "m2m100":
        vocab = _read_json(d / "vocab.json")
        names = [tok_cfg.get(f"{k}_token", dflt) for k, dflt in (("bos", "<s>"), ("eos", "</s>"), ("unk", "<unk>"),
                                                                  ("pad", "<pad>"), ("sep", "</s>"))]
        names = [n.get("content") if isinstance(n, dict) else n for n in names]
        missing = [n for n in names if n not in vocab]
        if missing:
            raise MultilingualImportError(f"{d / 'vocab.json'}: no special token {missing[0]!r}")
        cfg.unk_id = vocab[names[2]]
        return [vocab[n] for n in names]
    tok = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    if "<unk>" in added:
        cfg.unk_id = added["<unk>"]
    return [t["id"] for t in tok.get("added_tokens", []) if t.get("special")]


def load_multilingual(directory: str | Path) -> tuple[Transformer, LangTokenizer, dict]:
    """(model in float32 eval mode, unpacked; tokenizer; metadata) of an NLLB-200, M2M100 or mBART-50
    directory. Raises MultilingualImportError naming the file and field that is missing,
    inconsistent or not reproducible."""
    d = Path(directory)
    if not d.is_dir():
        raise MultilingualImportError(f"{d}: not a directory")
    hf = _read_json(d / "config.json")
    cfg = multilingual_config(hf, str(d / "config.json"))
    if not (d / "tokenizer_config.json").exists():
        raise MultilingualImportError(f"{d / 'tokenizer_config.json'}: missing (no tokenizer)")
    flavour, tok_cfg = _tokenizer_files(d, hf)
    languages = _languages(d, flavour, tok_cfg)
    if len(languages) < 2:
        raise MultilingualImportError(f"{d / 'tokenizer_config.json'}: {len(languages)} language tokens found "
                                      f"(a multilingual model has two or more)")
    special_ids = _special_ids(d, flavour, tok_cfg, cfg)
    legacy = flavour == "nllb" and tok_cfg.get("legacy_behaviour") is True
    tok = load_tokenizer(d, cfg, flavour, tok_cfg, languages, special_ids, legacy)
    if tok.vocab_size > cfg.vocab_size:
        raise MultilingualImportError(f"{d / 'config.json'}: vocab_size {cfg.vocab_size} is smaller than the "
                                      f"tokenizer's {tok.vocab_size} entries")
    gen, gen_file = read_generation(d, hf)
    forced_bos = gen.pop("forced_bos_token_id", None)
    default_target = None
    if forced_bos is not None:
        by_id = {i: c for c, i in languages.items()}
        if forced_bos not in by_id:
            raise MultilingualImportError(f"{gen_file}: forced_bos_token_id {json.dumps(forced_bos)} is not a "
                                          f"language token of the tokenizer")
        default_target = tok.codes[by_id[forced_bos]]
    rules = generation_rules(gen, gen_file, cfg)
    cfg.forced_eos, cfg.early_stopping = rules["forced_eos"], rules["early_stopping"]
    weights, wname = read_marian_weights(d)
    state = multilingual_state_dict(weights, cfg, str(d / wname))
    if rules["banned"]:
        if "logits_bias" not in state:
            cfg.final_logits_bias = True
            state["logits_bias"] = torch.zeros(cfg.vocab_size)
        state["logits_bias"][rules["banned"]] = float("-inf")
    model = Transformer(cfg)
    with torch.no_grad():
        for name, t in unique_state_dict(model).items():
            if tuple(state[name].shape) != tuple(t.shape):
                raise MultilingualImportError(f"{d / wname}: {name} has shape {tuple(state[name].shape)}, but "
                                              f"config.json implies {tuple(t.shape)}")
            t.copy_(state[name])
    meta = {"imported_from": f"{FAMILIES[hf['model_type']]} directory {d.name}", "dtype": "float32",
            "multilingual": {"family": flavour, "tokenizer": list(TOKENIZER_FILES[flavour]),
                             "languages": tok.codes, "forced_bos": tok.lang_ids, "special_ids": sorted(special_ids),
                             "legacy_source": legacy, "clean_up_tokenization_spaces": tok.clean_up_spaces,
                             "fairseq_offset": flavour == "mbart50-spm"},
            "source_languages": list(tok.source_languages), "target_languages": list(tok.target_languages),
            "generation": rules["defaults"], "notes": rules["notes"] or None, "default_target_lang": default_target,
            "source_dtype": source_dtype(weights)}
    return model.eval(), tok, {k: v for k, v in meta.items() if v is not None}


def convert_multilingual(directory: str | Path, out: str | Path, dtype: Optional[str] = None) -> Path:
    """Write an NLLB-200, M2M100 or mBART-50 directory as our checkpoint: config.json, model.safetensors
    in ``dtype`` (default: the source weights' own), the tokenizer files as published (with
    tokenizer_config.json, for ``multilingual_export``), metadata.json
    (languages, forced first token per target language, generation defaults, notes).
    Raises MultilingualImportError; nothing is written then."""
    from .marian import DTYPE_NOTE, WEIGHT_DTYPES
    model, tok, meta = load_multilingual(directory)
    source = meta["source_dtype"]
    dtype = dtype or source
    notes = list(meta.get("notes", []))
    if WEIGHT_DTYPES[dtype].itemsize < WEIGHT_DTYPES[source].itemsize or {dtype, source} == {"float16", "bfloat16"}:
        notes.append(DTYPE_NOTE.format(dtype=dtype, source=source))
    d = Path(directory)
    extra = [n for n in ("tokenizer_config.json", "special_tokens_map.json") if (d / n).exists()]
    meta = {**meta, "dtype": dtype, "multilingual": {**meta["multilingual"], "tokenizer_config": extra}} | \
        ({"notes": notes} if notes else {})
    files = [d / name for name in meta["multilingual"]["tokenizer"] + extra]
    return save_checkpoint(out, model, files, meta, dtype)
