// The small operations of a decoder layer between its matrix products, one call each, for the fused forward
// (pipeline/runtime/fused.py; loaded by pipeline/runtime/decoder_ops.py).
//
// Why: at one token a product streams its weight (12 MB for bench-qwen's gate/up) through the caches, and every
// torch operation after it runs cold: an RMSNorm after a product took ~80 us against ~10 us warm, an add ~5 us
// against ~1. A layer has ~30 such operations (norms, residual adds, RoPE, the KV write, SiLU); here they are
// three calls that each do their row's work in one pass.
//
// The arithmetic is torch's, rounding where torch rounds: each torch operation rounds its result to the tensor's
// dtype, so bf16 results are stored (rounded) and reloaded at the same points. Built without FMA contraction
// (-ffp-contract=off), so that float32 a*b + c*d rounds as torch's separate multiply and add do.
// A plain C ABI and no torch headers: it compiles in a fraction of a second. One thread: the rows are small.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "native_elements.h"

namespace {

using qvpic::BFloat16;
using qvpic::Float32;

template <class E>
inline float round_trip(float x) { return E::load(E::store(x)); }

// hidden[r] += delta[r] (when delta is given), then out[r] = weight * rms_norm(hidden[r]): transformers'
// Qwen2RMSNorm (the variance in float32, the normalised row rounded to the dtype, then times the weight).
// Rows r < n; each row `dim` contiguous values, rows `*_stride` elements apart.
template <class E>
void add_rms_norm(typename E::T* hidden, int64_t hidden_stride, const typename E::T* delta, int64_t delta_stride,
                  const typename E::T* weight, typename E::T* out, int64_t out_stride, int64_t n, int64_t dim,
                  float eps) {
  for (int64_t r = 0; r < n; r++) {
    typename E::T* h = hidden + r * hidden_stride;
    typename E::T* o = out + r * out_stride;
    float squares = 0.f;
    if (delta != nullptr) {
      const typename E::T* d = delta + r * delta_stride;
      for (int64_t c = 0; c < dim; c++) {
        const typename E::T sum = E::store(E::load(h[c]) + E::load(d[c]));
        h[c] = sum;
        const float v = E::load(sum);
        squares += v * v;
      }
    } else {
      for (int64_t c = 0; c < dim; c++) {
        const float v = E::load(h[c]);
        squares += v * v;
      }
    }
    const float inverse = 1.f / std::sqrt(squares / float(dim) + eps);
#pragma omp simd
    for (int64_t c = 0; c < dim; c++)
      o[c] = E::store(E::load(weight[c]) * round_trip<E>(E::load(h[c]) * inverse));
  }
}

// out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:]: SiLU rounded to the dtype, then the product.
template <class E>
void silu_mul(const typename E::T* gate_up, typename E::T* out, int64_t n, int64_t inter) {
  for (int64_t r = 0; r < n; r++) {
    const typename E::T* g = gate_up + r * 2 * inter;
    const typename E::T* u = g + inter;
    typename E::T* o = out + r * inter;
    for (int64_t c = 0; c < inter; c++) {
      const float x = E::load(g[c]);
      o[c] = E::store(round_trip<E>(x / (1.f + std::exp(-x))) * E::load(u[c]));
    }
  }
}

// One head's RoPE (Qwen's rotate-half): out = x * cos + cat(-x2, x1) * sin, each product and the sum rounded.
template <class E>
inline void rope_head(const typename E::T* x, const typename E::T* cos, const typename E::T* sin,
                      typename E::T* out, int64_t half) {
  for (int64_t c = 0; c < half; c++) {
    const float a = round_trip<E>(E::load(x[c]) * E::load(cos[c]));
    const float b = round_trip<E>(-E::load(x[c + half]) * E::load(sin[c]));
    out[c] = E::store(a + b);
  }
  for (int64_t c = half; c < 2 * half; c++) {
    const float a = round_trip<E>(E::load(x[c]) * E::load(cos[c]));
    const float b = round_trip<E>(E::load(x[c - half]) * E::load(sin[c]));
    out[c] = E::store(a + b);
  }
}

// The QKV product's output [rows, new, (heads + 2 kv_heads) * head_dim] split into heads: queries rotated into
// q_out [rows, heads, new, head_dim] (contiguous); keys rotated and values copied into the slab's columns,
// keys/values[row, kv_head, columns[row, t]] (element strides row_stride, head_stride, column_stride; head_dim
// contiguous). cos/sin are the model's tables [positions, head_dim], read at positions[row, t].
template <class E>
void rope_qkv(const typename E::T* qkv, const typename E::T* cos_table, const typename E::T* sin_table,
              const int64_t* positions, const int64_t* columns, typename E::T* q_out, typename E::T* keys,
              typename E::T* values, int64_t rows, int64_t new_tokens, int64_t heads, int64_t kv_heads,
              int64_t head_dim, int64_t row_stride, int64_t head_stride, int64_t column_stride) {
  const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t t = 0; t < new_tokens; t++) {
      const typename E::T* x = qkv + (r * new_tokens + t) * width;
      const int64_t position = positions[r * new_tokens + t], column = columns[r * new_tokens + t];
      const typename E::T* cos = cos_table + position * head_dim;
      const typename E::T* sin = sin_table + position * head_dim;
      for (int64_t h = 0; h < heads; h++)
        rope_head<E>(x + h * head_dim, cos, sin, q_out + ((r * heads + h) * new_tokens + t) * head_dim, half);
      for (int64_t h = 0; h < kv_heads; h++) {
        const int64_t at = r * row_stride + h * head_stride + column * column_stride;
        rope_head<E>(x + (heads + h) * head_dim, cos, sin, keys + at, half);
        std::memcpy(values + at, x + (heads + kv_heads + h) * head_dim, head_dim * sizeof(typename E::T));
      }
    }
}

}  // namespace

extern "C" {

#define QVPIC_DECODER_OPS(NAME, E)                                                                               \
  void qvpic_add_rms_norm_##NAME(E::T* hidden, int64_t hidden_stride, const E::T* delta, int64_t delta_stride,    \
                                 const E::T* weight, E::T* out, int64_t out_stride, int64_t n, int64_t dim,       \
                                 float eps) {                                                                     \
    add_rms_norm<E>(hidden, hidden_stride, delta, delta_stride, weight, out, out_stride, n, dim, eps);             \
  }                                                                                                               \
  void qvpic_silu_mul_##NAME(const E::T* gate_up, E::T* out, int64_t n, int64_t inter) {                          \
    silu_mul<E>(gate_up, out, n, inter);                                                                          \
  }                                                                                                               \
  void qvpic_rope_qkv_##NAME(const E::T* qkv, const E::T* cos_table, const E::T* sin_table,                       \
                             const int64_t* positions, const int64_t* columns, E::T* q_out, E::T* keys,           \
                             E::T* values, int64_t rows, int64_t new_tokens, int64_t heads, int64_t kv_heads,      \
                             int64_t head_dim, int64_t row_stride, int64_t head_stride, int64_t column_stride) {   \
    rope_qkv<E>(qkv, cos_table, sin_table, positions, columns, q_out, keys, values, rows, new_tokens, heads,      \
                kv_heads, head_dim, row_stride, head_stride, column_stride);                                      \
  }

QVPIC_DECODER_OPS(float32, Float32)
QVPIC_DECODER_OPS(bfloat16, BFloat16)

}  // extern "C"
