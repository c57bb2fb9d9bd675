// Decode-step attention over a KV cache on CPU: each query row attends over its own keys only.
//
// softmax(q K^T / sqrt(d_k)) V (Vaswani et al., 2017, eq. 1) for R rows at once, where row r owns the
// keys key_index[starts[r] .. starts[r+1]) of a cache laid out as rows of [H, D] (one cached position
// of all heads). Rows of different lengths cost their own keys, not the longest row's: this replaces
// a padded batch (or a gather + elementwise products in eager PyTorch, which materialise every
// gathered key several times) by one pass over each key. Each row is computed by itself, in a fixed
// order, so its result does not depend on which other rows share the call. An optional bias table
// (T5's relative position biases) adds bias[bias_start[r] + n, h] to the logit of row r's n-th key.
//
// Built on first use by model/inference/kernels.py (torch.utils.cpp_extension); eager PyTorch is the fallback.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace mt {

// <a, b> over D entries. Float rows of a multiple of 8 on AVX2 take two independent 8-wide partial sums
// (the generic loop's single accumulator made every key's score wait on a chain of D / 8 dependent
// additions); the order of the additions is fixed by D alone, so a row's result never depends on the
// other rows of the call. About 2x faster per (row, key, head) at D = 32 and 64.
template <typename scalar_t>
inline scalar_t dot(const scalar_t* a, const scalar_t* b, int64_t D) {
#if defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (D % 8 == 0 && D >= 8) {
      __m256 acc0 = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b)), acc1 = _mm256_setzero_ps();
      int64_t i = 8;
      for (; i + 16 <= D; i += 16) {
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
      }
      if (i < D) acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
      const __m256 v = _mm256_add_ps(acc0, acc1);
      __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
      lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
      return _mm_cvtss_f32(lo);
    }
  }
#endif
  scalar_t acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < D; ++d) acc += a[d] * b[d];
  return acc;
}

// o += w * v over D entries (8-wide on AVX2 for float rows of a multiple of 8; the same products and sums)
template <typename scalar_t>
inline void axpy(scalar_t* o, scalar_t w, const scalar_t* v, int64_t D) {
#if defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (D % 8 == 0) {
      const __m256 wv = _mm256_set1_ps(w);
      for (int64_t i = 0; i < D; i += 8)
        _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_loadu_ps(o + i), _mm256_mul_ps(wv, _mm256_loadu_ps(v + i))));
      return;
    }
  }
#endif
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) o[d] += w * v[d];
}

