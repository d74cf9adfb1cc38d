// Compile Metal kernel bodies as C++ on the host, for tests.
//
// The kernel text in mlx_redrafter/kernels/sources.py is compiled verbatim after
// this header, inside the function signature mx.fast.metal_kernel would
// generate (see emulate.py). Only what those kernels may use is provided; a
// kernel that needs more fails to compile here instead of silently diverging.
//
// Deliberately strict: there is no `using namespace metal`, so library calls must
// be qualified (metal::min), which is correct Metal whatever the preamble says.
// Threadgroup barriers are not emulated: calling one aborts the run.
#pragma once

// Every standard header comes before the address-space macros below.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sys/types.h>

// Address spaces: the host has one flat memory.
#define device
#define constant
#define thread
#define threadgroup
#define METAL_FUNC inline

#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

// Vector types: component access and elementwise arithmetic.
template <typename T>
struct redrafter_vec2 {
  T x, y;
};
template <typename T>
struct redrafter_vec3 {
  T x, y, z;
};
template <typename T>
struct redrafter_vec4 {
  T x, y, z, w;
};

#define REDRAFTER_VEC_OPS(V, OP)                                   \
  template <typename T>                                            \
  inline V<T> operator OP(V<T> a, V<T> b) {                        \
    V<T> r = a;                                                    \
    T* pr = &r.x;                                                  \
    const T* pb = &b.x;                                            \
    for (unsigned i = 0; i < sizeof(V<T>) / sizeof(T); ++i) {      \
      pr[i] = pr[i] OP pb[i];                                      \
    }                                                              \
    return r;                                                      \
  }
REDRAFTER_VEC_OPS(redrafter_vec2, +)
REDRAFTER_VEC_OPS(redrafter_vec2, -)
REDRAFTER_VEC_OPS(redrafter_vec2, *)
REDRAFTER_VEC_OPS(redrafter_vec2, /)
REDRAFTER_VEC_OPS(redrafter_vec3, +)
REDRAFTER_VEC_OPS(redrafter_vec3, -)
REDRAFTER_VEC_OPS(redrafter_vec3, *)
REDRAFTER_VEC_OPS(redrafter_vec3, /)
REDRAFTER_VEC_OPS(redrafter_vec4, +)
REDRAFTER_VEC_OPS(redrafter_vec4, -)
REDRAFTER_VEC_OPS(redrafter_vec4, *)
REDRAFTER_VEC_OPS(redrafter_vec4, /)
#undef REDRAFTER_VEC_OPS

typedef redrafter_vec2<float> float2;
typedef redrafter_vec3<float> float3;
typedef redrafter_vec4<float> float4;
typedef redrafter_vec2<int> int2;
typedef redrafter_vec3<int> int3;
typedef redrafter_vec4<int> int4;
typedef redrafter_vec2<uint> uint2;
typedef redrafter_vec3<uint> uint3;
typedef redrafter_vec4<uint> uint4;

namespace metal {

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };

// One host thread runs the grid's threads one after another, so a barrier
// cannot be honoured: fail loudly rather than compute something else.
inline void threadgroup_barrier(mem_flags) {
  std::fprintf(stderr, "threadgroup_barrier is not emulated by metal_compat.h\n");
  std::abort();
}

template <typename T>
struct numeric_limits : std::numeric_limits<T> {};

// Integer min/max/clamp; floats use fmin/fmax as Metal does (a NaN argument loses).
template <typename T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
inline T max(T a, T b) {
  return a < b ? b : a;
}
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
template <typename T>
inline T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <typename T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}

#define REDRAFTER_MATH(NS)                                                   \
  namespace NS {                                                             \
  inline float exp(float x) { return std::exp(x); }                          \
  inline float exp2(float x) { return std::exp2(x); }                        \
  inline float log(float x) { return std::log(x); }                          \
  inline float log2(float x) { return std::log2(x); }                        \
  inline float log1p(float x) { return std::log1p(x); }                      \
  inline float sqrt(float x) { return std::sqrt(x); }                        \
  inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }                \
  inline float pow(float x, float y) { return std::pow(x, y); }              \
  inline float tanh(float x) { return std::tanh(x); }                        \
  inline float fabs(float x) { return std::fabs(x); }                        \
  inline float abs(float x) { return std::fabs(x); }                         \
  inline float floor(float x) { return std::floor(x); }                      \
  inline float ceil(float x) { return std::ceil(x); }                        \
  inline float fma(float a, float b, float c) { return std::fma(a, b, c); }  \
  inline float fmin(float a, float b) { return std::fmin(a, b); }            \
  inline float fmax(float a, float b) { return std::fmax(a, b); }            \
  }

// metal::exp and friends, and the metal::fast:: / metal::precise:: variants.
// On the host all three are the C library's correctly rounded or near-correct
// results; Metal's fast:: variants are less precise (see docs/kernels.md).
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float log2(float x) { return std::log2(x); }
inline float log1p(float x) { return std::log1p(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float pow(float x, float y) { return std::pow(x, y); }
inline float tanh(float x) { return std::tanh(x); }
inline float fabs(float x) { return std::fabs(x); }
inline float abs(float x) { return std::fabs(x); }
inline int abs(int x) { return x < 0 ? -x : x; }
inline float floor(float x) { return std::floor(x); }
inline float ceil(float x) { return std::ceil(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
REDRAFTER_MATH(fast)
REDRAFTER_MATH(precise)
#undef REDRAFTER_MATH

}  // namespace metal
