// One decoder layer of an incremental decoding step (Vaswani et al., 2017, section 3.1: masked
// self-attention, encoder-decoder attention, FFN, each in a residual connection with layer norm)
// in one compiled call, over a KV cache read through packed key indices (model/inference/attention_plan.py);
// and one encoder layer (self-attention within each sentence, FFN) over a packed batch of sentences.
//
// A step of a few rows is mostly fixed cost in eager PyTorch: a layer is ~20 operators, each a
// Python call, a module call and a dispatch of a few microseconds, against a few microseconds of
// arithmetic for the whole layer at one row. Here the same operators run back to back in C++: the
// same int8 (int8_linear.cpp) or oneDNN float32 products, the same attention kernel
// (decode_attention.cpp), ATen's layer_norm, add and activation on the same values in the same
// order, so the result is the same, bit for bit, as MultiHeadAttention / DecoderLayer with
// CacheAttention hooks (model/inference/fused_step.py checks it once, tests/test_fused_step.py for many shapes).
// The T5 family's flags run here too: RMSNorm without bias, heads of d_kv (H * d_kv need not be
// d_model), a given attention scale (1 for T5), relative position biases (a table and each row's
// start in it, decode_attention.cpp), the gated FFN (act(x W1) * x W3) W2 and GELU's tanh form.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <optional>
#include <vector>

namespace mt {
std::vector<torch::Tensor> quantize_rows(torch::Tensor x);
torch::Tensor dequantize(torch::Tensor acc, torch::Tensor row_scale, torch::Tensor col_scale,
                         std::optional<torch::Tensor> bias_opt);
torch::Tensor int8_linear_kernel(torch::Tensor x, torch::Tensor w, torch::Tensor offset, torch::Tensor col_scale,
                                 std::optional<torch::Tensor> bias, int64_t n);
std::vector<torch::Tensor> packed_decode_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                   const torch::Tensor& v, const torch::Tensor& key_index,
                                                   const torch::Tensor& starts, int64_t max_len,
                                                   double scale, bool need_weights, bool generic,
                                                   const std::optional<torch::Tensor>& bias,
                                                   const std::optional<torch::Tensor>& bias_start);

namespace {

constexpr int64_t kLinearParams = 6;   // tensors per linear layer in ``params``

// oneDNN's prepacked float32 linear (torch.ops.mkldnn._linear_pointwise), as model/inference/linear.py calls it.
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                                            const std::optional<torch::Tensor>&, c10::string_view,
                                            c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  std::optional<torch::Tensor> b;
  if (bias.numel() > 0) b = bias;
  return op.call(x, w, b, "none", c10::List<std::optional<c10::Scalar>>(), c10::string_view(""));
}

// x [M, in] float32 -> [M, out] float32 through linear ``i`` of params: six tensors each,
// int8: {weight [in, out] column-major view, the same row-major, the compiled kernel's weight
// (kernels.vnni_weight) or empty, its offset or empty,
// per-feature scale [out], bias [out]} (model/inference/linear.py PackedWeight); float32: {oneDNN weight, 4 x empty, bias}.
torch::Tensor linear(const torch::Tensor& x, const std::vector<torch::Tensor>& p, int64_t i, int64_t small_rows) {
  const torch::Tensor& w = p[i * kLinearParams];
  const torch::Tensor& bias = p[i * kLinearParams + 5];
  if (w.scalar_type() != torch::kInt8) return onednn_linear(x, w, bias);
  const torch::Tensor& scale = p[i * kLinearParams + 4];
  const torch::Tensor& small = p[i * kLinearParams + 2];
  if (small.numel() > 0 && x.size(0) <= small_rows)   // the compiled int8 layer (int8_linear.cpp)
    return int8_linear_kernel(x, small, p[i * kLinearParams + 3], scale, bias, scale.numel());
  auto qs = quantize_rows(x);
  const torch::Tensor& wm = x.size(0) == 1 ? w : p[i * kLinearParams + 1];
  return dequantize(at::_int_mm(qs[0], wm), qs[1], scale, bias);
}

// Cross-attention reads each source once: rows -> [U sources x k hypotheses] queries and back
// (as model/inference/attention_plan.py CacheAttention with ``share``). Returns {out [N, H * Dh]} or, with
// need_weights, {out, weights [N, H, max_len]} (zero past each row's own keys). bias / bias_start: the
// relative position biases (unshared rows only).
std::vector<torch::Tensor> attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& key_index, const torch::Tensor& starts, int64_t max_len,
                                  const std::optional<torch::Tensor>& share_flat, int64_t share_u, int64_t share_k,
                                  int64_t H, int64_t Dh, double scale, bool need_weights = false,
                                  const std::optional<torch::Tensor>& bias = std::nullopt,
                                  const std::optional<torch::Tensor>& bias_start = std::nullopt) {
  const int64_t N = q.size(0);
  if (!share_flat.has_value()) {
    auto r = packed_decode_attention(q.view({N, 1, H, Dh}), k, v, key_index, starts, max_len, scale, need_weights,
                                     false, bias, bias_start);
    if (!need_weights) return {r[0].view({N, H * Dh})};
    return {r[0].view({N, H * Dh}), r[1].view({N, H, max_len})};
  }
  auto qg = torch::zeros({share_u * share_k, H, Dh}, q.options()).index_copy_(0, *share_flat, q.view({N, H, Dh}));
  auto r = packed_decode_attention(qg.view({share_u, share_k, H, Dh}), k, v, key_index, starts, max_len, scale,
                                   need_weights, false, std::nullopt, std::nullopt);
  auto out = r[0].reshape({share_u * share_k, H, Dh}).index_select(0, *share_flat).view({N, H * Dh});
  if (!need_weights) return {out};
  return {out, r[1].reshape({share_u * share_k, H, max_len}).index_select(0, *share_flat)};
}

