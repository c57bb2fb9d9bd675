// The two elementwise halves of an int8 linear layer with dynamic per-row activation scales
// (model/inference/linear.py): quantize each input row with its own scale, and turn the exact int32 products
// back into float32 with the row's and the output feature's scales. In eager PyTorch each half is
// five or six passes over the data with a temporary per pass, which costs more than the int8 matrix
// product itself at decoding sizes; here each is one pass. Every element is computed by itself, so a
// row's result does not depend on the other rows of the call.
//
// ``int8_linear_vnni`` (AVX-512 VNNI) and ``int8_linear_avx2`` (AVX2 without VNNI) do a whole layer in
// one call, for any number of rows: quantize, the int8 products, and the same dequantization in the
// products' epilogue. For a few rows (a decode step of a handful of sentences) the three calls and
// torch._int_mm's fixed cost are most of a layer's time; for many, the int32 products' round trip
// through memory and the two extra passes are (python -m service.bench.int8_layers). Integer
// products are exact and the float arithmetic is the same, element by element and in the same order
// (``-ffp-contract=off``: no fused multiply-add), so every path gives the same bits.
//
// Built with decode_attention.cpp into one extension by model/inference/kernels.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define MT_HAVE_VNNI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define MT_HAVE_AVX2_INT8 1
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace mt {

// One row: scale = max|x| / 127 (1 for an all-zero row), q = round-half-even(x / scale) + Offset, the same
// arithmetic as the eager path in model/inference/linear.py (Offset 128 gives the unsigned form that VNNI and the AVX2 kernel multiply).
template <typename T, int Offset>
inline float quantize_row(const float* __restrict xr, T* __restrict qr, const int64_t n) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xr[i]));
  float s = amax / 127.0f;
  if (!(s > 0.f)) s = 1.0f;
  // rint: round half to even in the default rounding mode, like torch.round (and, unlike nearbyint,
  // inlined and vectorized); restrict: an int8 store may alias anything otherwise
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::rint(xr[i] / s);
    qr[i] = static_cast<T>(static_cast<int>(std::min(127.f, std::max(-127.f, v))) + Offset);
  }
  return s;
}

// x [M, K] float32 -> (q [M, K] int8, scale [M] float32): scale = max|x_row| / 127 (1 for an all-zero
// row), q = round-half-even(x / scale), the same arithmetic as the eager path in model/inference/linear.py.
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "quantize_rows takes a 2-d float32 CPU tensor");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({M}, x.options());
  const float* X = x.data_ptr<float>();
  int8_t* Q = q.data_ptr<int8_t>();
  float* S = scale.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [=](int64_t r0, int64_t r1) {
    // a local copy: int8 stores may alias anything, so a K read from the closure would be reloaded
    // at every element (and the loop not vectorized)
    const int64_t n = K;
    for (int64_t r = r0; r < r1; ++r) S[r] = quantize_row<int8_t, 0>(X + r * K, Q + r * K, n);
  });
  return {q, scale};
}

// acc [M, N] int32, row_scale [M], col_scale [N], bias [N] or empty -> float32 [M, N]
// = acc * row_scale * col_scale (+ bias).
torch::Tensor dequantize(torch::Tensor acc, torch::Tensor row_scale, torch::Tensor col_scale,
                         std::optional<torch::Tensor> bias_opt) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == torch::kInt32 && acc.device().is_cpu(),
              "dequantize takes a 2-d int32 CPU tensor");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(row_scale.numel() == M && col_scale.numel() == N, "scales must have M and N entries");
  TORCH_CHECK(row_scale.scalar_type() == torch::kFloat32 && col_scale.scalar_type() == torch::kFloat32,
              "scales must be float32");
  torch::Tensor bias = bias_opt.has_value() ? *bias_opt : torch::Tensor();
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.numel() == N && bias.scalar_type() == torch::kFloat32), "bias must be [N] float32");
  acc = acc.contiguous();
  row_scale = row_scale.contiguous();
  col_scale = col_scale.contiguous();
  if (has_bias) bias = bias.contiguous();
  auto out = torch::empty({M, N}, acc.options().dtype(torch::kFloat32));
  const int32_t* A = acc.data_ptr<int32_t>();
  const float* RS = row_scale.data_ptr<float>();
  const float* CS = col_scale.data_ptr<float>();
  const float* B = has_bias ? bias.data_ptr<float>() : nullptr;
  float* O = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t* __restrict a = A + r * N;
      float* __restrict o = O + r * N;
      const float rs = RS[r];
      if (B) {
        for (int64_t j = 0; j < N; ++j) o[j] = static_cast<float>(a[j]) * rs * CS[j] + B[j];
      } else {
        for (int64_t j = 0; j < N; ++j) o[j] = static_cast<float>(a[j]) * rs * CS[j];
      }
    }
  });
  return out;
}


