// Can the permutation's row copies run nearer copy bandwidth on Hopper with bulk copies
// (issue 19)? The layer's five permutation calls each move every dispatched row once; in the
// DeepSeek-V3 one-GPU trace of 2026-11-29 (bench/NOTES.md) all five ran at 3.3-3.5 TB/s, where a
// device copy reaches ~4.1 (the gathers have since reached 3.8-4.1). This program times, at a layer's shape (tokens x top-k rows of `hidden` bf16, laid out
// as a dispatch lays them out: each token's top-k of `experts` random experts, every expert's
// rows together in token order):
//
//   - scatter (a dispatch): each token's row to its k rows;
//       registers: the library's scatter_rows (kernels/permutation.cu, as the dispatch runs it);
//       bulk: one thread of a warp a block loads each token's row into a ring of shared-memory
//         stages with one cp.async.bulk and stores it to its k rows with k more;
//   - scatter with the maps checked (combine's backward, unweighted): the library's scatter_rows
//       as combine's backward runs it, every row of the output checked against its token's;
//   - gather (a combine): each token's k rows weighted and summed in float32 in copy order;
//       registers: the library's gather_rows;
//       bulk: one thread loads a stage's piece of each of the token's k rows with bulk copies,
//         the block sums them from shared memory in the same order and stores the piece;
//   - cudaMemcpy of the rows (the copy ceiling: every row read and written once).
//
// Checks that each bulk kernel's output is bit for bit the register kernel's, then prints GB/s
// of each kernel's least bytes (scatter: the tokens read, the rows written; gather: the rows
// read, the tokens written) over 20 launches, two rounds. On a Hopper GPU:
//
//   nvcc -O3 -arch=sm_90a -std=c++17 -o row_copy_bulk bench/row_copy_bulk.cu
//   ./row_copy_bulk [tokens=8192] [hidden=7168: 7168, 2048 or 1024] [topk=8] [experts=32: 8, 32 or 128]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <numeric>
#include <random>
#include <vector>

#include "check.cuh"
#include "../kernels/common.cuh"
#include "../kernels/hopper.cuh"
#include "../kernels/permutation.cu"  // the library's row kernels (templates), timed beside these

using Vec = Pack<bf16, 16>;  // 16 bytes of a row
// The library's row kernels as src/permutation/cuda.rs launches them for up to 512 experts:
// 4 tokens a row block, 32 rows a block that writes the rows no token writes.
constexpr int TOKENS_PER_BLOCK = 4, ZERO_ROWS = 32;

// Of `count` items dealt to the grid's blocks in turn (blockIdx.x, blockIdx.x + gridDim.x, ...),
// how many are this block's.
__device__ __forceinline__ int block_share(int count) {
  return count > static_cast<int>(blockIdx.x) ? (count - 1 - blockIdx.x) / gridDim.x + 1 : 0;
}

// ---- bulk copies (hopper.cuh's helpers: the sm_90a device pass only) -----------------------

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void bulk_store(void* dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(shared_address(src)),
               "r"(bytes)
               : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_read_n() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
#endif

// One warp a block, lane 0 issuing: token i of the block's (blockIdx.x + i gridDim.x) in stage
// i % STAGES; its row's k stores go as one bulk group, and a stage is loaded again once the
// group that read it is done reading.
template <int STAGES>
__global__ void __launch_bounds__(32) scatter_bulk(const unsigned char* tokens, const int* dest, int topk, int count,
                                                   int row_bytes, unsigned char* rows) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ unsigned long long full[STAGES];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < STAGES; ++s) barrier_init(&full[s], 1);
  barrier_init_fence();
  const int mine = block_share(count);
  auto load = [&](int i) {
    const int s = i % STAGES;
    barrier_expect_bytes(&full[s], row_bytes);
    bulk_load(ring + s * row_bytes, tokens + static_cast<size_t>(blockIdx.x + i * gridDim.x) * row_bytes, row_bytes,
              &full[s]);
  };
  for (int i = 0; i < STAGES - 1 && i < mine; ++i) load(i);
  for (int i = 0; i < mine; ++i) {
    const int s = i % STAGES, t = blockIdx.x + i * gridDim.x;
    barrier_wait(&full[s], (i / STAGES) & 1);
    fence_async_shared();
    for (int c = 0; c < topk; ++c)
      bulk_store(rows + static_cast<size_t>(dest[t * topk + c]) * row_bytes, ring + s * row_bytes, row_bytes);
    bulk_commit();
    if (i + STAGES - 1 < mine) {
      bulk_wait_read_n<1>();  // group i - 1, which read stage (i + STAGES - 1) % STAGES, is done reading
      load(i + STAGES - 1);
    }
  }
  bulk_wait();