torch::Tensor activate(const torch::Tensor& h, int64_t activation) {
  switch (activation) {
    case 0: return at::relu(h);
    case 1: return at::gelu(h);
    case 2: return at::silu(h);
    case 3:   // GELU's tanh form, written as model/layers.py gelu_new (the same operators in the same order)
      return (h * 0.5) * (at::tanh((h + at::pow(h, 3.0) * 0.044715) * std::sqrt(2.0 / M_PI)) + 1.0);
  }
  TORCH_CHECK(false, "activation must be 0 (relu), 1 (gelu), 2 (silu) or 3 (gelu_new), got ", activation);
}

}  // namespace

// A layer's shape and kind, as ModelConfig says: d_head (0: d_model / n_heads), rms (RMSNorm
// without bias instead of LayerNorm), gated (the FFN's gate W3 is the layer's last linear), the
// attention scale, and what the rest of the layer step has always taken.
struct LayerKind {
  int64_t n_heads, d_head, small_rows, activation;
  bool norm_first, rms, gated;
  double eps, scale;
};

// What both layer kinds share: the checks of x and params, the linear layers, the residual
// connections (post-LN Norm(x + y), or pre-LN x + y with the norm before the sub-layer) and the FFN.
struct Layer {
  const std::vector<torch::Tensor>& P;
  const LayerKind& kind;
  int64_t n_linears, d, H, Dh;

  Layer(const torch::Tensor& x, const std::vector<torch::Tensor>& params, int64_t n_linears, int64_t n_norms,
        const LayerKind& kind)
      : P(params), kind(kind), n_linears(n_linears + (kind.gated ? 1 : 0)), d(x.size(-1)), H(kind.n_heads), Dh(0) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.is_contiguous(),
                "x must be a contiguous [rows, d_model] float32 CPU tensor");
    const int64_t want = this->n_linears * kLinearParams + 2 * n_norms;
    TORCH_CHECK(static_cast<int64_t>(params.size()) == want, "params must hold ", want, " tensors, got ", params.size());
    TORCH_CHECK(H > 0 && (kind.d_head > 0 || d % H == 0), "d_model ", d, " is not a multiple of n_heads ", H);
    Dh = kind.d_head > 0 ? kind.d_head : d / H;
  }
  int64_t inner() const { return H * Dh; }
  torch::Tensor lin(const torch::Tensor& x, int64_t i) const { return linear(x, P, i, kind.small_rows); }
  torch::Tensor norm(const torch::Tensor& t, int64_t j) const {
    const int64_t k = n_linears * kLinearParams + 2 * j;
    if (kind.rms) return at::rms_norm(t, {d}, P[k], kind.eps);
    return at::layer_norm(t, {d}, P[k], P[k + 1], kind.eps);
  }
  torch::Tensor pre(const torch::Tensor& t, int64_t j) const { return kind.norm_first ? norm(t, j) : t; }
  torch::Tensor post(const torch::Tensor& t, const torch::Tensor& y, int64_t j) const {
    auto out = t + y;
    return kind.norm_first ? out : norm(out, j);
  }
  // x + FFN, the last sub-layer: linears w1, w1 + 1 (and the gate, the last linear), residual j
  torch::Tensor ffn(const torch::Tensor& x, int64_t w1, int64_t j) const {
    const auto h = pre(x, j);
    auto a = activate(lin(h, w1), kind.activation);
    if (kind.gated) a = a * lin(h, n_linears - 1);
    return post(x, lin(a, w1 + 1), j);
  }
};


