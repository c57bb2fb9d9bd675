// Per row, the k largest entries of a [N, V] matrix (values descending, ties to the lower index) in
// one pass over the row: a candidate is compared with the current k-th best, and only the rare ones
// above it are inserted into a small sorted list. Beam search needs the top 2k of 8k log-probs per
// hypothesis; torch.topk (or chunk maxima + topk, model/inference/step.py's eager path) reads each row
// several times. Each row is computed by itself, so the result does not depend on the other rows.
//
// Built with decode_attention.cpp into one extension by model/inference/kernels.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// The k largest entries of one row x[0..n) into best_v/best_i (descending; ties to the lower index),
// skipping index `skip` (-1: none).
template <typename scalar_t>
void topk_row(const scalar_t* __restrict x, int64_t n, int64_t kk, int64_t skip, std::vector<scalar_t>& best_v,
              std::vector<int64_t>& best_i) {
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
  int64_t j = 0, size = 0;
  for (; size < kk; ++j) {                       // start from the first k entries (but `skip`), sorted
    if (j == skip) continue;
    insert(x[j], j, size);
    ++size;
  }
  constexpr int64_t B = 32;
  for (; j + B <= n; j += B) {
    const scalar_t* __restrict xb = x + j;
    const scalar_t thr = best_v[kk - 1];
    int above = 0;
    for (int t = 0; t < B; ++t) above += xb[t] > thr;      // a fixed-size, vectorized test
    if (above == 0) continue;
    for (int64_t t = j; t < j + B; ++t) {
      if (x[t] > best_v[kk - 1] && t != skip) insert(x[t], t, kk);   // strictly greater: earlier index wins ties
    }
  }
  for (; j < n; ++j) {
    if (x[j] > best_v[kk - 1] && j != skip) insert(x[j], j, kk);
  }
}

template <typename scalar_t>
void topk_rows(const scalar_t* X, int64_t N, int64_t V, int64_t k, scalar_t* values, int64_t* ids) {
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(V, 1)), [=](int64_t r0, int64_t r1) {
    std::vector<scalar_t> best_v(k);
    std::vector<int64_t> best_i(k);
    for (int64_t r = r0; r < r1; ++r) {
      topk_row(X + r * V, V, k, -1, best_v, best_i);
      std::copy(best_v.begin(), best_v.end(), values + r * k);
      std::copy(best_i.begin(), best_i.end(), ids + r * k);
    }
  });
}

// log(sum_j e^(x_j - max)) of one row (x_j - max <= 0), with max = its largest entry
inline float log_sum_exp_shifted(const float* __restrict x, int64_t n, float max) {
  int64_t j = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  using mt::exp_nonpositive;
  const __m256 m = _mm256_set1_ps(max);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    acc0 = _mm256_add_ps(acc0, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + j), m)));
    acc1 = _mm256_add_ps(acc1, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), m)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(acc0, acc1));
  for (int t = 0; t < 8; ++t) sum += lanes[t];
#endif
  for (; j < n; ++j) sum += std::exp(x[j] - max);
  return std::log(sum);
}

// x [N, V] float32 logits -> the top k of each row's log-softmax, (values [N, k] descending, ids [N, k]),
// without writing the [N, V] log-probabilities: per row the top k of x itself (the map x -> x - max -
// log-sum is increasing), its maximum (the best of them, or the banned entry), log(sum e^(x - max))
// (every entry counts, the banned one too), then values = (x - max) - log-sum, the formula of
// torch.log_softmax (the sum's rounding differs from ATen's in the last bits). banned [N] int64: a token id each row's top k leaves out (-1: none); beam
// search bans EOS before min_new_tokens without renormalising. Rows are independent of each other.
std::vector<torch::Tensor> log_softmax_topk(torch::Tensor x, int64_t k, torch::Tensor banned) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == torch::kFloat32,
              "log_softmax_topk takes a 2-d float32 CPU tensor");
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k < V, "k must be in 1..", V - 1, ", got ", k);
  TORCH_CHECK(banned.scalar_type() == torch::kLong && banned.dim() == 1 && banned.numel() == N && banned.device().is_cpu(),
              "banned must be [N] int64");
  x = x.contiguous();
  banned = banned.contiguous();
  auto values = torch::empty({N, k}, x.options());
  auto ids = torch::empty({N, k}, x.options().dtype(torch::kLong));
  const float* X = x.data_ptr<float>();
  const int64_t* B = banned.data_ptr<int64_t>();
  float* OV = values.data_ptr<float>();
  int64_t* OI = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r)
    TORCH_CHECK(B[r] >= -1 && B[r] < V, "banned[", r, "] = ", B[r], " is outside -1..", V - 1);
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(V, 1)), [=](int64_t r0, int64_t r1) {
    std::vector<float> best_v(k);
    std::vector<int64_t> best_i(k);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = X + r * V;
      topk_row(row, V, k, B[r], best_v, best_i);
      // the row's maximum: its best entry, or the banned one (left out of the top k only)
      const float max = B[r] >= 0 ? std::max(best_v[0], row[B[r]]) : best_v[0];
      const float log_sum = log_sum_exp_shifted(row, V, max);
      for (int64_t j = 0; j < k; ++j) {
        OV[r * k + j] = (best_v[j] - max) - log_sum;
        OI[r * k + j] = best_i[j];
      }
    }
  });
  return {values, ids};
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