// The operands both whole-layer kernels check the same way: x [..., K] float32 (M rows), w [NB, K4 / 4, 16, 4]
// int8 from kernels.vnni_weight(), col_scale [n], bias [n] or none (``bias`` undefined then).
struct LayerArgs {
  int64_t K, M, NB, K4;
  torch::Tensor bias;
};

LayerArgs layer_args(const char* name, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& col_scale,
                     const std::optional<torch::Tensor>& bias_opt, int64_t n) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              name, " takes a float32 CPU tensor");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kInt8 && w.size(2) == 16 && w.size(3) == 4 && w.is_contiguous(),
              "w must be a contiguous [NB, K4/4, 16, 4] int8 tensor");
  LayerArgs a;
  a.K = x.size(-1);
  a.M = a.K ? x.numel() / a.K : 0;
  a.NB = w.size(0);
  a.K4 = w.size(1) * 4;
  TORCH_CHECK(a.K4 >= a.K && a.K4 < a.K + 4 && n > (a.NB - 1) * 16 && n <= a.NB * 16, "w does not fit x's width or n");
  TORCH_CHECK(col_scale.scalar_type() == torch::kFloat32 && col_scale.numel() == n && col_scale.is_contiguous(),
              "col_scale must be [n] float32");
  if (bias_opt.has_value() && bias_opt->defined() && bias_opt->numel() > 0) a.bias = *bias_opt;
  TORCH_CHECK(!a.bias.defined() || (a.bias.numel() == n && a.bias.scalar_type() == torch::kFloat32 && a.bias.is_contiguous()),
              "bias must be [n] float32");
  return a;
}

// [..., K] -> an empty [..., n] float32 output
torch::Tensor layer_output(const torch::Tensor& x, int64_t n) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return torch::empty(shape, x.options());
}

#ifdef MT_HAVE_VNNI
// acc + the sums of four u8 x s8 products per int32 lane (vpdpbusd; exact). GCC 12 ties the
// intrinsic's accumulator badly: around every vpdpbusd of a tile it copied each accumulator to another
// register (and one to the stack), which halved the kernel's rate at 32+ rows; the inline form updates
// the accumulator in place.
inline __m512i dpbusd(__m512i acc, __m512i x, __m512i w) {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, x, w);
#endif
}

// The operands of one int8_linear_vnni call.
struct SmallCall {
  const uint8_t* xq;       // [M, K4] quantized rows + 128 (K4 = K rounded up to 4; padding 128, i.e. 0)
  const float* row_scale;  // [M]
  const int8_t* w;         // [NB, K4 / 4, 16, 4]: 16 output features x 4 inputs per 64-byte vector
  const int32_t* offset;   // [NB * 16] 128 * sum of each feature's weights (what the +128 added)
  const float* col_scale;  // [N]
  const float* bias;       // [N] or nullptr
  float* out;              // [M, N]
  int64_t k4, n;
};

// MR rows x NR blocks of 16 output features: MR * NR int32 accumulators in registers; each step
// adds 4 inputs of every feature (vpdpbusd: u8 x s8, groups of 4 summed into int32, exact).
template <int MR, int NR>
inline void small_tile(const SmallCall& c, int64_t m0, int64_t nb0) {
  __m512i acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_si512();
  const int64_t steps = c.k4 / 4;
  const int8_t* wb = c.w + nb0 * steps * 64;
  for (int64_t k = 0; k < steps; ++k) {
    __m512i wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512(wb + (j * steps + k) * 64);
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      std::memcpy(&four, c.xq + (m0 + r) * c.k4 + 4 * k, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      for (int j = 0; j < NR; ++j) acc[r][j] = dpbusd(acc[r][j], xb, wv[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t f0 = (nb0 + j) * 16, left = c.n - f0;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512i off = _mm512_loadu_si512(c.offset + f0);
    const __m512 cs = _mm512_maskz_loadu_ps(mask, c.col_scale + f0);
    const __m512 b = c.bias ? _mm512_maskz_loadu_ps(mask, c.bias + f0) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      // as dequantize(): acc * row_scale * col_scale (+ bias), two products then the sum, no FMA
      __m512 a = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], off));
      a = _mm512_mul_ps(_mm512_mul_ps(a, _mm512_set1_ps(c.row_scale[m0 + r])), cs);
      if (c.bias) a = _mm512_add_ps(a, b);
      _mm512_mask_storeu_ps(c.out + (m0 + r) * c.n + f0, mask, a);
    }
  }
}