template <typename scalar_t>
void attend_rows(const scalar_t* Q, const scalar_t* K, const scalar_t* V, const int64_t* key_index,
                 const int64_t* starts, scalar_t* out, scalar_t* weights, int64_t R, int64_t NQ,
                 int64_t H, int64_t D, int64_t T, scalar_t scale, const scalar_t* bias, const int64_t* bias_start) {
  const int64_t HD = H * D, AH = NQ * H;
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<scalar_t> scores, row_max(AH), row_inv_sum(AH);  // scores: [L, NQ, H]
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t first = starts[r], L = starts[r + 1] - first;
      const scalar_t* q = Q + r * NQ * HD;   // [NQ, H, D]
      scalar_t* o = out + r * NQ * HD;       // [NQ, H, D]
      std::fill(o, o + NQ * HD, scalar_t(0));
      if (L <= 0) continue;
      scores.resize(L * AH);
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<scalar_t>::infinity());
      // scores[n, a, h] = <q[a, h], k_n[h]> * scale (+ bias[bias_start[r] + n, h]), one read of each key
      const scalar_t* b = bias == nullptr ? nullptr : bias + bias_start[r] * H;
      for (int64_t n = 0; n < L; ++n) {
        const scalar_t* k = K + key_index[first + n] * HD;
        scalar_t* s = scores.data() + n * AH;
        for (int64_t a = 0; a < NQ; ++a) {
          for (int64_t h = 0; h < H; ++h) {
            scalar_t x = dot(q + a * HD + h * D, k + h * D, D) * scale;
            if (b != nullptr) x += b[n * H + h];
            s[a * H + h] = x;
            row_max[a * H + h] = std::max(row_max[a * H + h], x);
          }
        }
      }
      // softmax over this row's keys, per (query, head)
      std::fill(row_inv_sum.begin(), row_inv_sum.end(), scalar_t(0));
      for (int64_t n = 0; n < L; ++n) {
        scalar_t* s = scores.data() + n * AH;
        for (int64_t j = 0; j < AH; ++j) {
          s[j] = std::exp(s[j] - row_max[j]);
          row_inv_sum[j] += s[j];
        }
      }
      for (int64_t j = 0; j < AH; ++j) row_inv_sum[j] = scalar_t(1) / row_inv_sum[j];
      // out[a, h] = sum_n w[n, a, h] v_n[h], one read of each value
      for (int64_t n = 0; n < L; ++n) {
        const scalar_t* v = V + key_index[first + n] * HD;
        const scalar_t* s = scores.data() + n * AH;
        for (int64_t a = 0; a < NQ; ++a) {
          for (int64_t h = 0; h < H; ++h) {
            const scalar_t w = s[a * H + h] * row_inv_sum[a * H + h];
            if (weights != nullptr) weights[((r * NQ + a) * H + h) * T + n] = w;
            axpy(o + a * HD + h * D, w, v + h * D, D);
          }
        }
      }
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
// Lane j of the result: the sum of a[j]'s eight lanes (a fixed order of additions).
inline __m256 lane_sums8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// attend_rows for float heads with H % 8 == 0 and D % 8 == 0 (every shipped and converted model):
// eight heads' scores of a key at once (one FMA chain per head, then one transposing reduction instead
// of eight horizontal sums), the softmax's exponentials eight at a time (exp_nonpositive), and each
// (query, head)'s output accumulated in registers over its keys. Per row the same fixed order of
// operations whatever the other rows, so a row's result does not depend on the call's other rows.
// 1.5-1.6x faster than the generic loop at H = 8, D = 32 (python -m service.bench.attention).
void attend_rows_h8(const float* Q, const float* K, const float* V, const int64_t* key_index,
                    const int64_t* starts, float* out, float* weights, int64_t R, int64_t NQ, int64_t H,
                    int64_t D, int64_t T, float scale, const float* bias, const int64_t* bias_start) {
  const int64_t HD = H * D, AH = NQ * H;
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> scores, row_max(AH), row_inv_sum(AH);  // scores: [L, NQ, H]
    const __m256 scale_v = _mm256_set1_ps(scale);
    // A decode step's keys were written a step ago and the weights streamed since have pushed them out
    // of the near caches: fetch each key and value row kPrefetch keys ahead of the score loop, across
    // row boundaries (the rows' keys follow each other in key_index).
    constexpr int64_t kPrefetch = 4;
    const int64_t key_end = starts[r1];
    auto prefetch_key = [&](int64_t g) {
      if (g >= key_end) return;
      const char* kp = reinterpret_cast<const char*>(K + key_index[g] * HD);
      const char* vp = reinterpret_cast<const char*>(V + key_index[g] * HD);
      for (int64_t b = 0; b < HD * 4; b += 64) {
        _mm_prefetch(kp + b, _MM_HINT_T0);
        _mm_prefetch(vp + b, _MM_HINT_T1);
      }
    };
    for (int64_t g = starts[r0]; g < starts[r0] + kPrefetch; ++g) prefetch_key(g);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t first = starts[r], L = starts[r + 1] - first;
      const float* q = Q + r * NQ * HD;   // [NQ, H, D]
      float* o = out + r * NQ * HD;       // [NQ, H, D]
      if (L <= 0) {
        std::fill(o, o + NQ * HD, 0.f);
        continue;
      }
      scores.resize(L * AH);
      const float* b = bias == nullptr ? nullptr : bias + bias_start[r] * H;
      // scores[n, a, h] = <q[a, h], k_n[h]> * scale (+ bias[bias_start[r] + n, h]), eight heads at a time
      for (int64_t n = 0; n < L; ++n) {
        const float* k = K + key_index[first + n] * HD;
        float* s = scores.data() + n * AH;
        prefetch_key(first + n + kPrefetch);
        for (int64_t a = 0; a < NQ; ++a) {
          for (int64_t h0 = 0; h0 < H; h0 += 8) {
            __m256 acc[8];
            for (int j = 0; j < 8; ++j) {
              const float* qh = q + a * HD + (h0 + j) * D;
              const float* kh = k + (h0 + j) * D;
              __m256 x = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(kh));
              for (int64_t c = 8; c < D; c += 8) x = _mm256_fmadd_ps(_mm256_loadu_ps(qh + c), _mm256_loadu_ps(kh + c), x);
              acc[j] = x;
            }
            __m256 sc = _mm256_mul_ps(lane_sums8(acc), scale_v);
            if (b != nullptr) sc = _mm256_add_ps(sc, _mm256_loadu_ps(b + n * H + h0));
            _mm256_storeu_ps(s + a * H + h0, sc);
            float* m = row_max.data() + a * H + h0;
            _mm256_storeu_ps(m, n == 0 ? sc : _mm256_max_ps(_mm256_loadu_ps(m), sc));
          }
        }
      }
      // softmax over this row's keys, per (query, head), eight at a time
      for (int64_t j = 0; j < AH; j += 8) {
        const __m256 m = _mm256_loadu_ps(row_max.data() + j);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t n = 0; n < L; ++n) {
          float* s = scores.data() + n * AH + j;
          const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s), m));
          _mm256_storeu_ps(s, e);
          sum = _mm256_add_ps(sum, e);
        }
        const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), sum);
        for (int64_t n = 0; n < L; ++n) {
          float* s = scores.data() + n * AH + j;
          _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_loadu_ps(s), inv));
        }
      }
      if (weights != nullptr) {
        for (int64_t n = 0; n < L; ++n)
          for (int64_t j = 0; j < AH; ++j) weights[(r * AH + j) * T + n] = scores[n * AH + j];
      }
      // out[a, h] = sum_n w[n, a, h] v_n[h], accumulated in registers, 32 (or 8) entries of D at a time
      const int64_t width = D % 32 == 0 ? 32 : 8;
      for (int64_t a = 0; a < NQ; ++a) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t off = h * D;
          const float* w = scores.data() + a * H + h;
          float* oh = o + a * HD + off;
          for (int64_t d0 = 0; d0 < D; d0 += width) {
            if (width == 32) {
              __m256 y0 = _mm256_setzero_ps(), y1 = y0, y2 = y0, y3 = y0;
              for (int64_t n = 0; n < L; ++n) {
                const __m256 wv = _mm256_broadcast_ss(w + n * AH);
                const float* v = V + key_index[first + n] * HD + off + d0;
                y0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v), y0);
                y1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + 8), y1);
                y2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + 16), y2);
                y3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + 24), y3);
              }
              _mm256_storeu_ps(oh + d0, y0);
              _mm256_storeu_ps(oh + d0 + 8, y1);
              _mm256_storeu_ps(oh + d0 + 16, y2);
              _mm256_storeu_ps(oh + d0 + 24, y3);
            } else {
              __m256 y = _mm256_setzero_ps();
              for (int64_t n = 0; n < L; ++n)
                y = _mm256_fmadd_ps(_mm256_broadcast_ss(w + n * AH), _mm256_loadu_ps(V + key_index[first + n] * HD + off + d0), y);
              _mm256_storeu_ps(oh + d0, y);
            }
          }
        }
      }
    }
  });
}
#endif

