"""Import of MarianMT directories (OPUS-MT) into this project's model.

A MarianMT directory (as ``transformers``' ``save_pretrained`` writes it, and as the OPUS-MT models
are published) holds ``config.json`` (``model_type: marian``), ``model.safetensors`` or
``pytorch_model.bin`` (read with ``weights_only=True``), ``source.spm``, ``target.spm``,
``vocab.json`` and ``tokenizer_config.json``. The architecture is ours (encoder-decoder, post-LN,
sinusoidal positions); what differs from the paper maps onto ``ModelConfig`` fields: the FFN
activation (``swish``), the sinusoid layout (sines then cosines), ``scale_embedding``,
``final_logits_bias``, the decoder start token (the pad token) and special ids from ``vocab.json``.
A bad directory raises ``MarianImportError`` naming the file or field. Export: ``marian_export.py``
(the parameter layout both use: ``marian_layout.py``); the command line: ``python -m model.convert``.

``generation_config.json`` (else the generation fields of ``config.json``, as transformers falls back
to them) is read and applied, not assumed (``generation_rules``): ``forced_eos_token_id`` and
``early_stopping`` become ``ModelConfig.forced_eos`` / ``early_stopping`` (the search's rules),
``bad_words_ids`` of single tokens are never generated (pad and the decoder start already are; any
other id gets -inf in ``final_logits_bias``), ``num_beams``, ``length_penalty`` and the length limits
are recorded in the metadata as defaults (``python -m model.translate`` uses the first two). A field
that changes what transformers generates and that this project does not implement (sampling,
repetition penalties, n-gram blocking, minimum lengths, forced BOS, ...) is refused, naming it; one
it cannot reproduce exactly (``renormalize_logits`` off, pad not banned) is recorded as a note.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint import WEIGHT_DTYPES, save_checkpoint, unique_state_dict
from ..config import ACTIVATIONS, ModelConfig
from ..tokenizer import VocabTokenizer
from ..transformer import Transformer
from .marian_layout import permute_residual, split_order, stack_layers

TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json")
SPECIALS = {"eos": "</s>", "unk": "<unk>", "pad": "<pad>"}   # VocabTokenizer argument -> default piece


class MarianImportError(ValueError):
    """A MarianMT directory this importer cannot read; the message names the file or field."""


def is_marian_dir(directory: str | Path) -> bool:
    """Whether ``directory/config.json`` is a transformers MarianMT config (``model_type: marian``)."""
    try:
        return json.loads((Path(directory) / "config.json").read_text()).get("model_type") == "marian"
    except (OSError, ValueError, AttributeError):
        return False


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise MarianImportError(f"{path}: missing")
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise MarianImportError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise MarianImportError(f"{path}: expected a JSON object")
    return out


def marian_config(hf: dict, where: str = "config.json", generation: Optional[tuple[dict, str]] = None) -> ModelConfig:
    """Our ModelConfig for a transformers MarianConfig dict, with the search rules of ``generation``
    ((settings, file name) from ``read_generation``; default: config.json's generation fields).
    Raises MarianImportError for another architecture or a setting this model or its search does
    not implement (named by its field)."""
    if hf.get("model_type") != "marian":
        raise MarianImportError(f"{where}: model_type is {hf.get('model_type')!r}, not 'marian' "
                                f"(architectures {hf.get('architectures')})")

    def field(name, default=None):
        if name not in hf and default is None:
            raise MarianImportError(f"{where}: field {name!r} is missing")
        return hf.get(name, default)

    checks = [("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")]
    for a, b in checks:
        if field(a) != field(b):
            raise MarianImportError(f"{where}: {a} ({hf[a]}) != {b} ({hf[b]}) is not supported")
    act = field("activation_function")
    if act not in ACTIVATIONS:
        raise MarianImportError(f"{where}: activation_function {act!r} is not supported (choose from {ACTIVATIONS})")
    unsupported = {"normalize_before": True, "tie_word_embeddings": False,
                   "static_position_embeddings": False, "add_bias_logits": True, "normalize_embedding": True,
                   "add_final_layer_norm": True}
    for name, bad in unsupported.items():
        if hf.get(name) is bad:
            why = (" (transformers' MarianMTModel ignores it and runs post-LN: no reference to import against)"
                   if name == "normalize_before" else "")
            raise MarianImportError(f"{where}: {name}={json.dumps(bad)} is not supported{why}")
    vocab, shared = field("vocab_size"), hf.get("share_encoder_decoder_embeddings", True)
    if shared and hf.get("decoder_vocab_size") not in (None, vocab):
        raise MarianImportError(f"{where}: decoder_vocab_size ({hf['decoder_vocab_size']}) differs from vocab_size "
                                f"({vocab}) with share_encoder_decoder_embeddings=true")
    ours = hf.get("exported_from") if isinstance(hf.get("exported_from"), dict) else {}   # our export's marker
    try:
        cfg = ModelConfig(
            vocab_size=vocab, d_model=field("d_model"), n_heads=hf["encoder_attention_heads"],
            d_ff=hf["encoder_ffn_dim"], n_encoder_layers=field("encoder_layers"),
            n_decoder_layers=field("decoder_layers"), dropout=float(hf.get("dropout", 0.0)),
            attention_dropout=float(hf.get("attention_dropout", 0.0)), activation=act, positional="sinusoidal",
            sinusoid_layout=ours.get("sinusoid_layout", "split"), scale_embedding=bool(field("scale_embedding", False)),
            max_len=field("max_position_embeddings"), final_logits_bias=True, share_embeddings=shared,
            tie_target_output=not shared, tgt_vocab_size=0 if shared else field("decoder_vocab_size"),
            pad_id=field("pad_token_id"), eos_id=field("eos_token_id"),
            bos_id=field("decoder_start_token_id", hf.get("pad_token_id")), unk_id=1)
    except (TypeError, ValueError) as e:
        raise MarianImportError(f"{where}: {e}") from None
    rules = generation_rules(*(generation or generation_fields(hf, where)), cfg)
    cfg.forced_eos, cfg.early_stopping = rules["forced_eos"], rules["early_stopping"]
    return cfg


# transformers' GenerationConfig fields, by what the import does with them (``generation_rules``)
_APPLIED = ("decoder_start_token_id", "eos_token_id", "pad_token_id", "forced_eos_token_id", "bad_words_ids",
            "early_stopping", "renormalize_logits", "num_beams", "length_penalty", "max_length", "max_new_tokens",
            "do_sample")
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")
_INERT = ("transformers_version", "_from_model_config", "bos_token_id", "use_cache", "cache_implementation",
          "cache_config", "max_cache_len", "output_attentions", "output_hidden_states", "output_scores",
          "output_logits", "return_dict_in_generate", "num_return_sequences", "remove_invalid_values",
          "compile_config", "disable_compile", "prefill_chunk_size", "low_memory", "continuous_batching_config",
          "is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
          "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit", "assistant_lookbehind",
          "target_lookbehind", "assistant_ensemble_weight", "speculation_type", "use_mtp")
# fields that change the output unless they hold one of these (transformers' "off") values
_OFF = {"min_length": (None, 0), "min_new_tokens": (None, 0), "max_time": (None,), "stop_strings": (None, [], ""),
        "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0),
        "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0), "forced_bos_token_id": (None,),
        "exponential_decay_length_penalty": (None,), "suppress_tokens": (None, []), "begin_suppress_tokens": (None, []),
        "sequence_bias": (None, {}), "guidance_scale": (None, 1.0), "watermarking_config": (None,),
        "penalty_alpha": (None, 0.0), "dola_layers": (None,), "diversity_penalty": (None, 0.0),
        "num_beam_groups": (None, 1), "constraints": (None, []), "force_words_ids": (None, []),
        "token_healing": (None, False)}


def read_generation(directory: Path, hf: dict) -> tuple[dict, str]:
    """(generation settings, their file): ``generation_config.json`` when the directory has one, else
    the generation fields of config.json (``hf``), as transformers reads them."""
    path = Path(directory) / "generation_config.json"
    if path.exists():
        return _read_json(path), str(path)
    return generation_fields(hf, str(Path(directory) / "config.json"))


def generation_fields(hf: dict, where: str = "config.json") -> tuple[dict, str]:
    """The generation settings a config.json dict holds (older MarianMT directories keep them there)."""
    return {k: v for k, v in hf.items() if k in _APPLIED + _SAMPLING + tuple(_OFF)}, where


def _token_ids(value, where: str, name: str) -> list:
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise MarianImportError(f"{where}: {name} must be a token id or a list of them, got {json.dumps(value)}")
    return ids


def generation_rules(gen: dict, where: str, cfg: ModelConfig) -> dict:
    """What a generation config means here: {"forced_eos", "early_stopping": ModelConfig fields;
    "banned": other single-token bad_words_ids (-inf logits bias); "defaults": the recorded settings;
    "notes": what differs from transformers' generate() and why}. Raises MarianImportError naming a
    field that changes generation and that this project does not implement, or one it cannot read."""
    def show(v) -> str:
        return json.dumps(v, default=str)

    for name, value in gen.items():
        if name in _APPLIED or name in _SAMPLING or name in _INERT:
            continue
        if name in _OFF:
            if value not in _OFF[name]:
                raise MarianImportError(f"{where}: {name}={show(value)} is not implemented by this project's search "
                                        f"(greedy and beam search with forced EOS, banned tokens and a length "
                                        f"penalty only), and transformers applies it")
        elif value not in (None, False):
            raise MarianImportError(f"{where}: unknown generation field {name}={show(value)} (not applied by this "
                                    f"importer)")
    if gen.get("do_sample") not in (None, False):
        raise MarianImportError(f"{where}: do_sample={show(gen['do_sample'])}: sampling is not implemented "
                                f"(greedy and beam search only)")
    eos = gen.get("eos_token_id")
    if eos is not None and _token_ids(eos, where, "eos_token_id") != [cfg.eos_id]:
        raise MarianImportError(f"{where}: eos_token_id {show(gen['eos_token_id'])} is not config.json's "
                                f"eos_token_id {cfg.eos_id} (one EOS id, the vocabulary's, is supported)")
    for name, want in (("pad_token_id", cfg.pad_id), ("decoder_start_token_id", cfg.bos_id)):
        if gen.get(name) is not None and gen[name] != want:
            raise MarianImportError(f"{where}: {name} {show(gen[name])} differs from config.json's {want} "
                                    f"(not supported)")
    forced = gen.get("forced_eos_token_id")
    if forced is not None and _token_ids(forced, where, "forced_eos_token_id") != [cfg.eos_id]:
        raise MarianImportError(f"{where}: forced_eos_token_id {show(forced)} is not the EOS id {cfg.eos_id} "
                                f"(only EOS can be forced at the length limit)")
    early = gen.get("early_stopping")
    early = False if early is None else early       # transformers' default
    if not (isinstance(early, bool) or early == "never"):
        raise MarianImportError(f"{where}: early_stopping must be true, false or \"never\", got {show(early)}")
    length_penalty = gen.get("length_penalty")
    if length_penalty is not None and (isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float))
                                       or not math.isfinite(length_penalty)):
        raise MarianImportError(f"{where}: length_penalty must be a finite number, got {show(length_penalty)}")
    for name in ("num_beams", "max_length", "max_new_tokens"):
        v = gen.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise MarianImportError(f"{where}: {name} must be a positive integer, got {show(v)}")
    bad = gen.get("bad_words_ids")
    if bad is not None and not (isinstance(bad, list) and all(isinstance(seq, list) and seq for seq in bad)):
        raise MarianImportError(f"{where}: bad_words_ids must be a list of token-id lists, got {show(bad)}")
    banned = set()
    for seq in bad or []:
        ids = _token_ids(seq, where, "bad_words_ids")
        if ids == [cfg.eos_id]:
            continue                                 # transformers never bans EOS
        if len(ids) > 1:
            raise MarianImportError(f"{where}: bad_words_ids entry {show(seq)}: banned sequences of several tokens "
                                    f"are not implemented (single tokens are)")
        if not 0 <= ids[0] < cfg.target_vocab_size:
            raise MarianImportError(f"{where}: bad_words_ids entry {show(seq)} is not a target token id "
                                    f"(0..{cfg.target_vocab_size - 1})")
        banned.add(ids[0])
    notes = []
    name = Path(where).name
    if cfg.pad_id not in banned:
        notes.append(f"{name}: bad_words_ids does not ban the pad token {cfg.pad_id}: transformers may generate it, "
                     f"this project never does (outputs differ where it would)")
    if gen.get("renormalize_logits") is not True:
        notes.append(f"{name}: renormalize_logits is not true: transformers' beam scores keep the probability of the "
                     f"tokens it bans, this project renormalises after masking them (as renormalize_logits=true, the "
                     f"published OPUS-MT setting), so beam search outputs may differ slightly (greedy ones do not)")
    defaults = {"from": name, "forced_eos": forced is not None, "early_stopping": early,
                "renormalize_logits": gen.get("renormalize_logits") is True,
                **{k: gen[k] for k in ("num_beams", "length_penalty", "max_length", "max_new_tokens")
                   if gen.get(k) is not None}}
    return {"forced_eos": forced is not None, "early_stopping": early,
            "banned": sorted(banned - {cfg.pad_id, cfg.bos_id}), "defaults": defaults, "notes": notes}


def read_marian_weights(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict of ``model.safetensors`` (preferred) or ``pytorch_model.bin`` (unpickled with
    ``weights_only=True``: tensors only), with the file name. Raises MarianImportError."""
    st, pt = directory / "model.safetensors", directory / "pytorch_model.bin"
    try:
        if st.exists():
            from safetensors.torch import load_file
            return load_file(str(st)), st.name
        if pt.exists():
            return torch.load(str(pt), map_location="cpu", weights_only=True), pt.name
    except Exception as e:  # noqa: BLE001 - any unreadable weights file is one clear error
        raise MarianImportError(f"{st if st.exists() else pt}: cannot read weights ({type(e).__name__}: {e})") from None
    raise MarianImportError(f"{directory}: no model.safetensors or pytorch_model.bin")


def marian_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig, where: str,
                      source_order: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """Our unique state dict (``checkpoint.unique_state_dict`` names) from a transformers MarianMTModel
    state dict; ``source_order`` [vocab_size]: our source id -> theirs (separate vocabularies only).
    Raises MarianImportError naming a missing tensor."""
    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise MarianImportError(f"{where}: tensor {name!r} is missing")
        return hf[name].float()

    def first(names: tuple[str, ...]) -> torch.Tensor:
        found = next((hf[n] for n in names if n in hf), None)
        if found is None:
            raise MarianImportError(f"{where}: no embedding matrix ({names[0]})")
        return found.float()

    enc, dec = "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"
    out = {"logits_bias": get("final_logits_bias").reshape(-1) if "final_logits_bias" in hf
           else torch.zeros(cfg.target_vocab_size)}
    if cfg.share_embeddings:
        out["src_embed.tok.weight"] = first(("model.shared.weight", enc, dec, "lm_head.weight"))
    else:  # separate vocabularies: the output layer is the decoder's embedding (tie_word_embeddings)
        out["src_embed.tok.weight"] = first((enc, "model.shared.weight"))[source_order]
        out["tgt_embed.tok.weight"] = first((dec, "lm_head.weight"))
    for kind, n in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        out.update(stack_layers(kind, n, get))
    return out


def _special(tok_cfg: dict, field: str, default: str) -> str:
    """A special token's piece from tokenizer_config.json (a string or an AddedToken dict)."""
    piece = tok_cfg.get(field, default)
    return piece.get("content", default) if isinstance(piece, dict) else piece


def _vocab(path: Path, size: int, size_field: str) -> dict[str, int]:
    """A vocabulary file (piece -> id), checked: ids 0..n-1 once each, n = config.json ``size_field``."""
    vocab = _read_json(path)
    ids = sorted(vocab.values()) if all(isinstance(i, int) for i in vocab.values()) else None
    if ids != list(range(len(vocab))):
        raise MarianImportError(f"{path}: ids must be the integers 0..{len(vocab) - 1}, each once")
    if len(vocab) != size:
        raise MarianImportError(f"{path}: {len(vocab)} entries, but config.json {size_field} is {size}")
    return vocab


def _specials(path: Path, vocab: dict[str, int], cfg: ModelConfig, tok_cfg: dict) -> dict[str, str]:
    """The eos/unk/pad pieces (tokenizer_config.json, default ``</s>``, ``<unk>``, ``<pad>``), each in
    the target vocabulary at config.json's eos_token_id / pad_token_id; sets ``cfg.unk_id``."""
    pieces = {k: _special(tok_cfg, f"{k}_token", v) for k, v in SPECIALS.items()}
    for k, piece in pieces.items():
        if piece not in vocab:
            raise MarianImportError(f"{path}: no {k}_token {piece!r}")
        want = {"eos": cfg.eos_id, "pad": cfg.pad_id}.get(k)
        if want is not None and vocab[piece] != want:
            raise MarianImportError(f"{path}: {piece!r} has id {vocab[piece]}, but config.json {k}_token_id is {want}")
    cfg.unk_id = vocab[pieces["unk"]]
    return pieces


def _align_source(path: Path, source: dict[str, int], cfg: ModelConfig, pieces: dict[str, str]
                  ) -> tuple[dict[str, int], torch.Tensor]:
    """A separate source vocabulary renumbered so that its eos and pad have the target's ids (one
    eos id is appended to sources, one pad id pads them): (vocabulary, order [V_src]: our id -> theirs)."""
    order = list(range(len(source)))
    for k, want in (("eos", cfg.eos_id), ("pad", cfg.pad_id)):
        if pieces[k] not in source:
            raise MarianImportError(f"{path}: no {k}_token {pieces[k]!r}")
        if want >= len(source):
            raise MarianImportError(f"{path}: {len(source)} entries, too few for the target's {k} id {want}")
        have = order.index(source[pieces[k]])
        order[want], order[have] = order[have], order[want]
    inverse = {theirs: ours for ours, theirs in enumerate(order)}
    return {p: inverse[i] for p, i in source.items()}, torch.tensor(order)


def read_vocabularies(d: Path, cfg: ModelConfig, tok_cfg: dict
                      ) -> tuple[dict[str, int], Optional[dict[str, int]], dict[str, str], Optional[torch.Tensor]]:
    """(source vocabulary, separate target vocabulary or None, special pieces, source order or None)."""
    separate = bool(tok_cfg.get("separate_vocabs", False))
    if separate == cfg.share_embeddings:
        raise MarianImportError(f"{d / 'tokenizer_config.json'}: separate_vocabs={json.dumps(separate)} but "
                                f"config.json share_encoder_decoder_embeddings={json.dumps(cfg.share_embeddings)}")
    source = _vocab(d / "vocab.json", cfg.vocab_size, "vocab_size")
    if not separate:
        return source, None, _specials(d / "vocab.json", source, cfg, tok_cfg), None
    target = _vocab(d / "target_vocab.json", cfg.target_vocab_size, "decoder_vocab_size")
    pieces = _specials(d / "target_vocab.json", target, cfg, tok_cfg)
    source, order = _align_source(d / "vocab.json", source, cfg, pieces)
    return source, target, pieces, order


def load_marian(directory: str | Path) -> tuple[Transformer, VocabTokenizer, dict]:
    """(model in float32 eval mode, unpacked; tokenizer; metadata) of a MarianMT directory, with its
    generation config applied (module docstring). Raises MarianImportError naming the file or field
    that is missing, inconsistent or not implemented."""
    d = Path(directory)
    if not d.is_dir():
        raise MarianImportError(f"{d}: not a directory")
    hf = _read_json(d / "config.json")
    generation = read_generation(d, hf)
    cfg = marian_config(hf, str(d / "config.json"), generation)
    for name in TOKENIZER_FILES:
        if not (d / name).exists():
            raise MarianImportError(f"{d / name}: missing (a MarianMT directory needs {', '.join(TOKENIZER_FILES)})")
    tok_cfg = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").exists() else {}
    source, target, pieces, order = read_vocabularies(d, cfg, tok_cfg)
    weights, wname = read_marian_weights(d)
    state = marian_state_dict(weights, cfg, str(d / wname), order)
    if cfg.sinusoid_layout == "interleaved":      # our export: undo its permutation to the split layout
        state = permute_residual(state, torch.argsort(split_order(cfg.d_model)))
    banned = generation_rules(*generation, cfg)["banned"]
    if banned:                                    # bad_words_ids beyond pad / decoder start: never generated
        state["logits_bias"][banned] = float("-inf")
    marker = hf.get("exported_from") if isinstance(hf.get("exported_from"), dict) else {}
    if marker.get("final_logits_bias") is False and not state["logits_bias"].any():
        cfg.final_logits_bias = False             # ours had none: the export wrote zeros
        del state["logits_bias"]
    model = Transformer(cfg)
    expected = unique_state_dict(model)
    with torch.no_grad():
        for name, t in expected.items():
            if tuple(state[name].shape) != tuple(t.shape):
                raise MarianImportError(f"{d / wname}: {name} has shape {tuple(state[name].shape)}, but config.json "
                                        f"implies {tuple(t.shape)}")
            t.copy_(state[name])
    clean_up = tok_cfg.get("clean_up_tokenization_spaces") is True
    try:
        tok = VocabTokenizer(d / "source.spm", d / "target.spm", source, target, decoder_start_id=cfg.bos_id,
                             clean_up_spaces=clean_up, **pieces)
    except (OSError, RuntimeError, ValueError) as e:
        raise MarianImportError(f"{d}: cannot load source.spm / target.spm ({e})") from None
    meta = marian_metadata(d, tok_cfg, cfg, generation)
    return model.eval(), tok, {**meta, "source_dtype": source_dtype(weights)}


def source_dtype(weights: dict[str, torch.Tensor]) -> str:
    """The name of the floating dtype most of a state dict's tensors are stored in (float32 when
    it is not one a checkpoint can store)."""
    counts = Counter(t.dtype for t in weights.values() if t.is_floating_point())
    names = {v: k for k, v in WEIGHT_DTYPES.items() if k != "float64"}
    return names.get(counts.most_common(1)[0][0], "float32") if counts else "float32"


def marian_metadata(directory: Path, tok_cfg: Optional[dict] = None, cfg: Optional[ModelConfig] = None,
                    generation: Optional[tuple[dict, str]] = None) -> dict:
    """Our metadata of a MarianMT directory: its languages (``tokenizer_config.json``), where it came
    from, the float32 dtype it loads in, its generation settings (``generation``: the recorded
    defaults, ``notes``: what differs from transformers) and ``clean_up_tokenization_spaces`` when set.
    Reads JSON only (``service/translator/card.py`` uses it). Raises MarianImportError."""
    d = Path(directory)
    if tok_cfg is None:
        tok_cfg = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").exists() else {}
    if cfg is None or generation is None:
        hf = _read_json(d / "config.json")
        generation = generation or read_generation(d, hf)
        cfg = cfg or marian_config(hf, str(d / "config.json"), generation)
    rules = generation_rules(*generation, cfg)
    meta = {"source_lang": tok_cfg.get("source_lang"), "target_lang": tok_cfg.get("target_lang"),
            "imported_from": f"MarianMT directory {d.name}", "dtype": "float32", "generation": rules["defaults"],
            "clean_up_tokenization_spaces": True if tok_cfg.get("clean_up_tokenization_spaces") is True else None,
            "notes": rules["notes"] or None}
    return {k: v for k, v in meta.items() if v is not None}


DTYPE_NOTE = ("{dtype} weights round the {source} ones: translations can differ slightly from the source model's "
              "(near-tied choices flip); --dtype {source} keeps the weights exactly")


def convert_marian(directory: str | Path, out: str | Path, dtype: Optional[str] = None) -> Path:
    """Write a MarianMT directory as our checkpoint (config.json, model.safetensors in ``dtype``, by
    default the source weights' own, source.spm, target.spm, vocab.json (+ target_vocab.json with
    separate vocabularies, the source renumbered as loaded), metadata.json, whose ``notes`` say what
    differs from the source model in transformers: a narrower dtype, generation settings).
    Raises MarianImportError."""
    model, tok, meta = load_marian(directory)
    d = Path(directory)
    source = meta.pop("source_dtype")
    dtype = dtype or source
    notes = list(meta.get("notes", []))
    if WEIGHT_DTYPES[dtype].itemsize < WEIGHT_DTYPES[source].itemsize or {dtype, source} == {"float16", "bfloat16"}:
        notes.append(DTYPE_NOTE.format(dtype=dtype, source=source))
    meta = {**meta, "dtype": dtype, "source_dtype": source} | ({"notes": notes} if notes else {})
    out = save_checkpoint(out, model, [d / "source.spm", d / "target.spm"], meta, dtype)
    vocabs = {"vocab.json": tok.vocab} | ({"target_vocab.json": tok.target_vocab} if tok.target_vocab is not tok.vocab
                                          else {})
    for name, vocab in vocabs.items():
        (out / name).write_text(json.dumps(vocab, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    return out