#endif
}

// A block of ROW_BLOCK threads per token at a time; a stage holds PIECE bytes of each of the
// token's k rows (k <= MAX_K), loaded by thread 0 with bulk copies; every thread sums its
// 16-byte vectors of the piece over the copies in order and stores them.
template <int STAGES, int PIECE, int MAX_K>
__global__ void __launch_bounds__(ROW_BLOCK) gather_bulk(const unsigned char* rows, const int* dest,
                                                       const float* weights, int topk, int count, int row_bytes,
                                                       unsigned char* tokens) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ unsigned long long full[STAGES];
  constexpr int STAGE_BYTES = PIECE * MAX_K;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) barrier_init(&full[s], 1);
    barrier_init_fence();
  }
  __syncthreads();
  const int pieces = row_bytes / PIECE;
  const int mine = block_share(count);
  const int steps = mine * pieces;
  auto load = [&](int i) {  // step i: piece i % pieces of the block's token i / pieces
    const int s = i % STAGES, t = blockIdx.x + (i / pieces) * gridDim.x, p = i % pieces;
    barrier_expect_bytes(&full[s], PIECE * topk);
    for (int c = 0; c < topk; ++c)
      bulk_load(ring + s * STAGE_BYTES + c * PIECE, rows + static_cast<size_t>(dest[t * topk + c]) * row_bytes +
                p * PIECE, PIECE, &full[s]);
  };
  if (threadIdx.x == 0)
    for (int i = 0; i < STAGES - 1 && i < steps; ++i) load(i);
  for (int i = 0; i < steps; ++i) {
    const int s = i % STAGES, t = blockIdx.x + (i / pieces) * gridDim.x, p = i % pieces;
    barrier_wait(&full[s], (i / STAGES) & 1);
    for (int v = threadIdx.x; v < PIECE / 16; v += ROW_BLOCK) {
      float sum[8] = {};
      for (int c = 0; c < topk; ++c) {
        Vec x;
        x.raw = reinterpret_cast<const uint4*>(ring + s * STAGE_BYTES + c * PIECE)[v];
        const float w = weights[t * topk + c];
#pragma unroll
        for (int e = 0; e < 8; ++e) sum[e] += w * to_float(x.elems[e]);
      }
      Vec y;
#pragma unroll
      for (int e = 0; e < 8; ++e) y.elems[e] = from_float<bf16>(sum[e]);
      reinterpret_cast<uint4*>(tokens + static_cast<size_t>(t) * row_bytes + p * PIECE)[v] = y.raw;
    }
    __syncthreads();  // every thread is done with stage (i - 1) % STAGES's reads too
    if (threadIdx.x == 0 && i + STAGES - 1 < steps) load(i + STAGES - 1);
  }
#endif
}

template <typename Launch>
static float milliseconds(Launch launch, int reps = 20) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  launch();
  CHECK(cudaEventRecord(start));
  for (int r = 0; r < reps; ++r) launch();
  CHECK(cudaEventRecord(stop));
  CHECK(cudaEventSynchronize(stop));
  float ms;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  CHECK(cudaGetLastError());
  return ms / reps;
}

// The times of `launches` (name, launch) and whether each output (`out`, `bytes` long) equals
// the first's.
static void time_and_check(const char* what, const std::vector<std::pair<const char*, std::function<void()>>>& launches,
                           const void* out, size_t bytes, double gb) {
  std::vector<unsigned char> first(bytes), got(bytes);
  printf("  %s:", what);
  for (size_t i = 0; i < launches.size(); ++i) {
    const auto& [name, launch] = launches[i];
    const float ms = milliseconds(launch);
    launch();
    CHECK(cudaMemcpy(i == 0 ? first.data() : got.data(), out, bytes, cudaMemcpyDeviceToHost));
    const bool same = i == 0 || memcmp(first.data(), got.data(), bytes) == 0;
    printf(" %s %.0f us (%.0f GB/s)%s", name, ms * 1e3, gb / ms * 1e3, same ? "" : " [DIFFERS from the first]");
  }
  printf("\n");
}

