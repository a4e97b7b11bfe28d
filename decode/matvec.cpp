// The decode step's matrix products on a CPU with AVX2 and FMA: y = x @ weight.T for the few rows of a
// decode step (one per stream), over float32 or int8 weights. Decoding reads every weight once per token,
// so the product is bound by memory bandwidth; torch's kernels for one row read at about half of it here
// (docs/rendimiento.md). Built and loaded by decode/kernel.py as the torch operator enlace::matvec.
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

constexpr int kWeightRows = 8;      // float32: weight rows read side by side, one memory stream each
constexpr int kTileRows = 4;        // float32, several input rows: weight rows x input rows per tile,
constexpr int kTileInputs = 3;      // 12 accumulators, 3 inputs and a weight: AVX2's 16 registers
constexpr int kInt8InputRows = 4;   // int8: input rows sharing one weight row's loads
constexpr int64_t kInt8Block = 16;  // int8: weight rows (8-22 KB) that meet every input row in cache
constexpr int kChains = 2;          // int8: independent accumulators per row (an add waits on its latency)
constexpr float kInt16Top = 16383;  // |x| rounds to at most 2^14 - 1: 127 * 16383 * 2 fits an int32 lane
constexpr int64_t kChunk = 4096;    // int32 lanes summed to float every kChunk columns: no overflow
constexpr int64_t kMinBlocks = 4;   // fewest blocks of weight rows a thread takes

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[j + r] = sum_i w[(j + r) * k + i] * x[i] for R weight rows from j and one input row x. One
// accumulator per weight row, 8 columns a step: reading R weight rows at once keeps R memory streams in
// flight, which one row at a time does not (measured on 2 cores: 1.2-1.4x the bytes per second with 8
// rows than with one, alone and among 8 input rows). Each sum's order is the same for any R.
template <int R>
void block_f32(const float* w, const float* x, float* y, int64_t k, int64_t j) {
  const int64_t body = k - k % 8;
  const float* wj = w + j * k;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < body; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(wj + r * k + i), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum(acc[r]);
    for (int64_t i = body; i < k; ++i) s += wj[r * k + i] * x[i];
    y[j + r] = s;
  }
}

// The same sums for R weight rows against M input rows at once: each weight load serves M input rows and
// each input load R weight rows, where one input row at a time makes one load per multiply-add (several
// input rows are bound by the loads, not by memory: measured). R x M accumulators, each (weight row, input
// row) sum in block_f32's order: bit for bit the sums one input row at a time.
template <int R, int M>
void tile_f32(const float* w, const float* x, float* y, int64_t k, int64_t n, int64_t j) {
  const int64_t body = k - k % 8;
  const float* wj = w + j * k;
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < M; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < body; i += 8) {
    __m256 xv[M];
    for (int c = 0; c < M; ++c) xv[c] = _mm256_loadu_ps(x + c * k + i);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(wj + r * k + i);
      for (int c = 0; c < M; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < M; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t i = body; i < k; ++i) s += wj[r * k + i] * x[c * k + i];
      y[c * n + j + r] = s;
    }
}

// Weight rows [j, j + R) against each of the m input rows: the block is read from memory once and from
// cache for the next input rows. One input row reads R rows side by side (memory streams); more take
// kTileRows weight rows against up to kTileInputs input rows at a time.
template <int R>
void rows_f32(const float* w, const float* x, float* y, int64_t m, int64_t k, int64_t n, int64_t j) {
  if (m == 1 || R % kTileRows != 0) {
    for (int64_t r = 0; r < m; ++r) block_f32<R>(w, x + r * k, y + r * n, k, j);
    return;
  }
  for (int64_t h = j; h < j + R; h += kTileRows)
    for (int64_t r = 0; r < m;) {
      const int64_t take = std::min<int64_t>(kTileInputs, m - r);
      const float* xr = x + r * k;
      float* yr = y + r * n;
      switch (take) {
        case 1: tile_f32<kTileRows, 1>(w, xr, yr, k, n, h); break;
        case 2: tile_f32<kTileRows, 2>(w, xr, yr, k, n, h); break;
        default: tile_f32<kTileRows, kTileInputs>(w, xr, yr, k, n, h); break;
      }
      r += take;
    }
}

// The same over int8 weights (one scale per weight row) and x rounded to int16 (one scale per input row):
// vpmaddwd multiplies 16 pairs and adds neighbours into 8 int32 lanes, exact, half the instructions of
// converting every weight to float. Weight rows [begin, end) one at a time against R input rows (here a
// weight row at a time reads as fast as several: measured).
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

// Weight rows [begin, end) against all m input rows, kInt8InputRows at a time.
void block_int8(const int8_t* w, const float* w_scale, const int16_t* x, const float* x_scale, float* y,
                int64_t m, int64_t k, int64_t n, int64_t begin, int64_t end) {
  for (int64_t r = 0; r < m;) {
    const int64_t take = std::min<int64_t>(kInt8InputRows, m - r);
    const int16_t* xr = x + r * k;
    const float* sr = x_scale + r;
    float* yr = y + r * n;
    switch (take) {
      case 1: rows_int8<1>(w, w_scale, xr, sr, yr, k, n, begin, end); break;
      case 2: rows_int8<2>(w, w_scale, xr, sr, yr, k, n, begin, end); break;
      case 3: rows_int8<3>(w, w_scale, xr, sr, yr, k, n, begin, end); break;
      default: rows_int8<4>(w, w_scale, xr, sr, yr, k, n, begin, end); break;
    }
    r += take;
  }
}

