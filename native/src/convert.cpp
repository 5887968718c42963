// fluxlike-native: bfloat16 and float16 <-> float32 over whole buffers (common.h), for the
// primitives that run half-precision operands in float32 kernels. Built for AVX-512 and AVX2
// as well, picked at load time.

#include "common.h"

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>

namespace fluxlike_native {

FLN_VECTOR_CLONES void widen_all(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    dst[i] = widen(src[i]);
  }
}

FLN_VECTOR_CLONES void narrow_all(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    dst[i] = narrow(src[i]);
  }
}

// bfloat16 widened with its results written by non-temporal stores, for casts larger than the
// caches (a new output buffer: ordinary stores read each of its lines first, 4 of the 10 bytes
// an element moves; widening is exact: the same bits). Elements before the output's first
// 16-byte boundary and after the last whole vector take the loop above. Under autocast these
// are the float32 gradients of the parameters, read next by the finite check and the update:
// 7.2 -> 3.8% of a 4 x 2048 MLP's step. (Narrowing the same way was slower, 6.3 -> 7.7%: the
// bfloat16 weights are read by the next product at once, from memory once streamed.)
namespace {

__attribute__((target("avx2"))) void widen_streaming(const uint16_t* src, float* dst,
                                                     size_t n) {
  size_t i = 0;
  while (i < n && reinterpret_cast<uintptr_t>(dst + i) % 16 != 0) ++i;
  widen_all(src, dst, i);
  for (; i + 8 <= n; i += 8) {
    auto bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    bits = _mm256_slli_epi32(bits, 16);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(bits));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 4), _mm256_extracti128_si256(bits, 1));
  }
  widen_all(src + i, dst + i, n - i);
  _mm_sfence();  // (the stores are weakly ordered: done before the task is)
}

} // namespace

bool has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();  // (this may run from a static initialiser: before libgcc's own)
    return __builtin_cpu_supports("avx2");
  }();
  return has;
}

// Streaming from 2**20 elements (4 MB of float32, past this Xeon's 4 MB of L2 per core).
constexpr size_t STREAM_MIN = size_t{1} << 20;

bool convert_streaming(const void* src, mx::Dtype from, void* dst, mx::Dtype to, size_t n,
                       size_t total) {
  if (total < STREAM_MIN || !has_avx2()) return false;
  if (from == mx::bfloat16 && to == mx::float32) {
    widen_streaming(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n);
    return true;
  }
  return false;
}

// float16 as MLX converts it: widened exactly, narrowed to nearest even (a NaN to MLX's NaN of
// its sign). F16C's conversions, eight at a time, where the CPU has them (every AVX2 CPU does;
// chosen by feature, as target_clones' "arch=" clones are chosen by CPU model); elsewhere
// _Float16's.
namespace {

__attribute__((target("avx2,f16c"))) void widen_f16_f16c(const uint16_t* src, float* dst,
                                                          size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    auto half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(half));
  }
  for (; i < n; ++i) {
    dst[i] = _cvtsh_ss(src[i]);
  }
}

// A NaN as MLX's astype narrows it to float16: its sign, the payload 0x100 (0x7D00).
constexpr uint16_t F16_NAN = 0x7D00;

inline uint16_t f16_nan_of(float x) {
  return static_cast<uint16_t>((std::bit_cast<uint32_t>(x) >> 16) & 0x8000u) | F16_NAN;
}

__attribute__((target("avx2,f16c"))) void narrow_f16_f16c(const float* src, uint16_t* dst,
                                                           size_t n) {
  const auto sign = _mm_set1_epi16(static_cast<int16_t>(0x8000));
  const auto nan = _mm_set1_epi16(static_cast<int16_t>(F16_NAN));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    auto x = _mm256_loadu_ps(src + i);
    auto half = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    // NaN lanes (all ones in 32 bits, packed to 16) take MLX's NaN, keeping the sign
    auto wide = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    auto is_nan = _mm_packs_epi32(_mm256_castsi256_si128(wide),
                                  _mm256_extracti128_si256(wide, 1));
    auto mlx_nan = _mm_or_si128(_mm_and_si128(half, sign), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm_blendv_epi8(half, mlx_nan, is_nan));
  }
  for (; i < n; ++i) {
    dst[i] = src[i] != src[i] ? f16_nan_of(src[i])
                              : _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
  }
}

bool has_f16c() {
  static const bool has = [] {
    __builtin_cpu_init();  // (this may run from a static initialiser: before libgcc's own)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return has;
}

void widen_f16_all(const uint16_t* src, float* dst, size_t n) {
  if (has_f16c()) {
    widen_f16_f16c(src, dst, n);
    return;
  }
  auto half = reinterpret_cast<const _Float16*>(src);
  for (size_t i = 0; i < n; ++i) {
    dst[i] = static_cast<float>(half[i]);
  }
}

void narrow_f16_all(const float* src, uint16_t* dst, size_t n) {
  if (has_f16c()) {
    narrow_f16_f16c(src, dst, n);
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    dst[i] = src[i] != src[i] ? f16_nan_of(src[i])
                              : std::bit_cast<uint16_t>(static_cast<_Float16>(src[i]));
  }
}

} // namespace

void widen_all(const void* src, mx::Dtype dt, float* dst, size_t n) {
  if (dt == mx::float32) {
    std::copy_n(static_cast<const float*>(src), n, dst);
  } else if (dt == mx::float16) {
    widen_f16_all(static_cast<const uint16_t*>(src), dst, n);
  } else {
    widen_all(static_cast<const uint16_t*>(src), dst, n);
  }
}

FLN_VECTOR_CLONES void round_bf16_all(float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    x[i] = widen(narrow(x[i]));
  }
}

void round_all(float* x, mx::Dtype dt, size_t n) {
  if (dt == mx::float32) {
    return;
  }
  if (dt == mx::bfloat16) {
    round_bf16_all(x, n);
    return;
  }
  constexpr size_t chunk = 1024;
  uint16_t half[chunk];
  for (size_t i = 0; i < n; i += chunk) {
    size_t c = std::min(chunk, n - i);
    narrow_f16_all(x + i, half, c);
    widen_f16_all(half, x + i, c);
  }
}

void narrow_all(const float* src, mx::Dtype dt, void* dst, size_t n) {
  if (dt == mx::float32) {
    std::copy_n(src, n, static_cast<float*>(dst));
  } else if (dt == mx::float16) {
    narrow_f16_all(src, static_cast<uint16_t*>(dst), n);
  } else {
    narrow_all(src, static_cast<uint16_t*>(dst), n);
  }
}

void convert_all(const void* src, mx::Dtype from, void* dst, mx::Dtype to, size_t n) {
  if (from == mx::float32) {
    narrow_all(static_cast<const float*>(src), to, dst, n);
  } else if (to == mx::float32) {
    widen_all(src, from, static_cast<float*>(dst), n);
  } else {  // one half dtype to the other: through float32, as MLX converts
    constexpr size_t chunk = 2048;
    float wide[chunk];
    auto* in = static_cast<const uint16_t*>(src);
    auto* out = static_cast<uint16_t*>(dst);
    for (size_t i = 0; i < n; i += chunk) {
      size_t c = std::min(chunk, n - i);
      widen_all(in + i, from, wide, c);
      narrow_all(wide, to, out + i, c);
    }
  }
}

} // namespace fluxlike_native