// Rows m0 .. m0 + MR - 1 (MR <= 4) x four blocks of 16 features from nb0: small_tile<MR, 4> with the
// sixteen accumulators as named variables and each weight vector loaded once per step for all rows.
// With dpbusd the array form (small_tile<4, 4>) still moves a row's accumulators between registers at
// every step (objdump of the build); named, the inner loop is exactly 16 vpdpbusd and 4 broadcasts.
// small_tile stays for the last, partial group of feature blocks.
template <int MR>
inline void vnni_tile4(const SmallCall& c, int64_t m0, int64_t nb0) {
  static_assert(MR >= 1 && MR <= 4, "1-4 rows");
  __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
          a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
  const int64_t steps = c.k4 / 4, k4 = c.k4;
  const int8_t* wb = c.w + nb0 * steps * 64;
  const uint8_t* x0 = c.xq + m0 * k4;
  auto row = [&](int r, int64_t k, __m512i w0, __m512i w1, __m512i w2, __m512i w3,
                 __m512i& s0, __m512i& s1, __m512i& s2, __m512i& s3) {
    int32_t four;
    std::memcpy(&four, x0 + r * k4 + 4 * k, 4);
    const __m512i xb = _mm512_set1_epi32(four);
    s0 = dpbusd(s0, xb, w0);
    s1 = dpbusd(s1, xb, w1);
    s2 = dpbusd(s2, xb, w2);
    s3 = dpbusd(s3, xb, w3);
  };
  for (int64_t k = 0; k < steps; ++k) {
    const __m512i w0 = _mm512_loadu_si512(wb + k * 64), w1 = _mm512_loadu_si512(wb + (steps + k) * 64),
                  w2 = _mm512_loadu_si512(wb + (2 * steps + k) * 64), w3 = _mm512_loadu_si512(wb + (3 * steps + k) * 64);
    row(0, k, w0, w1, w2, w3, a00, a01, a02, a03);
    if (MR > 1) row(1, k, w0, w1, w2, w3, a10, a11, a12, a13);
    if (MR > 2) row(2, k, w0, w1, w2, w3, a20, a21, a22, a23);
    if (MR > 3) row(3, k, w0, w1, w2, w3, a30, a31, a32, a33);
  }
  // as small_tile: acc - offset, then * row_scale * col_scale (+ bias), two products then the sum
  auto out = [&](int r, int j, __m512i acc) {
    const int64_t f0 = (nb0 + j) * 16, left = c.n - f0;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    __m512 a = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_loadu_si512(c.offset + f0)));
    a = _mm512_mul_ps(_mm512_mul_ps(a, _mm512_set1_ps(c.row_scale[m0 + r])), _mm512_maskz_loadu_ps(mask, c.col_scale + f0));
    if (c.bias) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(mask, c.bias + f0));
    _mm512_mask_storeu_ps(c.out + (m0 + r) * c.n + f0, mask, a);
  };
  out(0, 0, a00), out(0, 1, a01), out(0, 2, a02), out(0, 3, a03);
  if (MR > 1) out(1, 0, a10), out(1, 1, a11), out(1, 2, a12), out(1, 3, a13);
  if (MR > 2) out(2, 0, a20), out(2, 1, a21), out(2, 2, a22), out(2, 3, a23);
  if (MR > 3) out(3, 0, a30), out(3, 1, a31), out(3, 2, a32), out(3, 3, a33);
}
#endif