// Every input row against weight rows [begin, end): float32 kWeightRows at a time (the last few one by
// one), int8 kInt8Block at a time; each block of weight rows meets all the input rows while in cache.
// y's rows are ldy apart (several weights' products side by side).
void all_rows(const at::Tensor& w, const float* w_scale, const float* x, const int16_t* x16,
              const float* x_scale, float* y, int64_t m, int64_t k, int64_t ldy, int64_t begin, int64_t end) {
  if (w.scalar_type() == at::kFloat) {
    const float* wp = w.data_ptr<float>();
    int64_t j = begin;
    for (; j + kWeightRows <= end; j += kWeightRows) rows_f32<kWeightRows>(wp, x, y, m, k, ldy, j);
    for (; j < end; ++j) rows_f32<1>(wp, x, y, m, k, ldy, j);
  } else {
    const int8_t* wp = w.data_ptr<int8_t>();
    for (int64_t j = begin; j < end; j += kInt8Block)
      block_int8(wp, w_scale, x16, x_scale, y, m, k, ldy, j, std::min(end, j + kInt8Block));
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

// The products of x with several weights of the same width and dtype (a layer's q, k and v; gate and
// up), side by side in one output: one call and one pass of the threads instead of one per weight, and x
// rounded once. Each product is the one matvec gives alone. int8 weights take their row scales in one
// tensor, weight after weight.
at::Tensor matvecs(const at::Tensor& x, at::TensorList weights, const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(!weights.empty(), "enlace::matvecs: no weights");
  TORCH_CHECK(x.device().is_cpu(), "enlace::matvec runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "enlace::matvec: x must be float32, got ", x.scalar_type());
  const bool int8 = weights[0].scalar_type() == at::kChar;
  const int64_t k = weights[0].dim() == 2 ? weights[0].size(1) : -1;
  TORCH_CHECK(int8 == scale.has_value(), "enlace::matvec: int8 weights need their row scales, float32 none");
  std::vector<int64_t> offsets{0};      // where each weight's products start in a row of y
  std::vector<int64_t> first_block{0};  // the blocks of weight rows the threads share, weight by weight
  const int64_t block = int8 ? kInt8Block : kWeightRows;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.device().is_cpu(), "enlace::matvec runs on the CPU");
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "enlace::matvec: weight must be a contiguous matrix");
    TORCH_CHECK(w.scalar_type() == (int8 ? at::kChar : at::kFloat),
                "enlace::matvec: weight must be float32 or int8, all the weights of a call alike");
    TORCH_CHECK(w.size(1) == k, "enlace::matvec: x has ", x.size(-1), " columns, weight ", w.size(1));
    offsets.push_back(offsets.back() + w.size(0));
    first_block.push_back(first_block.back() + (w.size(0) + block - 1) / block);
  }
  TORCH_CHECK(x.size(-1) == k, "enlace::matvec: x has ", x.size(-1), " columns, weight ", k);
  if (int8)
    TORCH_CHECK(
        scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == offsets.back(),
        "enlace::matvec: scale must be float32 with one value per weight row");
  const float* w_scale = int8 ? scale->data_ptr<float>() : nullptr;
  const at::Tensor rows = x.is_contiguous() ? x : x.contiguous();
  const int64_t m = rows.numel() / k, ldy = offsets.back();
  const float* xp = rows.data_ptr<float>();
  std::vector<int16_t> x16(int8 ? m * k : 0);
  std::vector<float> x_scale(int8 ? m : 0);
  if (int8) round_rows(xp, m, k, x16.data(), x_scale.data());
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = ldy;
  at::Tensor y = at::empty(shape, x.options());
  float* yp = y.data_ptr<float>();
  // One contiguous share of the blocks per thread (at least kMinBlocks each).
  const int64_t blocks = first_block.back(), threads = at::get_num_threads();
  const int64_t grain = std::max(kMinBlocks, (blocks + threads - 1) / threads);
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    size_t i = 0;
    for (int64_t b = first; b < last; ++b) {
      while (b >= first_block[i + 1]) ++i;
      const int64_t n = weights[i].size(0), begin = (b - first_block[i]) * block;
      all_rows(weights[i], int8 ? w_scale + offsets[i] : nullptr, xp, x16.data(), x_scale.data(),
               yp + offsets[i], m, k, ldy, begin, std::min(n, begin + block));
    }
  });
  return y;
}

at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(weight.scalar_type() == at::kChar || weight.scalar_type() == at::kFloat,
              "enlace::matvec: weight must be float32 or int8");
  TORCH_CHECK((weight.scalar_type() == at::kChar) == scale.has_value(),
              "enlace::matvec: int8 weights need their row scales, float32 none");
  return matvecs(x, {weight}, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(enlace, lib) {
  lib.def("matvec(Tensor x, Tensor weight, Tensor? scale) -> Tensor");
  lib.def("matvecs(Tensor x, Tensor[] weights, Tensor? scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(enlace, CPU, lib) {
  lib.impl("matvec", &matvec);
  lib.impl("matvecs", &matvecs);
}
