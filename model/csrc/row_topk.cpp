// Per row, the k largest entries of a [N, V] matrix (values descending, ties to the lower index) in
// one pass over the row: a candidate is compared with the current k-th best, and only the rare ones
// above it are inserted into a small sorted list. Beam search needs the top 2k of 8k log-probs per
// hypothesis; torch.topk (or chunk maxima + topk, model/decoding.py's eager path) reads each row
// several times. Each row is computed by itself, so the result does not depend on the other rows.
//
// Built with decode_attention.cpp into one extension by model/kernels.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

template <typename scalar_t>
void topk_rows(const scalar_t* X, int64_t N, int64_t V, int64_t k, scalar_t* values, int64_t* ids) {
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(V, 1)), [=](int64_t r0, int64_t r1) {
    const int64_t n = V, kk = k;
    std::vector<scalar_t> best_v(kk);
    std::vector<int64_t> best_i(kk);
    // put (v, t) into the sorted best_v[0..size) (size < kk: a new entry; else it replaces the last),
    // after the entries >= v: among equal values the earlier index stays first
    auto insert = [&](scalar_t v, int64_t t, int64_t size) {
      int64_t p = std::min(size, kk - 1);
      while (p > 0 && best_v[p - 1] < v) {
        best_v[p] = best_v[p - 1];
        best_i[p] = best_i[p - 1];
        --p;
      }
      best_v[p] = v;
      best_i[p] = t;
    };
    for (int64_t r = r0; r < r1; ++r) {
      const scalar_t* __restrict x = X + r * n;
      for (int64_t j = 0; j < kk; ++j) insert(x[j], j, j);   // start from the first k entries, sorted
      constexpr int64_t B = 32;
      int64_t j = kk;
      for (; j + B <= n; j += B) {
        const scalar_t* __restrict xb = x + j;
        const scalar_t thr = best_v[kk - 1];
        int above = 0;
        for (int t = 0; t < B; ++t) above += xb[t] > thr;      // a fixed-size, vectorized test
        if (above == 0) continue;
        for (int64_t t = j; t < j + B; ++t) {
          if (x[t] > best_v[kk - 1]) insert(x[t], t, kk);      // strictly greater: earlier index wins ties
        }
      }
      for (; j < n; ++j) {
        if (x[j] > best_v[kk - 1]) insert(x[j], j, kk);
      }
      std::copy(best_v.begin(), best_v.end(), values + r * kk);
      std::copy(best_i.begin(), best_i.end(), ids + r * kk);
    }
  });
}

// x [N, V] float32/float64 -> (values [N, k] descending, ids [N, k] int64); 1 <= k <= V.
std::vector<torch::Tensor> row_topk(torch::Tensor x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "row_topk takes a 2-d CPU tensor");
  TORCH_CHECK(k >= 1 && k <= x.size(1), "k must be in 1..", x.size(1), ", got ", k);
  x = x.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  auto values = torch::empty({N, k}, x.options());
  auto ids = torch::empty({N, k}, x.options().dtype(torch::kLong));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "row_topk", [&] {
    topk_rows<scalar_t>(x.data_ptr<scalar_t>(), N, V, k, values.data_ptr<scalar_t>(), ids.data_ptr<int64_t>());
  });
  return {values, ids};
}

}  // namespace

void register_row_topk(pybind11::module& m) {
  m.def("row_topk", &row_topk, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "per-row top-k in one pass (see row_topk.cpp)");
}