// x [..., K] float32 (M rows, any M) @ an int8 weight -> [..., N] float32 on AVX-512 VNNI CPUs, the same bits
// as quantize_rows, torch._int_mm and dequantize. w: [NB, K4 / 4, 16, 4] int8 and offset [NB * 16] int32 from kernels.vnni_weight().
torch::Tensor int8_linear_vnni(torch::Tensor x, torch::Tensor w, torch::Tensor offset, torch::Tensor col_scale,
                                std::optional<torch::Tensor> bias_opt, int64_t n) {
#ifdef MT_HAVE_VNNI
  const LayerArgs a = layer_args("int8_linear_vnni", x, w, col_scale, bias_opt, n);
  const int64_t K = a.K, M = a.M, NB = a.NB, K4 = a.K4;
  TORCH_CHECK(offset.scalar_type() == torch::kInt32 && offset.numel() == NB * 16 && offset.is_contiguous(),
              "offset must be [NB * 16] int32");
  x = x.contiguous();
  auto xq = torch::empty({M, K4}, x.options().dtype(torch::kUInt8));
  auto row_scale = torch::empty({M}, x.options());
  const float* X = x.data_ptr<float>();
  uint8_t* XQ = xq.data_ptr<uint8_t>();
  float* RS = row_scale.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [=](int64_t r0, int64_t r1) {
    const int64_t k = K, k4 = K4;   // local copies: uint8 stores may alias the closure's fields
    for (int64_t r = r0; r < r1; ++r) {
      RS[r] = quantize_row<uint8_t, 128>(X + r * k, XQ + r * k4, k);
      for (int64_t i = k; i < k4; ++i) XQ[r * k4 + i] = 128;
    }
  });
  auto out = layer_output(x, n);
  const SmallCall c{XQ, RS, w.data_ptr<int8_t>(), offset.data_ptr<int32_t>(), col_scale.data_ptr<float>(),
                    a.bias.defined() ? a.bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), K4, n};
  constexpr int NR = 4;
  // Cache blocking, as in int8_linear_avx2: each thread's groups of NR feature blocks are taken ~256 KB
  // of weights at a time (kept in L2), and chunks of rows whose quantized inputs fit in 16 KB of L1
  // pass over them; within a chunk one group's weights (NR x K4 x 16 bytes) stay in L1 across its
  // row tiles. So the weights are read from memory once per call, whatever the row count.
  const int64_t groups = (NB + NR - 1) / NR;
  const int64_t row_chunk = std::max<int64_t>(4, (16384 / K4) / 4 * 4);
  const int64_t group_chunk = std::max<int64_t>(1, 262144 / (K4 * 16 * NR));
  at::parallel_for(0, groups, std::max<int64_t>(1, 4096 / std::max<int64_t>(M * K4 / 4, 1)),
                   [&](int64_t g0, int64_t g1) {
    for (int64_t gc = g0; gc < g1; gc += group_chunk) {
      const int64_t gc1 = std::min(g1, gc + group_chunk);
      for (int64_t r0 = 0; r0 < M; r0 += row_chunk) {
        const int64_t r1 = std::min(M, r0 + row_chunk);
        for (int64_t g = gc; g < gc1; ++g) {
          const int64_t nb0 = g * NR;
          if (nb0 + NR <= NB) {
            int64_t m0 = r0;
            for (; m0 + 4 <= r1; m0 += 4) vnni_tile4<4>(c, m0, nb0);
            for (; m0 < r1; ++m0) vnni_tile4<1>(c, m0, nb0);
          } else {   // the last, partial group
            for (int64_t nb = nb0; nb < NB; ++nb) {
              int64_t m0 = r0;
              for (; m0 + 4 <= r1; m0 += 4) small_tile<4, 1>(c, m0, nb);
              for (; m0 < r1; ++m0) small_tile<1, 1>(c, m0, nb);
            }
          }
        }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "int8_linear_vnni needs AVX-512 VNNI (see has_int8_linear_vnni)");
#endif
}


#ifdef MT_HAVE_AVX2_INT8
// AVX2 (no VNNI): vpmaddubsw multiplies unsigned by signed bytes and adds each pair into int16 with
// saturation, then vpmaddwd adds pairs of those into int32. The inputs go in unsigned, q + 128 (1..255,
// as the VNNI kernel's, with the same per-feature offset 128 x sum(w) taken off at the end), and the
// weights must lie in -64..64 (``kernels.int8_weight_levels()``: 63 levels a side on this path), so a
// pair is at most 2 x 255 x 64 = 32,640 and every int16 sum is exact. Full 8-bit weights need a sign
// step per row and weight vector instead (|x| times w with x's sign, vpsignb) and a second broadcast:
// 40 vector instructions per step of the 4-row tile against 28, and the kernel is bound by their issue.
struct Avx2Call {
  const uint8_t* xq;       // [M, K4] quantized rows + 128 (K4 = K rounded up to 4; padding 128, i.e. 0)
  const float* row_scale;  // [M]
  const int8_t* w;         // [NB, K4 / 4, 16, 4], every value in -64..64
  const int32_t* offset;   // [NB * 16] 128 * sum of each feature's weights
  const float* col_scale;  // [N]
  const float* bias;       // [N] or nullptr
  float* out;              // [M, N]
  int64_t k4, n;
};

// acc[r] - offset, then * row_scale * col_scale (+ bias), two products then the sum (no FMA), as
// dequantize(); rows m0 .. m0 + MR - 1 of the 16 features of block nb.
template <int MR>
inline void avx2_store(const Avx2Call& c, int64_t m0, int64_t nb, const __m256i (&acc)[4][2]) {
  const int64_t f0 = nb * 16, left = c.n - f0;
  if (left >= 16) {
    const __m256i off0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.offset + f0));
    const __m256i off1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.offset + f0 + 8));
    const __m256 cs0 = _mm256_loadu_ps(c.col_scale + f0), cs1 = _mm256_loadu_ps(c.col_scale + f0 + 8);
    const __m256 b0 = c.bias ? _mm256_loadu_ps(c.bias + f0) : _mm256_setzero_ps();
    const __m256 b1 = c.bias ? _mm256_loadu_ps(c.bias + f0 + 8) : _mm256_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const __m256 rs = _mm256_set1_ps(c.row_scale[m0 + r]);
      __m256 o0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][0], off0)), rs), cs0);
      __m256 o1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][1], off1)), rs), cs1);
      if (c.bias) {
        o0 = _mm256_add_ps(o0, b0);
        o1 = _mm256_add_ps(o1, b1);
      }
      float* dst = c.out + (m0 + r) * c.n + f0;
      _mm256_storeu_ps(dst, o0);
      _mm256_storeu_ps(dst + 8, o1);
    }
    return;
  }
  // the last, partial block of features
  alignas(32) int32_t sums[16];
  for (int r = 0; r < MR; ++r) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), acc[r][0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums + 8), acc[r][1]);
    const float rs = c.row_scale[m0 + r];
    float* dst = c.out + (m0 + r) * c.n + f0;
    for (int64_t j = 0; j < left; ++j) {
      float v = static_cast<float>(sums[j] - c.offset[f0 + j]) * rs * c.col_scale[f0 + j];
      if (c.bias) v += c.bias[f0 + j];
      dst[j] = v;
    }
  }
}

