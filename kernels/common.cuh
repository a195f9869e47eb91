// Device helpers shared by oxmoe's kernels. NVRTC from the pip wheel ships no
// CUDA headers, so the 16-bit float types live here, with conversions that
// round to nearest even like the CPU implementation (Rust's `half`).
#pragma once

struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(int x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(static_cast<unsigned>(x.bits) << 16); }
__device__ __forceinline__ float to_float(f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}
template <> __device__ __forceinline__ f16 from_float<f16>(float x) {
  f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}

// Two floats rounded to a 16-bit T as from_float rounds each, lo in the low
// half: one conversion instruction for both.
template <typename T> __device__ __forceinline__ unsigned from_floats(float lo, float hi);
template <> __device__ __forceinline__ unsigned from_floats<bf16>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ unsigned from_floats<f16>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// A float8_e4m3fn (sign, 4 exponent bits of bias 7, 3 mantissa bits; no
// infinities, S.1111.111 is NaN) as float, exactly, from its bits.
__device__ __forceinline__ float e4m3_to_float(unsigned char bits) {
  const unsigned sign = static_cast<unsigned>(bits & 0x80) << 24, exponent = (bits >> 3) & 0xF, mantissa = bits & 7;
  if (exponent == 0xF && mantissa == 7) return __int_as_float(0x7fc00000);
  if (exponent == 0) return __uint_as_float(sign | __float_as_uint(mantissa * (1.f / 512.f)));  // mantissa / 8 * 2^-6
  return __uint_as_float(sign | (exponent + 120) << 23 | mantissa << 20);
}

// float8_e4m3fn of v, rounded to nearest with ties to the even pattern; past
// 448 (infinities too) saturated to +-448 and NaN kept NaN, as the conversion
// instruction's .satfinite does: src/real.rs's E4m3::from_f32, step for step.
__device__ __forceinline__ unsigned float_to_e4m3(float v) {
  const unsigned bits = __float_as_uint(v), sign = bits >> 24 & 0x80, magnitude = bits & 0x7fffffff;
  if (magnitude > 0x7f800000) return sign | 0x7f;
  if (magnitude >= 0x43e00000) return sign | 0x7e;  // 448
  // Below 2^-6, the subnormals: multiples of 2^-9 (8 of them is 2^-6, pattern 0x08).
  if (magnitude < 0x3c800000) return sign | static_cast<unsigned>(__float2int_rn(__uint_as_float(magnitude) * 512.f));
  // The float32 mantissa rounded to its top 3 bits, ties to even (a carry moves the exponent up).
  const unsigned rounded = magnitude + 0x7ffff + (magnitude >> 20 & 1);
  return sign | ((rounded >> 23) - 120) << 3 | (rounded >> 20 & 7);
}

// Two floats as float8_e4m3fn, lo in the low byte: one instruction from sm_89 on
// (round to nearest even, .satfinite: the same results as float_to_e4m3).
__device__ __forceinline__ unsigned floats_to_e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
  unsigned short pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
  return pair;
#else
  return float_to_e4m3(lo) | float_to_e4m3(hi) << 8;
#endif
}

__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }

// 1 / (1 + e^-x); __frcp_rn is the correctly rounded reciprocal, the value of 1.f / y.
__device__ __forceinline__ float sigmoid(float x) { return __frcp_rn(1.f + expf(-x)); }

// sigmoid(x) e^-c, for sigmoids normalised over a set with c = min(0, the set's
// largest logit): src/router/cpu.rs's shifted_sigmoid, which says why. With
// c = 0 it is `sigmoid(x)`, bit for bit (expf(0) is 1, 0 - x is -x).
__device__ __forceinline__ float shifted_sigmoid(float x, float c) { return __frcp_rn(expf(c) + expf(c - x)); }

