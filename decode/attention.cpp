// A decode step's attention on a CPU with AVX2 and FMA: each slot's one query per head against the keys
// and values its cache has filled, and no further. The compiled step (model.Attention.decode_all) keeps
// static shapes, so in torch it attends over the whole preallocated cache, masked: at tiny-50m that reads
// 25 MB per slot and step for ~100 filled positions out of 1,024. Built and loaded by decode/kernel.py as
// the torch operator enlace::decode_attention.
//
// A slot's result depends only on its own query, cache and length: the same whatever the other slots
// hold, and with any number of threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float total = _mm_cvtss_f32(s);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// out[d] += weight * v[d]
void add_scaled(float* out, const float* v, float weight, int64_t n) {
  const __m256 w = _mm256_set1_ps(weight);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
  for (; i < n; ++i) out[i] += weight * v[i];
}

// One (slot, kv head): the `group` queries that read it, over positions [0, end). q and out: (group, dim);
// keys and values: (max_len, dim).
void attend(const float* q, const float* keys, const float* values, int64_t end, int64_t group, int64_t dim,
            float* out, std::vector<float>& scores) {
  std::fill(out, out + group * dim, 0.f);
  if (end == 0) return;  // a slot not in use: zeros, as the eager step leaves it
  scores.resize(end);
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * dim;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < end; ++t) top = std::max(top, scores[t] = dot(qg, keys + t * dim, dim));
    float total = 0.f;
    for (int64_t t = 0; t < end; ++t) total += scores[t] = std::exp(scores[t] - top);
    float* og = out + g * dim;
    for (int64_t t = 0; t < end; ++t) add_scaled(og, values + t * dim, scores[t], dim);
    const float inverse = 1.f / total;
    for (int64_t d = 0; d < dim; ++d) og[d] *= inverse;
  }
}

// q (slots, kv_heads, group, dim), already scaled by dim^-0.5; keys and values (slots, kv_heads, max_len,
// dim); ends (slots,) int64: positions each slot sees, 0 for a slot not in use. Returns q's shape.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& ends) {
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu(), "enlace::decode_attention runs on the CPU");
  TORCH_CHECK(
      q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
      "enlace::decode_attention: q, keys and values must be float32");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && keys.sizes() == values.sizes(),
              "enlace::decode_attention: q (slots, kv_heads, group, dim), keys and values (slots, kv_heads, "
              "max_len, dim)");
  const int64_t slots = q.size(0), heads = q.size(1), group = q.size(2), dim = q.size(3);
  const int64_t max_len = keys.size(2);
  TORCH_CHECK(keys.size(0) == slots && keys.size(1) == heads && keys.size(3) == dim,
              "enlace::decode_attention: keys ", keys.sizes(), " do not match q ", q.sizes());
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous();
  const at::Tensor ec = ends.to(at::kLong).contiguous();
  TORCH_CHECK(ec.numel() == slots, "enlace::decode_attention: one end per slot");
  const int64_t* end = ec.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s)
    TORCH_CHECK(end[s] >= 0 && end[s] <= max_len, "enlace::decode_attention: end ", end[s], " of slot ", s,
                " is outside 0..", max_len);
  at::Tensor out = at::empty_like(qc);
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, slots * heads, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> scores;
    for (int64_t i = begin; i < stop; ++i) {
      const int64_t slot = i / heads;
      attend(qp + i * group * dim, kp + i * max_len * dim, vp + i * max_len * dim, end[slot], group, dim,
             op + i * group * dim, scores);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(enlace, lib) {
  lib.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor ends) -> Tensor");
}

TORCH_LIBRARY_IMPL(enlace, CPU, lib) { lib.impl("decode_attention", &decode_attention); }