// One row x the 16 features of block nb (the rows left over by avx2_tile4).
inline void avx2_tile1(const Avx2Call& c, int64_t m, int64_t nb) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[4][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()}};
  const int64_t steps = c.k4 / 4;
  const int8_t* wb = c.w + nb * steps * 64;
  const uint8_t* x = c.xq + m * c.k4;
  for (int64_t k = 0; k < steps; ++k) {
    int32_t four;
    std::memcpy(&four, x + 4 * k, 4);
    const __m256i xb = _mm256_set1_epi32(four);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + k * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + k * 64 + 32));
    acc[0][0] = _mm256_add_epi32(acc[0][0], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w0), ones));
    acc[0][1] = _mm256_add_epi32(acc[0][1], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w1), ones));
  }
  avx2_store<1>(c, m, nb, acc);
}

// The loop of avx2_tile4 in AT&T syntax (GCC and Clang, the compilers kernels.py's flags are for): ymm8/ymm9 the step's two weight vectors, ymm11 a row's four
// inputs broadcast, ymm12/ymm13 its products; the accumulators and the int16 ones are the compiler's.
#define MT_AVX2_LOAD "vmovdqu (%[w]), %%ymm8\n\tvmovdqu 32(%[w]), %%ymm9\n\t"
#define MT_AVX2_ROW(ADDR, A0, A1)                                                      \
  "vpbroadcastd " ADDR ", %%ymm11\n\t"                                                 \
  "vpmaddubsw %%ymm8, %%ymm11, %%ymm12\n\tvpmaddubsw %%ymm9, %%ymm11, %%ymm13\n\t"     \
  "vpmaddwd %[ones], %%ymm12, %%ymm12\n\tvpmaddwd %[ones], %%ymm13, %%ymm13\n\t"       \
  "vpaddd %%ymm12, %[" A0 "], %[" A0 "]\n\tvpaddd %%ymm13, %[" A1 "], %[" A1 "]\n\t"
