// Re-anchoring of rotate-half keys (Qwen) in one pass: out = k * diag + swap_halves(k) * cross per row of
// head_dim channels, each key read once from the chunk and written once into its slab row, rows split over
// torch's OpenMP threads. pipeline/runtime/reanchor.py compiles and loads it; its torch ops are the fallback.
// A plain C ABI and no torch headers, so that it compiles in a fraction of a second (a torch extension of the
// same loop takes ~35 s of CPU).
#include <cstdint>
#include <cstring>

#include "native_elements.h"

namespace {

using qvpic::BFloat16;
using qvpic::Float32;

template <class E>
inline __attribute__((always_inline)) void row(const typename E::T* __restrict__ k, typename E::T* __restrict__ o,
                                               const float* __restrict__ diag, const float* __restrict__ cross,
                                               int64_t half) {
#pragma omp simd
  for (int64_t c = 0; c < half; c++) o[c] = E::store(E::load(k[c]) * diag[c] + E::load(k[c + half]) * cross[c]);
#pragma omp simd
  for (int64_t c = 0; c < half; c++)
    o[c + half] = E::store(E::load(k[c + half]) * diag[c + half] + E::load(k[c]) * cross[c + half]);
}

// keys and out are [n0, n1, n2, head_dim] with unit stride in head_dim; strides in elements.
template <class E>
void rotate(const typename E::T* keys, typename E::T* out, const float* diag, const float* cross, int64_t n0,
            int64_t n1, int64_t n2, int64_t head_dim, int64_t k0, int64_t k1, int64_t k2, int64_t o0, int64_t o1,
            int64_t o2, int threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for collapse(3) schedule(static) num_threads(threads)
  for (int64_t a = 0; a < n0; a++)
    for (int64_t b = 0; b < n1; b++)
      for (int64_t t = 0; t < n2; t++) {
        const typename E::T* k = keys + a * k0 + b * k1 + t * k2;
        typename E::T* o = out + a * o0 + b * o1 + t * o2;
        switch (half) {  // a constant trip count for the usual head dims: fully unrolled
          case 32: row<E>(k, o, diag, cross, 32); break;
          case 64: row<E>(k, o, diag, cross, 64); break;
          default: row<E>(k, o, diag, cross, half);
        }
      }
}

}  // namespace

extern "C" {

void qvpic_rotate_halves_float32(const float* keys, float* out, const float* diag, const float* cross, int64_t n0,
                                 int64_t n1, int64_t n2, int64_t head_dim, int64_t k0, int64_t k1, int64_t k2,
                                 int64_t o0, int64_t o1, int64_t o2, int threads) {
  rotate<Float32>(keys, out, diag, cross, n0, n1, n2, head_dim, k0, k1, k2, o0, o1, o2, threads);
}

void qvpic_rotate_halves_bfloat16(const uint16_t* keys, uint16_t* out, const float* diag, const float* cross,
                                  int64_t n0, int64_t n1, int64_t n2, int64_t head_dim, int64_t k0, int64_t k1,
                                  int64_t k2, int64_t o0, int64_t o1, int64_t o2, int threads) {
  rotate<BFloat16>(keys, out, diag, cross, n0, n1, n2, head_dim, k0, k1, k2, o0, o1, o2, threads);
}

}  // extern "C"