// q [R, NQ, H, D]; k, v [N, H, D] (any N: a cache layer viewed as rows); key_index [NK] rows of k/v;
// starts [R + 1] (row r owns key_index[starts[r]:starts[r+1]]); max_len >= every row's key count.
// Returns {out [R, NQ, H, D]} or, with need_weights, {out, weights [R, NQ, H, max_len]} (zero past
// each row's own length). generic: the generic loop even where attend_rows_h8 applies (tests and
// python -m service.bench.attention compare the two). bias [NB, H] (q's dtype) with bias_start [R]
// (int64), or neither: row r's n-th key gets bias[bias_start[r] + n] added to its logits (T5).
std::vector<torch::Tensor> packed_decode_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                   const torch::Tensor& v, const torch::Tensor& key_index,
                                                   const torch::Tensor& starts, int64_t max_len,
                                                   double scale, bool need_weights, bool generic,
                                                   const std::optional<torch::Tensor>& bias,
                                                   const std::optional<torch::Tensor>& bias_start) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "q must be a contiguous [R, Q, H, D] tensor");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes(), "k and v must be contiguous, same shape");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v dtypes differ");
  TORCH_CHECK(key_index.scalar_type() == torch::kLong && starts.scalar_type() == torch::kLong &&
                  key_index.is_contiguous() && starts.is_contiguous(), "key_index and starts must be contiguous int64");
  const int64_t R = q.size(0), NQ = q.size(1), H = q.size(2), D = q.size(3);
  TORCH_CHECK(k.numel() % (H * D) == 0, "k and v must hold [*, H, D] rows");
  TORCH_CHECK(starts.numel() == R + 1, "starts must have R + 1 entries");
  const int64_t n_rows = k.numel() / (H * D);
  // Bounds are checked here (a plain pass over the indices) so that the kernel never reads outside k/v.
  const int64_t* ki = key_index.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  TORCH_CHECK(st[0] == 0 && st[R] == key_index.numel(), "starts must run from 0 to len(key_index)");
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(st[r + 1] >= st[r] && st[r + 1] - st[r] <= max_len, "row ", r, " has ", st[r + 1] - st[r],
                " keys; rows must have 0..max_len (", max_len, ") keys");
  }
  for (int64_t n = 0; n < key_index.numel(); ++n) {
    TORCH_CHECK(ki[n] >= 0 && ki[n] < n_rows, "key_index[", n, "] = ", ki[n], " is outside 0..", n_rows - 1);
  }
  TORCH_CHECK(bias.has_value() == bias_start.has_value(), "bias and bias_start come together");
  const int64_t* bs = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 2 && bias->size(1) == H && bias->is_contiguous() && bias->device().is_cpu() &&
                    bias->scalar_type() == q.scalar_type(), "bias must be a contiguous [*, H] CPU tensor of q's dtype");
    TORCH_CHECK(bias_start->scalar_type() == torch::kLong && bias_start->is_contiguous() &&
                    bias_start->numel() == R, "bias_start must be [R] contiguous int64");
    bs = bias_start->data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(bs[r] >= 0 && bs[r] + (st[r + 1] - st[r]) <= bias->size(0), "row ", r, "'s bias rows ", bs[r],
                  "..", bs[r] + st[r + 1] - st[r] - 1, " are outside 0..", bias->size(0) - 1);
    }
  }
  auto out = torch::empty_like(q);
  torch::Tensor w;
  if (need_weights) w = torch::zeros({R, NQ, H, max_len}, q.options());