// sigmoid(x), as `sigmoid` computes it, and 1 - sigmoid(x) = e^-x * sigmoid(x):
// one exponential, and no cancellation near 1. Where e^-x overflows (x below
// about -88) the sigmoid is 0 and e^-x times it NaN: fminf takes the 1, which
// it is.
__device__ __forceinline__ void sigmoid_and_complement(float x, float& s, float& complement) {
  const float e = expf(-x);
  s = __frcp_rn(1.f + e);
  complement = fminf(e * s, 1.f);
}

// The expert MLP's activations as kernels take them (a template argument;
// src/activation/mod.rs's `Activation::code`), NO_ACTIVATION for a plain
// product. Gated ones take [gate, up] and give act(gate) * up.
constexpr int NO_ACTIVATION = 0, SWIGLU = 1, GEGLU = 2, GELU = 3, SILU = 4;
constexpr bool is_gated(int activation) { return activation == SWIGLU || activation == GEGLU; }
constexpr bool is_gelu(int activation) { return activation == GEGLU || activation == GELU; }

// sqrt(2 / pi) and the cubic coefficient of GELU's tanh approximation
// (src/activation/cpu.rs's).
constexpr float GELU_SCALE = 0.7978846f;
constexpr float GELU_CUBIC = 0.044715f;

// act(x) and act'(x): src/activation/cpu.rs's value_and_slope, step for step.
// (A caller that needs only the value leaves the slope dead for the compiler.)
template <bool GELU>
__device__ __forceinline__ void value_and_slope(float x, float& value, float& slope) {
  if constexpr (GELU) {
    const float t = tanhf(GELU_SCALE * (x + GELU_CUBIC * x * x * x));
    value = 0.5f * x * (1.f + t);
    slope = 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * GELU_SCALE * (1.f + 3.f * GELU_CUBIC * x * x);
  } else {
    float s, complement;
    sigmoid_and_complement(x, s, complement);
    value = x * s;
    slope = s * (1.f + x * complement);
  }
}

// The hidden activation of one element before its rounding: act(x) * u
// gated (x the gate), act(x) otherwise.
template <int ACTIVATION>
__device__ __forceinline__ float hidden_activation(float x, float u) {
  float value, slope;
  value_and_slope<is_gelu(ACTIVATION)>(x, value, slope);
  return is_gated(ACTIVATION) ? value * u : value;
}

// x rounded to T, as a float.
template <typename T>
__device__ __forceinline__ float rounded(float x) { return to_float(from_float<T>(x)); }

// One element of the activation's backward, src/activation/cpu.rs's
// activation_bwd step for step: from grad_hidden's g, the pre-activation's x
// (the gate when gated) and up u (unused ungated) and the row's weight p, the
// pre-activation's gradient (x's, then up's when gated) and the weighted hidden
// activation, each rounded to T where it is stored, and h * g, the element's
// term of the weight's gradient.
struct ActivationElementGrads {
  float grad_x, grad_u, weighted, product;
};

template <typename T, int ACTIVATION>
__device__ __forceinline__ ActivationElementGrads activation_element_grads(float g, float x, float u, float p) {
  constexpr bool GATED = is_gated(ACTIVATION);
  float value, slope;
  value_and_slope<is_gelu(ACTIVATION)>(x, value, slope);
  const float hidden = rounded<T>(GATED ? value * u : value);
  const float c = rounded<T>(g * p);
  return {GATED ? c * u * slope : c * slope, c * value, hidden * p, hidden * g};
}

// W bytes (16, 8, 4 or 2) moved as one vector, seen as elements of T.
template <int W> struct VectorOf;
template <> struct VectorOf<16> { using type = uint4; };
template <> struct VectorOf<8> { using type = uint2; };
template <> struct VectorOf<4> { using type = unsigned; };
template <> struct VectorOf<2> { using type = unsigned short; };

template <typename T, int W>
union Pack {
  static constexpr int N = W / sizeof(T);
  typename VectorOf<W>::type raw;
  T elems[N];
};

// The widest vector (16, 8 or 4 bytes; 0 for none) that moves a lane's
// `lane_bytes` when rows are `row_bytes` long (so every lane's slice is aligned).
__host__ __device__ constexpr int vector_bytes(int lane_bytes, int row_bytes, int element_bytes) {
  for (int w = 16; w >= 4 && w >= element_bytes; w /= 2)
    if (lane_bytes % w == 0 && row_bytes % w == 0) return w;
  return 0;
}

