// The experts' activation over a grouped GEMM's rows (src/activation): f32
// arithmetic as the CPU implementation, each result rounded once. Rows past the
// groups' total are not read and are written as zeros.
//
// Template arguments: T the element type, GLU (the row's first half gates its
// second), GELU (tanh approximation; else SiLU), V elements a thread moves at
// once (the activation's width is a multiple), W the bytes of one vector access
// (V elements, or 0 for one element at a time), BLOCK threads.
#include "common.cuh"

constexpr float GELU_SCALE = 0.7978846f;  // sqrt(2 / pi)
constexpr float GELU_CUBIC = 0.044715f;

// The activation of x and its derivative.
template <bool GELU>
__device__ __forceinline__ void activate(float x, float& value, float& slope) {
  if constexpr (GELU) {
    const float t = tanhf(GELU_SCALE * (x + GELU_CUBIC * x * x * x));
    value = 0.5f * x * (1.f + t);
    slope = 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * GELU_SCALE * (1.f + 3.f * GELU_CUBIC * x * x);
  } else {
    const float s = 1.f / (1.f + expf(-x));
    value = x * s;
    slope = s * (1.f + x * (1.f - s));
  }
}

// The rows the groups cover (negative sizes as zero, at most `rows`), summed by
// the first warp into shared memory.
template <int BLOCK>
__device__ __forceinline__ long long covered_rows(const int* __restrict__ group_sizes, int groups, int rows) {
  static_assert(BLOCK % 32 == 0, "whole warps");
  __shared__ long long covered;
  if (threadIdx.x < 32) {
    long long sum = 0;
    for (int g = threadIdx.x; g < groups; g += 32) sum += max(group_sizes[g], 0);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (threadIdx.x == 0) covered = min(sum, static_cast<long long>(rows));
  }
  __syncthreads();
  return covered;
}

template <typename T, bool GLU, bool GELU, int V, int W, int BLOCK>
__global__ void __launch_bounds__(BLOCK) activation_fwd(const T* __restrict__ up, const int* __restrict__ group_sizes,
                                                         int groups, T* __restrict__ hidden, int rows, int width) {
  const long long covered = covered_rows<BLOCK>(group_sizes, groups, rows);
  const int up_width = GLU ? 2 * width : width;
  const long long per_row = width / V, chunks = static_cast<long long>(rows) * per_row;
  for (long long chunk = static_cast<long long>(blockIdx.x) * BLOCK + threadIdx.x; chunk < chunks;
       chunk += static_cast<long long>(gridDim.x) * BLOCK) {
    const long long row = chunk / per_row;
    const int col = static_cast<int>(chunk % per_row) * V;
    float out[V];
    if (row < covered) {
      float gate[V], linear[V];
      const T* src = up + row * up_width + col;
      load_floats<T, V, W>(src, V, gate);
      if constexpr (GLU) load_floats<T, V, W>(src + width, V, linear);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        float value, slope;
        activate<GELU>(gate[i], value, slope);
        out[i] = GLU ? value * linear[i] : value;
      }
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) out[i] = 0.f;
    }
    store_floats<T, V, W>(hidden + row * width + col, V, out);
  }
}

template <typename T, bool GLU, bool GELU, int V, int W, int BLOCK>
__global__ void __launch_bounds__(BLOCK) activation_bwd(const T* __restrict__ up, const T* __restrict__ grad_hidden,
                                                         const int* __restrict__ group_sizes, int groups,
                                                         T* __restrict__ grad_up, T* __restrict__ hidden, int rows,
                                                         int width) {
  const long long covered = covered_rows<BLOCK>(group_sizes, groups, rows);
  const int up_width = GLU ? 2 * width : width;
  const long long per_row = width / V, chunks = static_cast<long long>(rows) * per_row;
  for (long long chunk = static_cast<long long>(blockIdx.x) * BLOCK + threadIdx.x; chunk < chunks;
       chunk += static_cast<long long>(gridDim.x) * BLOCK) {
    const long long row = chunk / per_row;
    const int col = static_cast<int>(chunk % per_row) * V;
    float grad_gate[V], grad_linear[V], out[V];
    if (row < covered) {
      float gate[V], linear[V], dh[V];
      const T* src = up + row * up_width + col;
      load_floats<T, V, W>(src, V, gate);
      if constexpr (GLU) load_floats<T, V, W>(src + width, V, linear);
      load_floats<T, V, W>(grad_hidden + row * width + col, V, dh);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        float value, slope;
        activate<GELU>(gate[i], value, slope);
        if constexpr (GLU) {
          out[i] = value * linear[i];
          grad_gate[i] = dh[i] * linear[i] * slope;
          grad_linear[i] = dh[i] * value;
        } else {
          out[i] = value;
          grad_gate[i] = dh[i] * slope;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) out[i] = grad_gate[i] = grad_linear[i] = 0.f;
    }
    T* grad_row = grad_up + row * up_width + col;
    store_floats<T, V, W>(grad_row, V, grad_gate);
    if constexpr (GLU) store_floats<T, V, W>(grad_row + width, V, grad_linear);
    store_floats<T, V, W>(hidden + row * width + col, V, out);
  }
}
