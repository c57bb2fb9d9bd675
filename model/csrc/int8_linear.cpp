// The two elementwise halves of an int8 linear layer with dynamic per-row activation scales
// (model/linear.py): quantize each input row with its own scale, and turn the exact int32 products
// back into float32 with the row's and the output feature's scales. In eager PyTorch each half is
// five or six passes over the data with a temporary per pass, which costs more than the int8 matrix
// product itself at decoding sizes; here each is one pass. Every element is computed by itself, so a
// row's result does not depend on the other rows of the call.
//
// Built with decode_attention.cpp into one extension by model/kernels.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {

// x [M, K] float32 -> (q [M, K] int8, scale [M] float32): scale = max|x_row| / 127 (1 for an all-zero
// row), q = round-half-even(x / scale), the same arithmetic as the eager path in model/linear.py.
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
    for (int64_t r = r0; r < r1; ++r) {
      const float* __restrict xr = X + r * K;
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t i = 0; i < K; ++i) amax = std::max(amax, std::fabs(xr[i]));
      float s = amax / 127.0f;
      if (!(s > 0.f)) s = 1.0f;
      S[r] = s;
      int8_t* __restrict qr = Q + r * K;  // restrict: an int8_t store may alias anything otherwise
      // rint: round half to even in the default rounding mode, like torch.round (and, unlike
      // nearbyint, inlined and vectorized)
      for (int64_t i = 0; i < n; ++i) {
        const float v = std::rint(xr[i] / s);
        qr[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
      }
    }
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

}  // namespace

void register_int8_linear(pybind11::module& m) {
  m.def("quantize_rows", &quantize_rows, "int8 rows with per-row scales (see int8_linear.cpp)");
  m.def("dequantize", &dequantize, "float32 from int32 products and row/column scales (see int8_linear.cpp)");
}
