// The expert MLP's activation, one pass over each dispatched row:
// - activation_bwd (oxmoe.activation.activation_bwd): grad_hidden [rows, F]
//   and the pre-activation [rows, 2F] ([gate, up], gated ACTIVATION) or
//   [rows, F] in T, the rows' weights [rows] float32 -> the pre-activation's
//   gradient (its shape), the weighted hidden activation [rows, F] in T, and
//   each weight's gradient [rows] float32; given group_sizes [groups] int32
//   (else null), only of the rows the groups cover (covered_rows), the
//   results' other rows left unwritten;
// - activation_fwd: the pre-activation -> the hidden activation [rows, F], for
//   oxmoe.grouped_gemm.ragged_dot_activation where its product cannot apply
//   the activation in the Hopper kernel's epilogue.
// src/activation/cpu.rs states the semantics, step for step what each thread
// computes here.
//
// Layout, and why. The op moves bytes: 6 (gated; 4 otherwise) elements read
// or written per hidden column, a few dozen float operations each. One warp
// per row: its lanes read 16 contiguous bytes each (a warp 512 bytes of a
// row, whole sectors) of grad_hidden, gate and up, and write the same of the
// three results, so every access is whole sectors; the weight's gradient, the
// row's sum, is reduced over the warp with shuffles in a fixed order (the
// same result on every run) and written by lane 0. Rows whose bytes are not a
// multiple of 16 (VECTOR_BYTES 0) go one element a lane.
#include "common.cuh"

constexpr int ACTIVATION_THREADS = 256;

// The rows the groups cover, from the first (src/activation/cpu.rs's
// covered_rows): negative sizes count as zero, the total stops at rows. Each
// warp sums the sizes itself (a few hundred ints, in cache after the first
// warp), so the sizes stay on the device and need no launch of their own.
__device__ int covered_rows(const int* __restrict__ group_sizes, int groups, int rows, int lane) {
  long long covered = 0;
  for (int g = lane; g < groups; g += 32) covered += max(group_sizes[g], 0);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) covered += __shfl_xor_sync(0xffffffffu, covered, offset);
  return static_cast<int>(min(covered, static_cast<long long>(rows)));
}

template <typename T, int ACTIVATION, int VECTOR_BYTES, int THREADS>
__global__ void __launch_bounds__(THREADS) activation_bwd(
    const T* __restrict__ grad_hidden, const T* __restrict__ pre_activation, const float* __restrict__ row_probs,
    const int* __restrict__ group_sizes, int groups, int rows, int features, T* __restrict__ grad_pre_activation,
    T* __restrict__ weighted_hidden, float* __restrict__ grad_row_probs) {
  static_assert(THREADS == ACTIVATION_THREADS, "the launch's threads are the layout's (src/activation/cuda.rs)");
  constexpr bool GATED = is_gated(ACTIVATION);
  constexpr int PER = VECTOR_BYTES > 0 ? VECTOR_BYTES / static_cast<int>(sizeof(T)) : 1;
  const int row = blockIdx.x * (THREADS / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  // A warp's lanes share the row, so the whole warp returns or sums together.
  if (group_sizes != nullptr && row >= covered_rows(group_sizes, groups, rows, lane)) return;
  const float p = row_probs[row];
  const size_t width = GATED ? 2 * static_cast<size_t>(features) : features;
  const T* grad = grad_hidden + row * static_cast<size_t>(features);
  const T* pre = pre_activation + row * width;
  T* grad_pre = grad_pre_activation + row * width;
  // A gated row's up half and its gradient (pointers, so no int sum of column indices).
  const T* up = pre + features;
  T* grad_up = grad_pre + features;
  T* weighted = weighted_hidden + row * static_cast<size_t>(features);
  float sum = 0.f;
  for (int j = lane * PER; j < features; j += 32 * PER) {
    const int count = min(PER, features - j);
    float g[PER], x[PER], u[PER];
    load_floats<T, PER, VECTOR_BYTES>(grad + j, count, g);
    load_floats<T, PER, VECTOR_BYTES>(pre + j, count, x);
    if constexpr (GATED) load_floats<T, PER, VECTOR_BYTES>(up + j, count, u);
    float grad_x[PER], grad_u[PER], out[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const ActivationElementGrads e = activation_element_grads<T, ACTIVATION>(g[i], x[i], GATED ? u[i] : 1.f, p);
      sum += e.product;
      grad_x[i] = e.grad_x, grad_u[i] = e.grad_u, out[i] = e.weighted;
    }
    store_floats<T, PER, VECTOR_BYTES>(grad_pre + j, count, grad_x);
    if constexpr (GATED) store_floats<T, PER, VECTOR_BYTES>(grad_up + j, count, grad_u);
    store_floats<T, PER, VECTOR_BYTES>(weighted + j, count, out);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) grad_row_probs[row] = sum;
}

// hidden[row] = round(act(gate) * up) (gated; round(act(x)) otherwise) of each
// pre-activation row, in float32: activation_bwd's h. The same layout, a
// warp per row.
template <typename T, int ACTIVATION, int VECTOR_BYTES, int THREADS>
__global__ void __launch_bounds__(THREADS) activation_fwd(const T* __restrict__ pre_activation, int rows, int features,
                                                          T* __restrict__ hidden) {
  static_assert(THREADS == ACTIVATION_THREADS, "the launch's threads are the layout's (src/activation/cuda.rs)");
  constexpr bool GATED = is_gated(ACTIVATION);
  constexpr int PER = VECTOR_BYTES > 0 ? VECTOR_BYTES / static_cast<int>(sizeof(T)) : 1;
  const int row = blockIdx.x * (THREADS / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* pre = pre_activation + row * (GATED ? 2 * static_cast<size_t>(features) : features);
  const T* up = pre + features;
  T* out = hidden + row * static_cast<size_t>(features);
  for (int j = lane * PER; j < features; j += 32 * PER) {
    const int count = min(PER, features - j);
    float x[PER], u[PER], h[PER];
    load_floats<T, PER, VECTOR_BYTES>(pre + j, count, x);
    if constexpr (GATED) load_floats<T, PER, VECTOR_BYTES>(up + j, count, u);
#pragma unroll
    for (int i = 0; i < PER; ++i) h[i] = hidden_activation<ACTIVATION>(x[i], GATED ? u[i] : 1.f);
    store_floats<T, PER, VECTOR_BYTES>(out + j, count, h);
  }
}