// Beam search's ranking of many sentences at once (model/inference/search.py's rank_candidates; the python
// sort of BeamSearch._beam_step is the reference): sentence s owns rows first[s] .. first[s] +
// count[s] - 1 of top_v/top_i (its alive hypotheses, whose log-probs are the next count[s] entries of
// prefix) and reads the first w = min(2k, W) columns of each; candidate = (prefix + top_v[row, j] in
// double, row - first[s], top_i[row, j]); its best t = min(2k, count * w), best first, ties by row
// then token id (NaN after every number). Returns (log_probs [S, T] float64, parents [S, T] int64,
// tokens [S, T] int64), T = the largest t; entries past a sentence's t: NaN / -1 / -1.
struct Candidate {
  double lp;
  int64_t row;
  int64_t id;
};

inline bool ranks_before(const Candidate& a, const Candidate& b) {
  const bool an = std::isnan(a.lp), bn = std::isnan(b.lp);
  if (an != bn) return bn;                       // a number before NaN
  if (!an && a.lp != b.lp) return a.lp > b.lp;
  return a.row != b.row ? a.row < b.row : a.id < b.id;
}

template <typename scalar_t>
void rank_sentences(const scalar_t* V, const int64_t* I, const double* P, const int64_t* F, const int64_t* C,
                    const int64_t* K, int64_t S, int64_t W, int64_t T, double* OL, int64_t* OP, int64_t* OT) {
  std::vector<Candidate> c;
  for (int64_t s = 0; s < S; ++s, P += C[s - 1]) {
    const int64_t w = std::min(2 * K[s], W);
    c.clear();
    for (int64_t r = 0; r < C[s]; ++r) {
      const int64_t row = F[s] + r;
      for (int64_t j = 0; j < w; ++j) c.push_back({P[r] + static_cast<double>(V[row * W + j]), r, I[row * W + j]});
    }
    const int64_t t = std::min<int64_t>(2 * K[s], static_cast<int64_t>(c.size()));
    std::partial_sort(c.begin(), c.begin() + t, c.end(), ranks_before);
    for (int64_t j = 0; j < T; ++j) {
      const bool real = j < t;
      OL[s * T + j] = real ? c[j].lp : std::numeric_limits<double>::quiet_NaN();
      OP[s * T + j] = real ? c[j].row : -1;
      OT[s * T + j] = real ? c[j].id : -1;
    }
  }
}

std::vector<torch::Tensor> rank_beams(torch::Tensor top_v, torch::Tensor top_i, torch::Tensor prefix,
                                      torch::Tensor first, torch::Tensor count, torch::Tensor beam) {
  TORCH_CHECK(top_v.dim() == 2 && top_v.device().is_cpu() &&
              (top_v.scalar_type() == torch::kFloat32 || top_v.scalar_type() == torch::kFloat64),
              "rank_beams: top_v must be a 2-d float32/float64 CPU tensor");
  const int64_t N = top_v.size(0), W = top_v.size(1), S = beam.numel();
  TORCH_CHECK(top_i.scalar_type() == torch::kLong && top_i.sizes() == top_v.sizes() && top_i.device().is_cpu(),
              "rank_beams: top_i must be int64 of top_v's shape");
  for (const auto* t : {&first, &count, &beam})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->dim() == 1 && t->numel() == S && t->device().is_cpu(),
                "rank_beams: first, count and beam must be [S] int64 CPU tensors");
  top_v = top_v.contiguous(); top_i = top_i.contiguous(); prefix = prefix.contiguous();
  first = first.contiguous(); count = count.contiguous(); beam = beam.contiguous();
  const int64_t* F = first.data_ptr<int64_t>();
  const int64_t* C = count.data_ptr<int64_t>();
  const int64_t* K = beam.data_ptr<int64_t>();
  int64_t T = 0, R = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(C[s] >= 1 && F[s] >= 0 && F[s] + C[s] <= N, "rank_beams: sentence ", s, "'s rows ", F[s], " + ",
                C[s], " are outside 0..", N);
    TORCH_CHECK(K[s] >= 1, "rank_beams: beam[", s, "] = ", K[s], " < 1");
    T = std::max(T, std::min(2 * K[s], C[s] * std::min(2 * K[s], W)));
    R += C[s];
  }
  TORCH_CHECK(prefix.scalar_type() == torch::kDouble && prefix.dim() == 1 && prefix.numel() == R && prefix.device().is_cpu(),
              "rank_beams: prefix must be [sum(count)] float64");
  auto lp = torch::empty({S, T}, prefix.options());
  auto parents = torch::empty({S, T}, first.options());
  auto tokens = torch::empty({S, T}, first.options());
  AT_DISPATCH_FLOATING_TYPES(top_v.scalar_type(), "rank_beams", [&] {
    rank_sentences<scalar_t>(top_v.data_ptr<scalar_t>(), top_i.data_ptr<int64_t>(), prefix.data_ptr<double>(), F, C,
                             K, S, W, T, lp.data_ptr<double>(), parents.data_ptr<int64_t>(), tokens.data_ptr<int64_t>());
  });
  return {lp, parents, tokens};
}

}  // namespace

void register_row_topk(pybind11::module& m) {
  m.def("row_topk", &row_topk, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "per-row top-k in one pass (see row_topk.cpp)");
  m.def("log_softmax_topk", &log_softmax_topk, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "per-row top-k of log_softmax without the [N, V] log-probabilities (see row_topk.cpp)");
  m.def("rank_beams", &rank_beams, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "beam search's ranking of many sentences' candidates at once (see row_topk.cpp)");
}