#define MT_AVX2_ROWS                                                                   \
  MT_AVX2_ROW("(%[x])", "a00", "a01") MT_AVX2_ROW("(%[x],%[k4])", "a10", "a11")        \
  MT_AVX2_ROW("(%[x],%[k4],2)", "a20", "a21") MT_AVX2_ROW("(%[x],%[k4x3])", "a30", "a31") \
  "add $64, %[w]\n\tadd $4, %[x]\n\tdec %[n]\n\tjnz 1b\n\t"
#define MT_AVX2_OUTPUTS                                                                \
  [a00] "+x"(a00), [a01] "+x"(a01), [a10] "+x"(a10), [a11] "+x"(a11), [a20] "+x"(a20), \
  [a21] "+x"(a21), [a30] "+x"(a30), [a31] "+x"(a31), [w] "+r"(wb), [x] "+r"(x), [n] "+r"(steps)
#define MT_AVX2_INPUTS [ones] "x"(ones), [k4] "r"(k4), [k4x3] "r"(k4x3)
#define MT_AVX2_CLOBBERS "xmm8", "xmm9", "xmm11", "xmm12", "xmm13", "memory", "cc"

// Rows m0 .. m0 + 3 x the 16 features of block nb: eight int32 accumulators in registers; per step of
// 4 inputs, two weight vectors shared by the rows, and per row one broadcast, two vpmaddubsw, two
// vpmaddwd and two vpaddd. With Prefetch the next block's weights are fetched into L1 meanwhile.
// The loop is written in assembly: compiled from intrinsics, GCC 12 kept one accumulator
// on the stack, a store and a reload at every step.
template <bool Prefetch>
inline void avx2_tile4(const Avx2Call& c, int64_t m0, int64_t nb) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[4][2];
  int64_t steps = c.k4 / 4;
  const int64_t k4 = c.k4;
  const int8_t* wb = c.w + nb * steps * 64;
  const uint8_t* x = c.xq + m0 * k4;
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
  const int64_t k4x3 = 3 * k4, ahead = steps * 64;
  if (steps > 0) {
    if constexpr (Prefetch) {
      asm volatile("1:\n\t" MT_AVX2_LOAD "prefetcht0 (%[w],%[ahead])\n\t" MT_AVX2_ROWS
                   : MT_AVX2_OUTPUTS : MT_AVX2_INPUTS, [ahead] "r"(ahead) : MT_AVX2_CLOBBERS);
    } else {
      asm volatile("1:\n\t" MT_AVX2_LOAD MT_AVX2_ROWS : MT_AVX2_OUTPUTS : MT_AVX2_INPUTS : MT_AVX2_CLOBBERS);
    }
  }
  acc[0][0] = a00, acc[0][1] = a01, acc[1][0] = a10, acc[1][1] = a11;
  acc[2][0] = a20, acc[2][1] = a21, acc[3][0] = a30, acc[3][1] = a31;
  avx2_store<4>(c, m0, nb, acc);
}
#endif