// x [N, d_model] float32 -> [N, d_model]: one decoder layer for N rows of a decode step.
// params: 7 linears (self W_Q, W_KV, W_O; cross W_Q, W_O; FFN W1, W2; gated: then W3) x 6 tensors, then
// the three norms' weight and bias (empty for RMSNorm). self_k / self_v, cross_k / cross_v: the layer's cache buffers (any
// shape ending in [H, Dh], contiguous); write_at [N]: where this step's keys go, in rows of [*, H, Dh];
// *_key_index / *_starts / *_max_len: the packed plans (model/inference/attention_plan.py AttentionPlan);
// share_flat [N] (with share_u sources x share_k hypotheses) or None: rows sharing a source;
// self_bias [*, H] / self_bias_start [N] or None: the self-attention's relative position biases;
// d_head, rms, gated, scale: the layer's kind (LayerKind).
// Returns {x} or, with cross_weights, {x, the cross-attention weights [N, H, cross_max_len]}.
std::vector<torch::Tensor> decoder_layer_step(torch::Tensor x, const std::vector<torch::Tensor>& params,
                                 const torch::Tensor& self_k, const torch::Tensor& self_v,
                                 const torch::Tensor& write_at, const torch::Tensor& self_key_index,
                                 const torch::Tensor& self_starts, int64_t self_max_len,
                                 const torch::Tensor& cross_k, const torch::Tensor& cross_v,
                                 const torch::Tensor& cross_key_index, const torch::Tensor& cross_starts,
                                 int64_t cross_max_len, std::optional<torch::Tensor> share_flat, int64_t share_u,
                                 int64_t share_k, int64_t n_heads, int64_t small_rows, bool norm_first,
                                 int64_t activation, double eps, bool cross_weights,
                                 std::optional<torch::Tensor> self_bias, std::optional<torch::Tensor> self_bias_start,
                                 int64_t d_head, bool rms, bool gated, double scale) {
  const LayerKind kind{n_heads, d_head, small_rows, activation, norm_first, rms, gated, eps, scale};
  const Layer L(x, params, 7, 3, kind);
  const int64_t N = x.size(0), d = L.inner(), H = L.H, Dh = L.Dh;
  // masked self-attention: this step's K/V into the cache, then each row over its own keys
  auto h = L.pre(x, 0);
  auto q = L.lin(h, 0);
  auto kv = L.lin(h, 1);                                                      // [N, 2 d]
  auto K = self_k.view({-1, H, Dh}), V = self_v.view({-1, H, Dh});
  K.index_copy_(0, write_at, kv.narrow(1, 0, d).view({N, H, Dh}));
  V.index_copy_(0, write_at, kv.narrow(1, d, d).view({N, H, Dh}));
  auto a = attend(q, K, V, self_key_index, self_starts, self_max_len, std::nullopt, 0, 0, H, Dh, scale, false,
                  self_bias, self_bias_start)[0];
  x = L.post(x, L.lin(a, 2), 0);
  // encoder-decoder attention over the cached source keys
  q = L.lin(L.pre(x, 1), 3);
  auto c = attend(q, cross_k.view({-1, H, Dh}), cross_v.view({-1, H, Dh}), cross_key_index, cross_starts,
                  cross_max_len, share_flat, share_u, share_k, H, Dh, scale, cross_weights);
  x = L.post(x, L.lin(c[0], 4), 1);
  x = L.ffn(x, 5, 2);   // position-wise feed-forward
  if (!cross_weights) return {x};
  return {x, c[1]};
}

// x [NT, d_model] float32 -> [NT, d_model]: one encoder layer over a packed batch (the NT tokens of B
// sentences one after another; Transformer.encode_packed), as EncoderLayer with PackedSelfAttention.
// params: 5 linears (W_Q, W_KV, W_O, FFN W1, W2; gated: then W3) x 6 tensors, then the two norms' weight
// and bias; key_index / starts / max_len: each token's keys, the tokens of its own sentence
// (PackedSelfAttention); bias / bias_start or None: its relative position biases; the rest as decoder_layer_step.
torch::Tensor encoder_layer_step(torch::Tensor x, const std::vector<torch::Tensor>& params,
                                 const torch::Tensor& key_index, const torch::Tensor& starts, int64_t max_len,
                                 int64_t n_heads, int64_t small_rows, bool norm_first, int64_t activation, double eps,
                                 std::optional<torch::Tensor> bias, std::optional<torch::Tensor> bias_start,
                                 int64_t d_head, bool rms, bool gated, double scale) {
  const LayerKind kind{n_heads, d_head, small_rows, activation, norm_first, rms, gated, eps, scale};
  const Layer L(x, params, 5, 2, kind);
  const int64_t N = x.size(0), d = L.inner(), H = L.H, Dh = L.Dh;
  auto h = L.pre(x, 0);
  auto q = L.lin(h, 0);
  auto kv = L.lin(h, 1);                                                      // [NT, 2 d]
  auto K = kv.narrow(1, 0, d).contiguous().view({N, H, Dh}), V = kv.narrow(1, d, d).contiguous().view({N, H, Dh});
  auto a = attend(q, K, V, key_index, starts, max_len, std::nullopt, 0, 0, H, Dh, scale, false, bias, bias_start)[0];
  x = L.post(x, L.lin(a, 2), 0);
  return L.ffn(x, 3, 1);
}

}  // namespace mt

void register_decoder_step(pybind11::module& m) {
  m.def("decoder_layer_step", &mt::decoder_layer_step, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "one decoder layer of a decode step in one call (see decoder_step.cpp)");
  m.def("encoder_layer_step", &mt::encoder_layer_step, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "one encoder layer over a packed batch in one call (see decoder_step.cpp)");
}