// Loads N consecutive elements at src as floats, W bytes at a time (W = 0:
// one element at a time, only the first `count`, the rest 0).
template <typename T, int N, int W>
__device__ __forceinline__ void load_floats(const T* __restrict__ src, int count, float (&out)[N]) {
  if constexpr (W > 0) {
    constexpr int PER = Pack<T, W>::N;
#pragma unroll
    for (int w = 0; w < N / PER; ++w) {
      Pack<T, W> pack;
      pack.raw = reinterpret_cast<const typename VectorOf<W>::type*>(src)[w];
#pragma unroll
      for (int i = 0; i < PER; ++i) out[w * PER + i] = to_float(pack.elems[i]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = j < count ? to_float(src[j]) : 0.f;
  }
}

// W bytes of T from the W / sizeof(T) floats at in, each rounded to T as
// from_float rounds it (16-bit T two at a time: one conversion a word).
template <typename T, int W>
__device__ __forceinline__ typename VectorOf<W>::type packed(const float* in) {
  if constexpr (sizeof(T) == 2 && W >= 4) {
    Pack<unsigned, W> words;
#pragma unroll
    for (int w = 0; w < W / 4; ++w) words.elems[w] = from_floats<T>(in[2 * w], in[2 * w + 1]);
    return words.raw;
  } else {
    Pack<T, W> pack;
#pragma unroll
    for (int i = 0; i < Pack<T, W>::N; ++i) pack.elems[i] = from_float<T>(in[i]);
    return pack.raw;
  }
}

// Stores the first `count` of N floats at dst as T (see load_floats for W).
template <typename T, int N, int W>
__device__ __forceinline__ void store_floats(T* __restrict__ dst, int count, const float (&in)[N]) {
  if constexpr (W > 0) {
    constexpr int PER = Pack<T, W>::N;
#pragma unroll
    for (int w = 0; w < N / PER; ++w)
      reinterpret_cast<typename VectorOf<W>::type*>(dst)[w] = packed<T, W>(in + w * PER);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < count) dst[j] = from_float<T>(in[j]);
  }
}

// Loads / stores N bools (one byte each) as the bits of a mask (bit j = element j).
template <int N, int W>
__device__ __forceinline__ unsigned long long load_mask(const unsigned char* __restrict__ src, int count) {
  unsigned long long bits = 0;
  if constexpr (W > 0) {
#pragma unroll
    for (int w = 0; w < N / W; ++w) {
      Pack<unsigned char, W> pack;
      pack.raw = reinterpret_cast<const typename VectorOf<W>::type*>(src)[w];
#pragma unroll
      for (int i = 0; i < W; ++i)
        if (pack.elems[i]) bits |= 1ull << (w * W + i);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < count && src[j]) bits |= 1ull << j;
  }
  return bits;
}

template <int N, int W>
__device__ __forceinline__ void store_mask(unsigned char* __restrict__ dst, int count, unsigned long long bits) {
  if constexpr (W > 0) {
#pragma unroll
    for (int w = 0; w < N / W; ++w) {
      Pack<unsigned char, W> pack;
#pragma unroll
      for (int i = 0; i < W; ++i) pack.elems[i] = (bits >> (w * W + i)) & 1ull;
      reinterpret_cast<typename VectorOf<W>::type*>(dst)[w] = pack.raw;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < count) dst[j] = (bits >> j) & 1ull;
  }
}

// Sum over a block of BLOCK threads, in a fixed order (so the result is the
// same on every run); the total is valid in thread 0.
template <int BLOCK>
__device__ __forceinline__ float block_sum(float v) {
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "whole warps, at most a block's 1024 threads");
  __shared__ float warp_sums[BLOCK / 32];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 0; w < BLOCK / 32; ++w) total += warp_sums[w];
  }
  return total;
}
