"""Model configuration: one small dataclass with named presets (paper Table 3)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

ACTIVATIONS = ("relu", "gelu", "swish", "silu", "gelu_new")   # swish = silu = x·sigmoid(x); gelu is the exact
                                    # (erf) GELU; gelu_new its tanh approximation (T5's gated-gelu)
NORMS = ("layernorm", "rmsnorm")


@dataclass
class ModelConfig:
    vocab_size: int = 8000          # joint source/target SentencePiece vocabulary (shared embeddings)
    d_model: int = 512              # width of every residual stream (paper: d_model)
    n_heads: int = 8                # attention heads; d_k = d_v = d_model / n_heads unless d_kv is set
    d_kv: int = 0                   # head width d_k = d_v when n_heads·d_kv need not be d_model (T5); 0: d_model / n_heads
    d_ff: int = 2048                # inner width of the position-wise feed-forward network
    n_encoder_layers: int = 6       # N for the encoder stack
    n_decoder_layers: int = 6       # N for the decoder stack
    dropout: float = 0.1            # P_drop on sub-layer outputs and on embeddings + positions
    attention_dropout: float = 0.0  # dropout on attention weights (not in the paper; 0 = off)
    activation: str = "relu"        # FFN non-linearity: "relu" (paper), "gelu" or "swish" (= SiLU, most OPUS-MT)
    norm_first: bool = False        # False = post-LN, LayerNorm(x + Sublayer(x)) as in the paper;
                                    # True = pre-LN, x + Sublayer(LayerNorm(x)), a LayerNorm closing each stack
    positional: str = "sinusoidal"  # "sinusoidal" (paper section 3.5), "learned" or "none" (T5: relative_buckets)
    sinusoid_layout: str = "interleaved"  # sin/cos alternate (paper); "split": sines then cosines (Marian);
                                    # "fairseq": sines then cosines at 10000^(-i/(d/2-1)), pad_id's row zero (M2M100, NLLB)
    position_offset: int = 0        # table row of position 0 (fairseq sinusoid: pad_id + 1; mBART's learned: 2)
    layernorm_embedding: bool = False  # LayerNorm on embeddings + positions, before dropout (mBART)
    share_positions: bool = True    # with share_embeddings, the decoder shares the encoder's positions and
                                    # embedding LayerNorm too (False: each stack its own, tokens shared: mBART)
    scale_embedding: bool = True    # token embeddings × √d_model (section 3.4); Marian's scale_embedding
    max_len: int = 512              # longest source or target sequence in tokens, specials included
    share_embeddings: bool = True   # tie source, target and pre-softmax weights (section 3.4)
    tgt_vocab_size: int = 0         # a separate target vocabulary's size (0: vocab_size; needs share_embeddings off)
    tie_target_output: bool = False  # without share_embeddings: pre-softmax weights = target embedding (Marian)
    separate_output: bool = False   # pre-softmax weights a matrix of their own even so (untied: tie_word_embeddings off)
    final_logits_bias: bool = False  # a bias [vocab_size] added to the logits (Marian's final_logits_bias)
    layer_norm_eps: float = 1e-5    # epsilon of every LayerNorm
    # The T5 family (T5, mT5, MADLAD-400) on the same network; the defaults are the paper's:
    norm: str = "layernorm"         # "rmsnorm": x / RMS(x) · weight, no bias, no centring (T5LayerNorm)
    scale_attention: bool = True    # attention logits × 1/√d_k (eq. 1); False: unscaled (T5)
    relative_buckets: int = 0       # > 0: learned per-head biases on the attention logits of this many
                                    # relative-position buckets (T5), one table per stack (encoder: bidirectional)
    relative_max_distance: int = 128  # distances beyond this share the last bucket (T5's relative_attention_max_distance)
    gated_ffn: bool = False         # FFN(x) = (act(x W1) ⊙ x W3) W2 (T5's gated-gelu)
    linear_bias: bool = True        # biases in attention and FFN linear layers (T5: none)
    scale_decoder_output: bool = False  # tied output: decoder states × d_model^-0.5 before it (T5 tied)
    pad_id: int = 0                 # padding token id (never attended to)
    unk_id: int = 1                 # unknown-piece id
    bos_id: int = 2                 # first decoder input, never generated (Marian: decoder_start_token_id = pad)
    eos_id: int = 3                 # end-of-sentence id, appended to every source and target
    # how a search ends (model/inference/search.py), as the generation config of an imported model says:
    forced_eos: bool = False        # the last step a length budget allows emits EOS (MarianMT's forced_eos_token_id)
    early_stopping: bool | str = True  # beam search: True ends at beam_size finished hypotheses (ours);
                                    # False / "never": transformers' rules (MarianMT's default: False)

    def __post_init__(self) -> None:
        if self.d_kv < 0:
            raise ValueError(f"d_kv must be >= 0, got {self.d_kv}")
        if not self.d_kv and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.positional not in ("sinusoidal", "learned", "none"):
            raise ValueError(f"positional must be 'sinusoidal', 'learned' or 'none', got {self.positional!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.relative_buckets < 0 or (self.relative_buckets and self.relative_max_distance < 2):
            raise ValueError(f"relative_buckets must be >= 0 and relative_max_distance >= 2, got "
                             f"{self.relative_buckets}, {self.relative_max_distance}")
        if self.tgt_vocab_size and self.share_embeddings and self.tgt_vocab_size != self.vocab_size:
            raise ValueError(f"tgt_vocab_size ({self.tgt_vocab_size}) differs from vocab_size ({self.vocab_size}): "
                             "separate vocabularies need share_embeddings=False")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if self.sinusoid_layout not in ("interleaved", "split", "fairseq"):
            raise ValueError(f"sinusoid_layout must be 'interleaved', 'split' or 'fairseq', got {self.sinusoid_layout!r}")
        if self.position_offset < 0:
            raise ValueError(f"position_offset must be >= 0, got {self.position_offset}")

    @property
    def target_vocab_size(self) -> int:
        """Size of the target vocabulary: the decoder's embedding and output layer."""
        return self.tgt_vocab_size or self.vocab_size

    @property
    def d_head(self) -> int:
        return self.d_kv or self.d_model // self.n_heads

    @classmethod
    def from_name(cls, name: str, **overrides) -> "ModelConfig":
        """A named preset ("base", "big", "small", "tiny") with optional field overrides."""
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


PRESETS = {
    # Transformer (base) and (big), paper Table 3.
    "base": ModelConfig(d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6, dropout=0.1),
    "big": ModelConfig(d_model=1024, n_heads=16, d_ff=4096, n_encoder_layers=6, n_decoder_layers=6, dropout=0.3),
    # The shipped CPU-trainable model (Multi30k de->en on 2 cores).
    "small": ModelConfig(d_model=256, n_heads=8, d_ff=1024, n_encoder_layers=3, n_decoder_layers=3,
                         dropout=0.1, max_len=256),
    # Test fixtures: builds in milliseconds.
    "tiny": ModelConfig(vocab_size=64, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
                        dropout=0.0, max_len=64),
}