// A device copy of `host`.
template <typename T>
static T* to_device(const std::vector<T>& host) {
  T* device;
  CHECK(cudaMalloc(&device, host.size() * sizeof(T)));
  CHECK(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

template <int H, int E>
static void run(int tokens, int topk) {
  constexpr int ROW_BYTES = H * 2;
  const int rows = tokens * topk;
  // The layout: token t's copies in expert order, at dest[t * topk + i] and dest_rows[t, e];
  // weights alike, [T * k] for the benchmark's kernels and [T, E] for the library's.
  std::mt19937 rng(0);
  std::vector<std::vector<int>> chosen(tokens);
  std::vector<int> counts(E, 0), order(E);
  std::iota(order.begin(), order.end(), 0);
  for (int t = 0; t < tokens; ++t) {
    std::shuffle(order.begin(), order.end(), rng);
    chosen[t].assign(order.begin(), order.begin() + topk);
    std::sort(chosen[t].begin(), chosen[t].end());
    for (int e : chosen[t]) ++counts[e];
  }
  std::vector<int> next(E, 0), dest(rows), dest_rows(static_cast<size_t>(tokens) * E, -1);
  for (int e = 1; e < E; ++e) next[e] = next[e - 1] + counts[e - 1];
  std::vector<float> weights(rows), weights_te(static_cast<size_t>(tokens) * E, 0.f);
  std::vector<int> source(rows, -1);  // each row's token
  for (int t = 0; t < tokens; ++t)
    for (int i = 0; i < topk; ++i) {
      const size_t at = static_cast<size_t>(t) * E + chosen[t][i];
      dest[t * topk + i] = dest_rows[at] = next[chosen[t][i]]++;
      source[dest[t * topk + i]] = t;
      weights[t * topk + i] = weights_te[at] = (rng() % 1000) / 1000.f;
    }
  std::vector<unsigned short> host(static_cast<size_t>(rows) * H);
  for (auto& v : host) v = (rng() & 0x3fff) | 0x3c00;  // finite bf16 of moderate size
  const size_t token_bytes = static_cast<size_t>(tokens) * ROW_BYTES, row_total = static_cast<size_t>(rows) * ROW_BYTES;
  // x: the tokens, r: the rows (both start as `host`'s bytes), copy: the copy ceiling's destination.
  unsigned char *x, *r = reinterpret_cast<unsigned char*>(to_device(host)), *copy;
  CHECK(cudaMalloc(&x, token_bytes));
  CHECK(cudaMemcpy(x, host.data(), token_bytes, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&copy, row_total));
  int *dest_d = to_device(dest), *dest_rows_d = to_device(dest_rows), *source_d = to_device(source);
  float *weights_d = to_device(weights), *weights_te_d = to_device(weights_te);
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

  constexpr int SCATTER_STAGES = 4, GATHER_STAGES = 4, PIECE = ROW_BYTES % 2048 == 0 ? 2048 : ROW_BYTES, MAX_K = 8;
  const int scatter_shared = SCATTER_STAGES * ROW_BYTES, gather_shared = GATHER_STAGES * PIECE * MAX_K;
  CHECK(cudaFuncSetAttribute(scatter_bulk<SCATTER_STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, scatter_shared));
  CHECK(cudaFuncSetAttribute(gather_bulk<GATHER_STAGES, PIECE, MAX_K>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             gather_shared));
  const int scatter_per_sm = std::min(32, 200 * 1024 / scatter_shared), gather_per_sm = std::max(1, 200 * 1024 / gather_shared);
  const int token_blocks = (tokens + TOKENS_PER_BLOCK - 1) / TOKENS_PER_BLOCK;
  const bf16* tokens_in = reinterpret_cast<const bf16*>(x);
  const bf16* rows_in = reinterpret_cast<const bf16*>(r);

  const double gb = (token_bytes + row_total) / 1e9;  // either way: the tokens once, the rows once
  std::vector<std::pair<const char*, std::function<void()>>> scatters = {
      {"registers", [&] {
         scatter_rows<bf16, H, E, false, false, ROW_BLOCK, TOKENS_PER_BLOCK, ZERO_ROWS><<<token_blocks, ROW_BLOCK>>>(
             tokens_in, dest_rows_d, nullptr, nullptr, nullptr, nullptr, reinterpret_cast<bf16*>(r), tokens, rows,
             /*zero_unused=*/1);
       }},
      {"bulk", [&] {
         scatter_bulk<SCATTER_STAGES><<<sms * scatter_per_sm, 32, scatter_shared>>>(x, dest_d, topk, tokens, ROW_BYTES, r);
       }},
  };
  const int checked_blocks = token_blocks + (rows + ZERO_ROWS - 1) / ZERO_ROWS;
  // Combine's backward (unweighted): the same rows, the maps checked, every row the kernel's.
  std::vector<std::pair<const char*, std::function<void()>>> checked = {
      {"registers", [&] {
         scatter_rows<bf16, H, E, false, true, ROW_BLOCK, TOKENS_PER_BLOCK, ZERO_ROWS><<<checked_blocks, ROW_BLOCK>>>(
             tokens_in, dest_rows_d, source_d, nullptr, nullptr, nullptr, reinterpret_cast<bf16*>(r), tokens, rows,
             /*zero_unused=*/1);
       }},
  };
  std::vector<std::pair<const char*, std::function<void()>>> gathers = {
      {"registers", [&] {
         gather_rows<bf16, H, E, true, false, ROW_BLOCK, TOKENS_PER_BLOCK><<<token_blocks, ROW_BLOCK>>>(
             rows_in, dest_rows_d, weights_te_d, /*addend=*/nullptr, reinterpret_cast<bf16*>(x), tokens, rows);
       }},
      {"bulk", [&] {
         gather_bulk<GATHER_STAGES, PIECE, MAX_K><<<sms * gather_per_sm, ROW_BLOCK, gather_shared>>>(
             r, dest_d, weights_d, topk, tokens, ROW_BYTES, x);
       }},
  };
  for (int round = 0; round < 2; ++round) {
    const float ms_copy = milliseconds([&] { CHECK(cudaMemcpyAsync(copy, r, row_total, cudaMemcpyDeviceToDevice)); });
    printf("T %d H %d k %d E %d round %d: copy %.0f us (%.0f GB/s of %.2f GB)\n", tokens, H, topk, E, round,
           ms_copy * 1e3, 2 * row_total / 1e9 / ms_copy * 1e3, 2 * row_total / 1e9);
    time_and_check("scatter", scatters, r, row_total, gb);
    time_and_check("scatter, maps checked", checked, r, row_total, gb);
    time_and_check("gather", gathers, x, token_bytes, gb);
  }
  for (void* buffer : std::initializer_list<void*>{x, r, copy, dest_d, dest_rows_d, source_d, weights_d, weights_te_d})
    CHECK(cudaFree(buffer));
}

template <int H>
static int run_experts(int tokens, int topk, int experts) {
  if (experts == 8) run<H, 8>(tokens, topk);
  else if (experts == 32) run<H, 32>(tokens, topk);
  else if (experts == 128) run<H, 128>(tokens, topk);
  else return printf("experts 8, 32 or 128\n"), 1;
  return 0;
}

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? atoi(argv[1]) : 8192, hidden = argc > 2 ? atoi(argv[2]) : 7168;
  const int topk = argc > 3 ? atoi(argv[3]) : 8, experts = argc > 4 ? atoi(argv[4]) : 32;
  if (topk < 1 || topk > 8 || topk > experts) return printf("top-k 1 to 8, at most the experts\n"), 1;
  if (hidden == 7168) return run_experts<7168>(tokens, topk, experts);
  if (hidden == 2048) return run_experts<2048>(tokens, topk, experts);
  if (hidden == 1024) return run_experts<1024>(tokens, topk, experts);
  return printf("hidden 7168, 2048 or 1024\n"), 1;
}
