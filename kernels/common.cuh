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

__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }

// 16 bytes seen as elements, for vector loads and stores.
template <typename T>
union Pack16 {
  static constexpr int N = 16 / sizeof(T);
  uint4 raw;
  T elems[N];
};

// Loads n = N consecutive elements at src as floats. VEC: src is 16-byte
// aligned and N * sizeof(T) is a multiple of 16 (vector loads); otherwise
// only the first `count` are loaded and the rest are 0.
template <typename T, int N, bool VEC>
__device__ __forceinline__ void load_floats(const T* __restrict__ src, int count, float (&out)[N]) {
  if constexpr (VEC) {
    constexpr int PER = Pack16<T>::N;
#pragma unroll
    for (int w = 0; w < N / PER; ++w) {
      Pack16<T> pack;
      pack.raw = reinterpret_cast<const uint4*>(src)[w];
#pragma unroll
      for (int i = 0; i < PER; ++i) out[w * PER + i] = to_float(pack.elems[i]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = j < count ? to_float(src[j]) : 0.f;
  }
}

// Stores the first `count` of N floats at dst as T (see load_floats for VEC).
template <typename T, int N, bool VEC>
__device__ __forceinline__ void store_floats(T* __restrict__ dst, int count, const float (&in)[N]) {
  if constexpr (VEC) {
    constexpr int PER = Pack16<T>::N;
#pragma unroll
    for (int w = 0; w < N / PER; ++w) {
      Pack16<T> pack;
#pragma unroll
      for (int i = 0; i < PER; ++i) pack.elems[i] = from_float<T>(in[w * PER + i]);
      reinterpret_cast<uint4*>(dst)[w] = pack.raw;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < count) dst[j] = from_float<T>(in[j]);
  }
}

// Loads / stores N bools (one byte each) as bits of a mask (bit j = element j).
template <int N, bool VEC>
__device__ __forceinline__ unsigned long long load_mask(const unsigned char* __restrict__ src, int count) {
  unsigned long long bits = 0;
  if constexpr (VEC) {
#pragma unroll
    for (int w = 0; w < N / 8; ++w) {
      const uint2 raw = reinterpret_cast<const uint2*>(src)[w];
      const unsigned long long word = (static_cast<unsigned long long>(raw.y) << 32) | raw.x;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if ((word >> (8 * i)) & 0xff) bits |= 1ull << (w * 8 + i);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < count && src[j]) bits |= 1ull << j;
  }
  return bits;
}

template <int N, bool VEC>
__device__ __forceinline__ void store_mask(unsigned char* __restrict__ dst, int count, unsigned long long bits) {
  if constexpr (VEC) {
#pragma unroll
    for (int w = 0; w < N / 8; ++w) {
      unsigned long long word = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) word |= ((bits >> (w * 8 + i)) & 1ull) << (8 * i);
      reinterpret_cast<uint2*>(dst)[w] = make_uint2(static_cast<unsigned>(word), static_cast<unsigned>(word >> 32));
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