#if defined(__AVX2__) && defined(__FMA__)
  if (!generic && q.scalar_type() == torch::kFloat32 && H % 8 == 0 && D % 8 == 0) {
    attend_rows_h8(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), ki, st, out.data_ptr<float>(),
                   need_weights ? w.data_ptr<float>() : nullptr, R, NQ, H, D, max_len, static_cast<float>(scale),
                   bs == nullptr ? nullptr : bias->data_ptr<float>(), bs);
    if (need_weights) return {out, w};
    return {out};
  }
#endif
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "packed_decode_attention", [&] {
    attend_rows<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                          key_index.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                          need_weights ? w.data_ptr<scalar_t>() : nullptr, R, NQ, H, D, max_len,
                          static_cast<scalar_t>(scale), bs == nullptr ? nullptr : bias->data_ptr<scalar_t>(), bs);
  });
  if (need_weights) return {out, w};
  return {out};
}

// A paged cache's plan for one step (``AttentionPlan`` with a block table): row r of the step, in slot
// slots[r], has keys at positions 0 .. lengths[r] - 1, position p in row table[slot, p / block_size] *
// block_size + p % block_size of a layer's block pool. Returns {key_index [sum(lengths)], starts [R + 1]}
// (the kernel's inputs) in one pass instead of a dozen tensor operations per plan and step.
std::vector<torch::Tensor> paged_key_index(const torch::Tensor& slots, const torch::Tensor& lengths,
                                           const torch::Tensor& table, int64_t block_size) {
  TORCH_CHECK(slots.device().is_cpu() && lengths.device().is_cpu() && table.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong &&
                  table.scalar_type() == torch::kLong, "slots, lengths and table must be int64");
  TORCH_CHECK(slots.dim() == 1 && lengths.dim() == 1 && slots.numel() == lengths.numel(),
              "slots and lengths must be [R] each");
  TORCH_CHECK(table.dim() == 2 && block_size >= 1, "table must be [slots, blocks per slot], block_size >= 1");
  const auto sl = slots.contiguous(), ln = lengths.contiguous(), tb = table.contiguous();
  const int64_t R = sl.numel(), S = tb.size(0), NB = tb.size(1);
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* lp = ln.data_ptr<int64_t>();
  const int64_t* tp = tb.data_ptr<int64_t>();
  auto starts = torch::empty({R + 1}, sl.options());
  int64_t* st = starts.data_ptr<int64_t>();
  st[0] = 0;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < S, "slot ", sp[r], " is outside 0..", S - 1);
    TORCH_CHECK(lp[r] >= 0 && lp[r] <= NB * block_size, "row ", r, " has ", lp[r], " keys; at most ",
                NB * block_size, " fit its table row");
    st[r + 1] = st[r] + lp[r];
  }
  auto key_index = torch::empty({st[R]}, sl.options());
  int64_t* ki = key_index.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t* row = tp + sp[r] * NB;
    int64_t* dst = ki + st[r];
    for (int64_t p = 0; p < lp[r]; ++p) dst[p] = row[p / block_size] * block_size + p % block_size;
  }
  return {key_index, starts};
}

}  // namespace mt

void register_int8_linear(pybind11::module& m);  // int8_linear.cpp
void register_row_topk(pybind11::module& m);     // row_topk.cpp
void register_decoder_step(pybind11::module& m); // decoder_step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_decode_attention", &mt::packed_decode_attention, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Decode-step attention, each row over its own cached keys (see decode_attention.cpp)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("key_index"), pybind11::arg("starts"),
        pybind11::arg("max_len"), pybind11::arg("scale"), pybind11::arg("need_weights"), pybind11::arg("generic") = false,
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("bias_start") = pybind11::none());
  m.def("paged_key_index", &mt::paged_key_index,
        "A paged cache's key rows and row starts for one decode step (see decode_attention.cpp)");
  register_int8_linear(m);
  register_row_topk(m);
  register_decoder_step(m);
}