// x [..., K] float32 (M rows, any M) @ an int8 weight -> [..., N] float32 on AVX2 CPUs without VNNI, the
// same bits as quantize_rows, torch._int_mm and dequantize (whose oneDNN int8 product can be tens of
// times slower than float32 there). w and offset from kernels.vnni_weight(), w's values in -64..64.
torch::Tensor int8_linear_avx2(torch::Tensor x, torch::Tensor w, torch::Tensor offset, torch::Tensor col_scale,
                               std::optional<torch::Tensor> bias_opt, int64_t n) {
#ifdef MT_HAVE_AVX2_INT8
  const LayerArgs a = layer_args("int8_linear_avx2", x, w, col_scale, bias_opt, n);
  const int64_t K = a.K, M = a.M, NB = a.NB, K4 = a.K4;
  TORCH_CHECK(offset.scalar_type() == torch::kInt32 && offset.numel() == NB * 16 && offset.is_contiguous(),
              "offset must be [NB * 16] int32");
  x = x.contiguous();
  auto xq = torch::empty({M, K4}, x.options().dtype(torch::kUInt8));
  auto row_scale = torch::empty({M}, x.options());
  const float* X = x.data_ptr<float>();
  uint8_t* XQ = xq.data_ptr<uint8_t>();
  float* RS = row_scale.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [=](int64_t r0, int64_t r1) {
    const int64_t k = K, k4 = K4;   // local copies: uint8 stores may alias the closure's fields
    for (int64_t r = r0; r < r1; ++r) {
      RS[r] = quantize_row<uint8_t, 128>(X + r * k, XQ + r * k4, k);
      for (int64_t i = k; i < k4; ++i) XQ[r * k4 + i] = 128;
    }
  });
  auto out = layer_output(x, n);
  const Avx2Call c{XQ, RS, w.data_ptr<int8_t>(), offset.data_ptr<int32_t>(), col_scale.data_ptr<float>(),
                   a.bias.defined() ? a.bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), K4, n};
  // Cache blocking (each thread's share of the feature blocks): 256 KB of weights at a time stay in L2
  // while chunks of rows whose inputs fit in 4 KB of L1 (16 rows at K = 256) pass over them, so the
  // weights are read from memory once and the rows from L1; a wide layer (the 8k-vocabulary
  // projection) was 1.3x slower without it (python -m service.bench.int8_layers).
  const int64_t row_chunk = std::max<int64_t>(4, (4096 / K4) / 4 * 4);
  const int64_t block_chunk = std::max<int64_t>(1, 262144 / (K4 * 16));
  at::parallel_for(0, NB, std::max<int64_t>(1, 4096 / std::max<int64_t>(M * K4 / 4, 1)), [&](int64_t b0, int64_t b1) {
    for (int64_t n0 = b0; n0 < b1; n0 += block_chunk) {
      const int64_t n1 = std::min(b1, n0 + block_chunk);
      for (int64_t r0 = 0; r0 < M; r0 += row_chunk) {
        const int64_t r1 = std::min(M, r0 + row_chunk);
        for (int64_t nb = n0; nb < n1; ++nb) {
          int64_t m0 = r0;
          if (m0 + 4 <= r1) {
            avx2_tile4<true>(c, m0, nb);
            m0 += 4;
          }
          for (; m0 + 4 <= r1; m0 += 4) avx2_tile4<false>(c, m0, nb);
          for (; m0 < r1; ++m0) avx2_tile1(c, m0, nb);
        }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "int8_linear_avx2 is built only for AVX2 CPUs without AVX-512 VNNI (see has_int8_linear_avx2)");
#endif
}
// The compiled int8 layer of this build: the VNNI kernel or the AVX2 one (any rows); decoder_step.cpp
// calls it.
torch::Tensor int8_linear_kernel(torch::Tensor x, torch::Tensor w, torch::Tensor offset, torch::Tensor col_scale,
                                 std::optional<torch::Tensor> bias, int64_t n) {
#ifdef MT_HAVE_VNNI
  return int8_linear_vnni(x, w, offset, col_scale, bias, n);
#else
  return int8_linear_avx2(x, w, offset, col_scale, bias, n);
#endif
}

}  // namespace mt

void register_int8_linear(pybind11::module& m) {
  m.def("quantize_rows", &mt::quantize_rows, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "int8 rows with per-row scales (see int8_linear.cpp)");
  m.def("dequantize", &mt::dequantize, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "float32 from int32 products and row/column scales (see int8_linear.cpp)");
  m.def("int8_linear_vnni", &mt::int8_linear_vnni, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "a whole int8 linear layer with AVX-512 VNNI (see int8_linear.cpp)");
  m.def("int8_linear_avx2", &mt::int8_linear_avx2, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "a whole int8 linear layer on AVX2 without VNNI (see int8_linear.cpp)");
#ifdef MT_HAVE_VNNI
  m.attr("has_int8_linear_vnni") = true;
#else
  m.attr("has_int8_linear_vnni") = false;
#endif
#ifdef MT_HAVE_AVX2_INT8
  m.attr("has_int8_linear_avx2") = true;
#else
  m.attr("has_int8_linear_avx2") = false;
#endif
}
