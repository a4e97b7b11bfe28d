// The decode step's matrix products on a CPU with AVX2 and FMA: y = x @ weight.T for the few rows of a
// decode step (one per stream), over float32 or int8 weights. Decoding reads every weight once per token,
// so the product is bound by memory bandwidth; torch's kernels for one row read at about half of it here
// (docs/rendimiento.md). Built and loaded by serve/kernel.py as the torch operator enlace::matvec.
//
// Each output row's sum is computed in the same order whatever the other rows of the step and the number
// of threads: a stream's answer does not depend on who else is decoding.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int kMaxRows = 4;         // input rows sharing one pass over a block of weight rows
constexpr int kChains = 2;          // independent accumulators per row (an FMA waits on its own latency)
constexpr float kInt16Top = 16383;  // |x| rounds to at most 2^14 - 1: 127 * 16383 * 2 fits an int32 lane
constexpr int64_t kChunk = 4096;    // int32 lanes summed to float every kChunk columns: no overflow
constexpr int64_t kGrain = 16;      // fewest weight rows a thread takes

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[r * n + j] = sum_i w[j * k + i] * x[r * k + i] for weight rows j in [begin, end) and R input rows.
template <int R>
void rows_f32(const float* w, const float* x, float* y, int64_t k, int64_t n, int64_t begin, int64_t end) {
  constexpr int64_t step = 8 * kChains;
  const int64_t body = k - k % step;
  for (int64_t j = begin; j < end; ++j) {
    const float* wj = w + j * k;
    __m256 acc[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < body; i += step) {
      for (int c = 0; c < kChains; ++c) {
        const __m256 wv = _mm256_loadu_ps(wj + i + 8 * c);
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * k + i + 8 * c), acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 sum = acc[r][0];
      for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[r][c]);
      float s = hsum(sum);
      for (int64_t i = body; i < k; ++i) s += wj[i] * x[r * k + i];
      y[r * n + j] = s;
    }
  }
}

// The same over int8 weights (one scale per weight row) and x rounded to int16 (one scale per input row):
// vpmaddwd multiplies 16 pairs and adds neighbours into 8 int32 lanes, exact, half the instructions of
// converting every weight to float — the int8 product is bound by instructions, not bytes, on 2 cores.
template <int R>
void rows_int8(const int8_t* w, const float* w_scale, const int16_t* x, const float* x_scale, float* y,
               int64_t k, int64_t n, int64_t begin, int64_t end) {
  constexpr int64_t step = 16 * kChains;
  for (int64_t j = begin; j < end; ++j) {
    const int8_t* wj = w + j * k;
    float total[R] = {};
    for (int64_t start = 0; start < k; start += kChunk) {
      const int64_t stop = std::min(k, start + kChunk);
      const int64_t body = start + (stop - start) - (stop - start) % step;
      __m256i acc[R][kChains];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kChains; ++c) acc[r][c] = _mm256_setzero_si256();
      for (int64_t i = start; i < body; i += step) {
        for (int c = 0; c < kChains; ++c) {
          const __m256i wv =
              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj + i + 16 * c)));
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * k + i + 16 * c));
            acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(wv, xv));
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        __m256i sum = acc[r][0];
        for (int c = 1; c < kChains; ++c) sum = _mm256_add_epi32(sum, acc[r][c]);
        int64_t tail = 0;
        for (int64_t i = body; i < stop; ++i) tail += int64_t(wj[i]) * x[r * k + i];
        total[r] += hsum(_mm256_cvtepi32_ps(sum)) + float(tail);
      }
    }
    for (int r = 0; r < R; ++r) y[r * n + j] = total[r] * w_scale[j] * x_scale[r];
  }
}

// Every input row through rows_f32 / rows_int8, kMaxRows at a time, for weight rows [begin, end).
void all_rows(const at::Tensor& w, const float* w_scale, const float* x, const int16_t* x16, const float* x_scale,
              float* y, int64_t m, int64_t k, int64_t n, int64_t begin, int64_t end) {
  for (int64_t r = 0; r < m;) {
    const int64_t take = std::min<int64_t>(kMaxRows, m - r);
    if (w.scalar_type() == at::kFloat) {
      const float* wp = w.data_ptr<float>();
      const float* xr = x + r * k;
      float* yr = y + r * n;
      switch (take) {
        case 1: rows_f32<1>(wp, xr, yr, k, n, begin, end); break;
        case 2: rows_f32<2>(wp, xr, yr, k, n, begin, end); break;
        case 3: rows_f32<3>(wp, xr, yr, k, n, begin, end); break;
        default: rows_f32<4>(wp, xr, yr, k, n, begin, end); break;
      }
    } else {
      const int8_t* wp = w.data_ptr<int8_t>();
      const int16_t* xr = x16 + r * k;
      const float* sr = x_scale + r;
      float* yr = y + r * n;
      switch (take) {
        case 1: rows_int8<1>(wp, w_scale, xr, sr, yr, k, n, begin, end); break;
        case 2: rows_int8<2>(wp, w_scale, xr, sr, yr, k, n, begin, end); break;
        case 3: rows_int8<3>(wp, w_scale, xr, sr, yr, k, n, begin, end); break;
        default: rows_int8<4>(wp, w_scale, xr, sr, yr, k, n, begin, end); break;
      }
    }
    r += take;
  }
}

// x's rows rounded to int16 with one scale each (absmax / kInt16Top): the activation keeps 14 bits, far
// finer than the weights' 8, so the product stays a weight-only quantization in effect.
void round_rows(const float* x, int64_t m, int64_t k, int16_t* x16, float* scale) {
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    float top = 0.f;
    for (int64_t i = 0; i < k; ++i) top = std::max(top, std::abs(xr[i]));
    scale[r] = top > 0.f ? top / kInt16Top : 1.f;
    const float inverse = 1.f / scale[r];
    for (int64_t i = 0; i < k; ++i) x16[r * k + i] = int16_t(std::nearbyint(xr[i] * inverse));
  }
}

at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "enlace::matvec runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "enlace::matvec: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "enlace::matvec: weight must be a contiguous matrix");
  const bool int8 = weight.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || weight.scalar_type() == at::kFloat, "enlace::matvec: weight must be float32 or int8");
  TORCH_CHECK(int8 == scale.has_value(), "enlace::matvec: int8 weights need their row scales, float32 none");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.size(-1) == k, "enlace::matvec: x has ", x.size(-1), " columns, weight ", k);
  const at::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t m = rows.size(0);
  const float* w_scale = nullptr;
  at::Tensor scale_f;
  if (int8) {
    scale_f = scale->contiguous();
    TORCH_CHECK(scale_f.scalar_type() == at::kFloat && scale_f.numel() == n,
                "enlace::matvec: scale must be float32 with one value per weight row");
    w_scale = scale_f.data_ptr<float>();
  }
  std::vector<int16_t> x16(int8 ? m * k : 0);
  std::vector<float> x_scale(int8 ? m : 0);
  if (int8) round_rows(rows.data_ptr<float>(), m, k, x16.data(), x_scale.data());
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = rows.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max(kGrain, (n + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    all_rows(weight, w_scale, xp, x16.data(), x_scale.data(), yp, m, k, n, begin, end);
  });
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(enlace, lib) { lib.def("matvec(Tensor x, Tensor weight, Tensor? scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(enlace, CPU, lib) { lib.impl("matvec", &matvec); }
