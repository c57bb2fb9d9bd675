"""Pure-PyTorch encoder-decoder Transformer (Vaswani et al., 2017) with SentencePiece, training,
evaluation and KV-cached greedy / beam decoding. Never imports ``service``."""
