// Grouped GEMM kernels: `ragged_dot` (the rows of each group times that
// group's weights) and its transposed product (per group, the rows' outer
// products summed, over up to MAX_CHUNKS chunks of rows: a group's rows are
// its rows in each chunk, chunk after chunk). Group sizes and the window's
// first group are read from device memory; every bound is clamped (see
// `window_bounds`), so no size can make a kernel read or write out of bounds.
//
// Two implementations with one semantics:
// - Hopper (sm_90a), bf16/f16 with K and N multiples of 8: a persistent,
//   warp-specialised kernel. One warp of the first warpgroup loads tiles with
//   the tensor memory accelerator (TMA) into a ring of shared-memory stages;
//   two consumer warpgroups multiply them with `wgmma` (64 x BN each) and
//   store whole tiles through shared memory with TMA. Tiles are walked group
//   by group from the bounds computed on the device at the start of each
//   block. ragged_dot's blocks go in clusters of two over adjacent column
//   tiles where the tiles pair up, each loading half of the rows' A tile into
//   both (TMA multicast): a sixth less to read from L2 a stage.
// - Everywhere else (f32, odd shapes, other GPUs): a tiled SIMT kernel.
// Their block-scaled FP8 versions (float8_e4m3fn values, float32 scales) follow
// the same split: on Hopper, the same ring with e4m3 wgmma for the products
// whose operands are both K-major; SIMT kernels that dequantize on load
// elsewhere.
#include "common.cuh"
#include "hopper.cuh"

// Rows [bounds[i], bounds[i + 1]) belong to local group i: the sizes from
// group `*offset` on (negative sizes count as 0), every bound clamped to m,
// the offset to [0, groups]; local groups past the last group are empty.
// Run by one whole warp; `bounds` has local_groups + 1 entries.
__device__ void window_bounds(const int* __restrict__ sizes, int groups, const int* __restrict__ offset,
                              int local_groups, int m, int* bounds) {
  const int lane = threadIdx.x % 32;
  const int first = min(max(*offset, 0), groups);
  long long before = 0;  // rows of the groups before the window
  for (int base = 0; base < first; base += 32) {
    long long size = base + lane < first ? max(sizes[base + lane], 0) : 0;
    for (int delta = 16; delta > 0; delta /= 2) size += __shfl_xor_sync(0xffffffffu, size, delta);
    before += size;
  }
  for (int base = 0; base <= local_groups; base += 32) {
    const int i = base + lane;
    const long long size = i < local_groups && first + i < groups ? max(sizes[first + i], 0) : 0;
    long long inclusive = size;
    for (int delta = 1; delta < 32; delta *= 2) {
      const long long up = __shfl_up_sync(0xffffffffu, inclusive, delta);
      if (lane >= delta) inclusive += up;
    }
    if (i <= local_groups) bounds[i] = static_cast<int>(min(before + inclusive - size, static_cast<long long>(m)));
    before += __shfl_sync(0xffffffffu, inclusive, 31);
  }
}

// The bounds of a launch's window (one warp), for the SIMT kernels and, one
// launch per chunk, for the transposed products.
extern "C" __global__ void group_bounds(const int* __restrict__ sizes, int groups, const int* __restrict__ offset,
                                        int local_groups, int m, int* __restrict__ bounds) {
  window_bounds(sizes, groups, offset, local_groups, m, bounds);
}

// The most chunks of rows a transposed product takes: the launch passes
// MAX_CHUNKS operands (pointers or tensor maps) of each side, of which the
// first `chunks` are used.
constexpr int MAX_CHUNKS = 8;

// Rows [begin, end) of local group g in chunk c: `bounds` holds each chunk's
// local_groups + 1 bounds, chunk after chunk.
struct ChunkBounds {
  const int* __restrict__ bounds;
  int local_groups;
  __device__ int begin(int c, int g) const { return bounds[c * (local_groups + 1) + g]; }
  __device__ int end(int c, int g) const { return bounds[c * (local_groups + 1) + g + 1]; }
};

// ---------------------------------------------------------------------------
// SIMT: 64 x 64 output tiles, 256 threads of 4 x 4 outputs, 16-deep slices of
// the contraction through shared memory.

constexpr int SIMT_TILE = 64;
constexpr int SIMT_DEPTH = 16;
constexpr int SIMT_THREADS = 256;

// The launch (src/grouped_gemm/cuda.rs) passes its threads and the output
// tile its grid counts as template arguments: the ones this layout has, or
// the kernel does not compile.
template <int THREADS, int TILE>
__device__ __forceinline__ void check_simt_launch() {
  static_assert(THREADS == SIMT_THREADS, "16 x 16 threads of 4 x 4 outputs");
  static_assert(TILE == SIMT_TILE, "a 64 x 64 output tile a block");
}

// The rows of a SIMT block's 64 x 64 tile of out at (row0, col0) outside the
// window [bounds[0], bounds[local_groups]) (and below m) are zero.
template <typename O>
__device__ __forceinline__ void zero_rows_outside_window(O* __restrict__ out, const int* __restrict__ bounds,
                                                         int local_groups, int m, int n, int row0, int col0) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int first_row = bounds[0], last_row = bounds[local_groups];
  for (int i = 0; i < 4; ++i) {
    const int row = row0 + ty * 4 + i;
    if (row >= m || (row >= first_row && row < last_row)) continue;
    for (int j = 0; j < 4; ++j)
      if (col0 + tx + 16 * j < n) out[static_cast<size_t>(row) * n + col0 + tx + 16 * j] = from_float<O>(0.f);
  }
}

// The first local group ending after row0 (bounds are non-decreasing).
__device__ __forceinline__ int first_group_ending_after(const int* __restrict__ bounds, int local_groups, int row0) {
  int lo = 0, hi = local_groups;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (bounds[mid + 1] <= row0) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Writes a thread's 4 x 4 sums of the tile at (row0, col0) of out (row stride
// n): the rows in [begin, end), the columns below n.
template <typename O>
__device__ __forceinline__ void store_tile_rows(const float (&acc)[4][4], O* __restrict__ out, int row0, int col0,
                                                int begin, int end, int n) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  for (int i = 0; i < 4; ++i) {
    const int row = row0 + ty * 4 + i;
    if (row < begin || row >= end) continue;
    for (int j = 0; j < 4; ++j)
      if (col0 + tx + 16 * j < n) out[static_cast<size_t>(row) * n + col0 + tx + 16 * j] = from_float<O>(acc[i][j]);
  }
}

// Adds the 64 x 64 product of as (depth x rows) and bs (depth x columns) to acc.
__device__ __forceinline__ void simt_tile_product(const float (&as)[SIMT_DEPTH][SIMT_TILE + 1],
                                                  const float (&bs)[SIMT_DEPTH][SIMT_TILE], float (&acc)[4][4]) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int d = 0; d < SIMT_DEPTH; ++d) {
    float a[4], b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = as[d][ty * 4 + i];
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j] = bs[d][tx + 16 * j];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
  }
}

// out[r] = lhs[r] · w_i for the rows r of local group i (w_i = rhs[i], or
// rhs[i]ᵀ when RHS_TRANSPOSED); rows outside the window zero when
// zero_unused_rows, else left unwritten. A block owns a 64 x 64 tile of out
// and runs once per group its rows meet.
template <typename T, typename O, bool RHS_TRANSPOSED, int THREADS, int TILE>
__global__ void __launch_bounds__(THREADS) ragged_dot_simt(
    const T* __restrict__ lhs, const T* __restrict__ rhs, const int* __restrict__ bounds, int local_groups, int m,
    int k, int n, O* __restrict__ out, bool zero_unused_rows) {
  check_simt_launch<THREADS, TILE>();
  __shared__ float as[SIMT_DEPTH][SIMT_TILE + 1];
  __shared__ float bs[SIMT_DEPTH][SIMT_TILE];
  const int tiles_n = (n + SIMT_TILE - 1) / SIMT_TILE;
  const int row0 = blockIdx.x / tiles_n * SIMT_TILE, col0 = blockIdx.x % tiles_n * SIMT_TILE;
  if (zero_unused_rows) zero_rows_outside_window(out, bounds, local_groups, m, n, row0, col0);
  for (int g = first_group_ending_after(bounds, local_groups, row0); g < local_groups && bounds[g] < row0 + SIMT_TILE; ++g) {
    const int begin = max(bounds[g], row0), end = min(bounds[g + 1], row0 + SIMT_TILE);
    if (begin >= end) continue;  // block-uniform
    float acc[4][4] = {};
    const T* w = rhs + static_cast<size_t>(g) * k * n;
    for (int k0 = 0; k0 < k; k0 += SIMT_DEPTH) {
      for (int e = threadIdx.x; e < SIMT_DEPTH * SIMT_TILE; e += SIMT_THREADS) {
        const int r = e / SIMT_DEPTH, d = e % SIMT_DEPTH, row = row0 + r, kk = k0 + d;
        as[d][r] = row >= begin && row < end && kk < k ? to_float(lhs[static_cast<size_t>(row) * k + kk]) : 0.f;
        const int dd = e / SIMT_TILE, c = e % SIMT_TILE, col = col0 + c, kb = k0 + dd;
        float b = 0.f;
        if (kb < k && col < n)
          b = to_float(RHS_TRANSPOSED ? w[static_cast<size_t>(col) * k + kb] : w[static_cast<size_t>(kb) * n + col]);
        bs[dd][c] = b;
      }
      __syncthreads();
      simt_tile_product(as, bs, acc);
      __syncthreads();
    }
    store_tile_rows(acc, out, row0, col0, begin, end, n);
  }
}

// Each chunk's row-major lhs [m_c, k] and rhs [m_c, n].
template <typename T>
struct ChunkOperands {
  const T* lhs[MAX_CHUNKS];
  const T* rhs[MAX_CHUNKS];
};

// out[i] = lhs_iᵀ · rhs_i ([k, n]) over the rows of local group i in each
// chunk. A block owns a 64 x 64 tile of one group's output.
template <typename T, typename O, int THREADS, int TILE>
__global__ void __launch_bounds__(THREADS) transposed_ragged_dot_simt(
    const __grid_constant__ ChunkOperands<T> operands, int chunks, const ChunkBounds rows, int k, int n,
    O* __restrict__ out) {
  check_simt_launch<THREADS, TILE>();
  __shared__ float as[SIMT_DEPTH][SIMT_TILE + 1];
  __shared__ float bs[SIMT_DEPTH][SIMT_TILE];
  const int tiles_n = (n + SIMT_TILE - 1) / SIMT_TILE, tiles_k = (k + SIMT_TILE - 1) / SIMT_TILE;
  const int g = blockIdx.x / (tiles_k * tiles_n), tile = blockIdx.x % (tiles_k * tiles_n);
  const int k_0 = tile / tiles_n * SIMT_TILE, col0 = tile % tiles_n * SIMT_TILE;
  float acc[4][4] = {};
  for (int c = 0; c < chunks; ++c) {
    const T* __restrict__ lhs = operands.lhs[c];
    const T* __restrict__ rhs = operands.rhs[c];
    const int begin = rows.begin(c, g), end = rows.end(c, g);
    for (int r0 = begin; r0 < end; r0 += SIMT_DEPTH) {
      for (int e = threadIdx.x; e < SIMT_DEPTH * SIMT_TILE; e += SIMT_THREADS) {
        const int d = e / SIMT_TILE, col = e % SIMT_TILE, row = r0 + d;
        as[d][col] = row < end && k_0 + col < k ? to_float(lhs[static_cast<size_t>(row) * k + k_0 + col]) : 0.f;
        bs[d][col] = row < end && col0 + col < n ? to_float(rhs[static_cast<size_t>(row) * n + col0 + col]) : 0.f;
      }
      __syncthreads();
      simt_tile_product(as, bs, acc);
      __syncthreads();
    }
  }
  store_tile_rows(acc, out + static_cast<size_t>(g) * k * n, k_0, col0, 0, k, n);
}

// ---------------------------------------------------------------------------
// FP8: float8_e4m3fn values, one float32 scale per block of FP8_BLOCK along each
// blocked dimension (oxmoe.fp8's 1 x 128 rows, 128 x 128 weights, 128 x 1 rows
// of the weight gradient). Tiled like the SIMT kernels above, the values
// dequantized to float on load; each block's float partial is scaled by both
// operands' block scales and added to the result in block order (the CPU
// implementation's semantics, up to the order of each block's sum).

constexpr int FP8_BLOCK = 128;

// out[r] for the rows r of local group i: for each 128 of K, the partial of
// the products lhs[r, k] rhs[i][k, col] (rhs[i]ᵀ when RHS_TRANSPOSED: rhs[i] is
// [n, k] and its scales [n / 128, k / 128]) times lhs_scales[r, b] and the
// scale of rhs[i]'s block (b, col / 128); zero for rows outside the window. K
// and N are multiples of FP8_BLOCK.
template <typename O, bool RHS_TRANSPOSED, int THREADS, int TILE>
__global__ void __launch_bounds__(THREADS) fp8_ragged_dot_simt(
    const unsigned char* __restrict__ lhs, const float* __restrict__ lhs_scales, const unsigned char* __restrict__ rhs,
    const float* __restrict__ rhs_scales, const int* __restrict__ bounds, int local_groups, int m, int k, int n,
    O* __restrict__ out) {
  check_simt_launch<THREADS, TILE>();
  __shared__ float as[SIMT_DEPTH][SIMT_TILE + 1];
  __shared__ float bs[SIMT_DEPTH][SIMT_TILE];
  const int tiles_n = (n + SIMT_TILE - 1) / SIMT_TILE;
  const int row0 = blockIdx.x / tiles_n * SIMT_TILE, col0 = blockIdx.x % tiles_n * SIMT_TILE;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int k_blocks = k / FP8_BLOCK, n_blocks = n / FP8_BLOCK;
  zero_rows_outside_window(out, bounds, local_groups, m, n, row0, col0);
  for (int g = first_group_ending_after(bounds, local_groups, row0); g < local_groups && bounds[g] < row0 + SIMT_TILE; ++g) {
    const int begin = max(bounds[g], row0), end = min(bounds[g + 1], row0 + SIMT_TILE);
    if (begin >= end) continue;  // block-uniform
    const unsigned char* w = rhs + static_cast<size_t>(g) * k * n;
    const float* w_scales = rhs_scales + static_cast<size_t>(g) * k_blocks * n_blocks;
    float acc[4][4] = {};
    for (int b = 0; b < k_blocks; ++b) {
      float partial[4][4] = {};
      for (int k0 = b * FP8_BLOCK; k0 < (b + 1) * FP8_BLOCK; k0 += SIMT_DEPTH) {
        for (int e = threadIdx.x; e < SIMT_DEPTH * SIMT_TILE; e += SIMT_THREADS) {
          const int r = e / SIMT_DEPTH, d = e % SIMT_DEPTH, row = row0 + r, kk = k0 + d;
          as[d][r] = row >= begin && row < end ? e4m3_to_float(lhs[static_cast<size_t>(row) * k + kk]) : 0.f;
          const int dd = e / SIMT_TILE, c = e % SIMT_TILE, col = col0 + c, kb = k0 + dd;
          bs[dd][c] = col < n ? e4m3_to_float(RHS_TRANSPOSED ? w[static_cast<size_t>(col) * k + kb]
                                                             : w[static_cast<size_t>(kb) * n + col])
                              : 0.f;
        }
        __syncthreads();
        simt_tile_product(as, bs, partial);
        __syncthreads();
      }
      for (int i = 0; i < 4; ++i) {
        const int row = row0 + ty * 4 + i;
        const float row_scale = row >= begin && row < end ? lhs_scales[static_cast<size_t>(row) * k_blocks + b] : 0.f;
        for (int j = 0; j < 4; ++j) {
          const int col = col0 + tx + 16 * j;
          if (col >= n) continue;
          const int nb = col / FP8_BLOCK;
          const float col_scale = RHS_TRANSPOSED ? w_scales[nb * k_blocks + b] : w_scales[b * n_blocks + nb];
          acc[i][j] += partial[i][j] * (row_scale * col_scale);
        }
      }
    }
    store_tile_rows(acc, out, row0, col0, begin, end, n);
  }
}

// Each chunk's FP8 operands, token-contiguous: lhsᵀ [k, m_c], rhsᵀ [n, m_c],
// the scales of their 128-token blocks [m_c / 128, k] and [m_c / 128, n /
// RHS_BLOCK_COLUMNS] (RHS_BLOCK_COLUMNS: 1, or 128 for rhs in 128 x 128
// blocks: the kernels' template argument), and m_c.
struct Fp8ChunkOperands {
  const unsigned char* lhs[MAX_CHUNKS];
  const float* lhs_scales[MAX_CHUNKS];
  const unsigned char* rhs[MAX_CHUNKS];
  const float* rhs_scales[MAX_CHUNKS];
  int rows[MAX_CHUNKS];
};

// out[i] ([k, n]) over the rows of local group i in each chunk: for each
// 128-row block of a chunk, the partial of the products of its rows in the
// group, times lhs_scales[b, kr] rhs_scales[b, col / RHS_BLOCK_COLUMNS];
// blocks in order. A block of threads owns a 64 x 64 tile of one group's output.
template <typename O, int RHS_BLOCK_COLUMNS, int THREADS, int TILE>
__global__ void __launch_bounds__(THREADS) fp8_transposed_ragged_dot_simt(
    const __grid_constant__ Fp8ChunkOperands operands, int chunks, const ChunkBounds rows, int k, int n,
    O* __restrict__ out) {
  check_simt_launch<THREADS, TILE>();
  __shared__ float as[SIMT_DEPTH][SIMT_TILE + 1];
  __shared__ float bs[SIMT_DEPTH][SIMT_TILE];
  const int tiles_n = (n + SIMT_TILE - 1) / SIMT_TILE, tiles_k = (k + SIMT_TILE - 1) / SIMT_TILE;
  const int g = blockIdx.x / (tiles_k * tiles_n), tile = blockIdx.x % (tiles_k * tiles_n);
  const int k_0 = tile / tiles_n * SIMT_TILE, col0 = tile % tiles_n * SIMT_TILE;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int c = 0; c < chunks; ++c) {
    const unsigned char* __restrict__ lhs = operands.lhs[c];
    const unsigned char* __restrict__ rhs = operands.rhs[c];
    const size_t m_c = operands.rows[c];
    const int begin = rows.begin(c, g), end = rows.end(c, g);
    for (int block_start = begin; block_start < end; block_start = (block_start / FP8_BLOCK + 1) * FP8_BLOCK) {
      const int b = block_start / FP8_BLOCK, block_end = min(end, (b + 1) * FP8_BLOCK);
      float partial[4][4] = {};
      for (int r0 = block_start; r0 < block_end; r0 += SIMT_DEPTH) {
        // Consecutive threads take consecutive rows (tokens) of one column: contiguous bytes.
        for (int e = threadIdx.x; e < SIMT_DEPTH * SIMT_TILE; e += SIMT_THREADS) {
          const int d = e % SIMT_DEPTH, col = e / SIMT_DEPTH, row = r0 + d;
          as[d][col] = row < block_end && k_0 + col < k ? e4m3_to_float(lhs[(k_0 + col) * m_c + row]) : 0.f;
          bs[d][col] = row < block_end && col0 + col < n ? e4m3_to_float(rhs[(col0 + col) * m_c + row]) : 0.f;
        }
        __syncthreads();
        simt_tile_product(as, bs, partial);
        __syncthreads();
      }
      const float* rhs_scales = operands.rhs_scales[c] + static_cast<size_t>(b) * (n / RHS_BLOCK_COLUMNS);
      for (int i = 0; i < 4; ++i) {
        const int kr = k_0 + ty * 4 + i;
        const float lhs_scale = kr < k ? operands.lhs_scales[c][static_cast<size_t>(b) * k + kr] : 0.f;
        for (int j = 0; j < 4; ++j) {
          const int col = col0 + tx + 16 * j;
          if (col < n) acc[i][j] += partial[i][j] * (lhs_scale * rhs_scales[col / RHS_BLOCK_COLUMNS]);
        }
      }
    }
  }
  store_tile_rows(acc, out + static_cast<size_t>(g) * k * n, k_0, col0, 0, k, n);
}

// ---------------------------------------------------------------------------
// Hopper: TMA + wgmma, warp-specialised and persistent.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr int BLOCK_M = 128;        // output rows of a tile: 64 per consumer warpgroup
constexpr int BLOCK_K = 64;         // contraction per stage: 128 bytes of 16-bit elements, one swizzle row
constexpr int CHUNK_BYTES = 64 * 128;  // a 64-row, 128-byte-wide box: the unit of every TMA load and store
constexpr int HOPPER_THREADS = 384;  // a producer warpgroup and two consumer warpgroups
constexpr int CONSUMER_WARPS = 8;

// A Hopper kernel's tile width, its ring's stages, the most local groups
// its tables hold and the blocks of its clusters: the launch's choices
// (src/grouped_gemm/cuda.rs), passed as template arguments with the dynamic
// shared memory it gives them. The blocks of a cluster take adjacent column
// tiles of the same rows (a tile of the cluster, CLUSTER_BN columns wide) and
// share the rows' A tiles: each loads its 64 rows' for all of them.
template <int BN_, int STAGES_, int MAX_LOCAL_GROUPS_, int CLUSTER_ = 1> struct HopperConfig {
  static constexpr int BN = BN_;
  static constexpr int STAGES = STAGES_;
  static constexpr int MAX_LOCAL_GROUPS = MAX_LOCAL_GROUPS_;
  static constexpr int CLUSTER = CLUSTER_;
  static constexpr int CLUSTER_BN = BN * CLUSTER;
  static constexpr int A_BYTES = BLOCK_M * BLOCK_K * 2;
  static constexpr int B_BYTES = BLOCK_K * BN * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  // A consumer warpgroup's 64 output rows of 16-bit elements on their way
  // out, rows padded by 16 bytes so that neither side conflicts on banks.
  static constexpr int OUT_PITCH = BN + 8;
  static constexpr int OUT_BYTES = 2 * 64 * OUT_PITCH * 2;
  static constexpr int SCALE_BYTES = 0;  // the stages carry no scales
  // Alignment slack, the stages, the output rows, full and empty barriers,
  // the group tables.
  static constexpr int SHARED_BYTES =
      1024 + STAGES * STAGE_BYTES + OUT_BYTES + 2 * STAGES * 8 + 2 * (MAX_LOCAL_GROUPS + 1) * 4;
};

// A Hopper kernel launched with THREADS threads and SHARED_BYTES of dynamic
// shared memory: what its warpgroups and its layout take, or it does not compile.
template <typename Config, int THREADS, int SHARED_BYTES>
__device__ __forceinline__ void check_hopper_launch() {
  static_assert(THREADS == HOPPER_THREADS, "a producer warpgroup and two consumer warpgroups");
  static_assert(SHARED_BYTES == Config::SHARED_BYTES, "the launch's dynamic shared memory is this layout's");
}

// The shared memory of a Hopper kernel: stages of A and B tiles (1024-byte
// aligned, as the 128-byte swizzle wants), their barriers, each stage's
// scales (16-byte aligned, as bulk copies want; FP8 weight gradient only),
// the group tables.
template <typename Config>
struct Shared {
  unsigned char* a;  // STAGES x A_BYTES
  unsigned char* b;  // STAGES x B_BYTES
  unsigned short* out;  // each consumer warpgroup's 64 x OUT_PITCH output rows
  unsigned long long* full;   // a stage's loads have landed
  unsigned long long* empty;  // the consumers are done with a stage
  float* scales;  // STAGES x SCALE_BYTES
  int* bounds;  // local group i: rows [bounds[i], bounds[i + 1])
  int* tiles;   // ragged_dot: the first tile of each local group

  __device__ static Shared carve(unsigned char* raw) {
    unsigned char* base = raw + ((1024 - shared_address(raw) % 1024) % 1024);
    Shared s;
    s.a = base;
    s.b = base + Config::STAGES * Config::A_BYTES;
    s.out = reinterpret_cast<unsigned short*>(base + Config::STAGES * Config::STAGE_BYTES);
    s.full = reinterpret_cast<unsigned long long*>(base + Config::STAGES * Config::STAGE_BYTES + Config::OUT_BYTES);
    s.empty = s.full + Config::STAGES;
    s.scales = reinterpret_cast<float*>(s.empty + Config::STAGES);
    s.bounds = reinterpret_cast<int*>(s.scales + Config::STAGES * Config::SCALE_BYTES / 4);
    s.tiles = s.bounds + Config::MAX_LOCAL_GROUPS + 1;
    return s;
  }

  // A stage is empty once the consumer warps of every block of the cluster
  // are done with it: the loads that refill it write each block's.
  __device__ void init_barriers() const {
    for (int s = 0; s < Config::STAGES; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], CONSUMER_WARPS * Config::CLUSTER);
    }
    barrier_init_fence();
  }
};

// After committing the current stage's wgmma: waits for the previous
// stage's (the current ones keep the tensor cores busy meanwhile) and, if
// there was one, releases it to the producers.
template <int CLUSTER = 1>
__device__ __forceinline__ void release_previous_stage(unsigned long long* empty, const Ring& ring, int stages,
                                                       bool has_previous) {
  wgmma_wait<1>();
  if (has_previous) release_stage<CLUSTER>(empty, (ring.stage + stages - 1) % stages);
}

// Named barrier `barrier` of `threads` threads: wait for all of them, or
// count this warp's arrival and go on.
__device__ __forceinline__ void named_sync(int barrier, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int barrier, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(barrier), "r"(threads) : "memory");
}

// Waits for the rest of this consumer warpgroup at its named barrier over
// its output staging (3 or 4).
__device__ __forceinline__ void staging_sync() { named_sync(2 + threadIdx.x / 128, 128); }

// Stores a consumer warpgroup's 64 x BN accumulators at out (row stride n):
// rows below row_end, columns below n (a multiple of 8). 16-bit outputs go
// through the warpgroup's rows in shared memory (`staging`), so that global
// stores are 16 bytes a thread and whole rows a warp; float32 ones straight
// from the registers, a pair of columns at a time.
template <typename O, typename Config>
__device__ __forceinline__ void store_tile(const float (&d)[Config::BN / 2], unsigned short* staging, O* out, int row0,
                                           int row_end, int col0, int n) {
  constexpr int BN = Config::BN;
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int row = warp * 16 + lane / 4;
  if constexpr (sizeof(O) == 4) {
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      const int col = col0 + 8 * i + 2 * (lane % 4);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = row0 + row + 8 * half;
        if (col < n && r < row_end)
          *reinterpret_cast<float2*>(out + static_cast<size_t>(r) * n + col) =
              make_float2(d[4 * i + 2 * half], d[4 * i + 2 * half + 1]);
      }
    }
  } else {
    constexpr int PITCH = Config::OUT_PITCH;
    staging_sync();  // the previous tile's rows have left
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *reinterpret_cast<unsigned*>(staging + (row + 8 * half) * PITCH + 8 * i + 2 * (lane % 4)) =
            from_floats<O>(d[4 * i + 2 * half], d[4 * i + 2 * half + 1]);
    }
    staging_sync();
    constexpr int VECTORS = BN / 8;  // 16-byte vectors of a row
    for (int e = threadIdx.x % 128; e < 64 * VECTORS; e += 128) {
      const int r = e / VECTORS, c = e % VECTORS * 8;
      if (row0 + r < row_end && col0 + c < n)
        *reinterpret_cast<uint4*>(out + static_cast<size_t>(row0 + r) * n + col0 + c) =
            *reinterpret_cast<const uint4*>(staging + r * PITCH + c);
    }
  }
}

// The thread of a consumer warpgroup that issues its tiles' bulk stores.
__device__ __forceinline__ bool stores_tiles_in_bulk() { return threadIdx.x % 128 == 0; }

// The shared-memory address of 16-byte piece p (columns 8p to 8p + 7) of row r
// in a 64 x 64 box of 16-bit elements laid out as a 128-byte-swizzled tensor
// map wants: the swizzle puts it at piece p ^ r % 8 of the row's 128 bytes.
__device__ __forceinline__ unsigned char* box_piece(unsigned char* box, unsigned r, unsigned p) {
  return box + r * 128 + ((p ^ r % 8) << 4);
}

// Writes a consumer warpgroup's 64 x WIDTH sums (a thread's first WIDTH / 2)
// at `boxes` as 16-bit O: WIDTH / 64 boxes of 64 x 64, laid out as a
// 128-byte-swizzled tensor map wants.
template <typename O, int WIDTH>
__device__ __forceinline__ void write_boxes(const float* sums, unsigned char* boxes) {
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < WIDTH / 8; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // Columns 8i + 2 (lane % 4) and + 1 of row r: in box i / 8, piece i % 8.
      const int r = warp * 16 + lane / 4 + 8 * half;
      *reinterpret_cast<unsigned*>(box_piece(boxes + i / 8 * CHUNK_BYTES, r, i % 8) + lane % 4 * 4) =
          from_floats<O>(sums[4 * i + 2 * half], sums[4 * i + 2 * half + 1]);
    }
  }
}

// Stores a consumer warpgroup's 64 x BN sums of a tile at (row0, col0) of out
// (row stride n): rows below row_end. When all 64 rows are the tile's (none
// of another group, none past the end), the warpgroup writes them into
// `staging` as BN / 64 boxes of 64 x 64, laid out as the output map's
// 128-byte swizzle wants, and one thread stores them with TMA (the map clips
// the columns at n): the consumers go on to the next tile without waiting
// for the stores. Otherwise (and for float32 outputs) through `store_tile`.
// Either path writes `staging` only once the previous bulk store has read it.
template <typename O, typename Config>
__device__ __forceinline__ void store_tile_in_bulk(const float (&sums)[Config::BN / 2], unsigned short* staging,
                                                   const TensorMap* out_map, O* out, int row0, int row_end, int col0,
                                                   int n) {
  static_assert(64 * Config::OUT_PITCH * 2 % 1024 == 0, "each warpgroup's staging 1024-byte aligned, as the swizzle wants");
  static_assert(Config::BN / 64 * CHUNK_BYTES <= 64 * Config::OUT_PITCH * 2, "the boxes fit a warpgroup's staging");
  const bool leader = stores_tiles_in_bulk();
  if (leader) bulk_wait_read();
  if constexpr (sizeof(O) == 2) {
    if (row0 + 64 <= row_end) {
      unsigned char* boxes = reinterpret_cast<unsigned char*>(staging);
      staging_sync();
      write_boxes<O, Config::BN>(sums, boxes);
      fence_async_shared();
      staging_sync();
      if (leader) {
#pragma unroll
        for (int box = 0; box < Config::BN / 64; ++box) tma_store(out_map, boxes + box * CHUNK_BYTES, col0 + 64 * box, row0);
        bulk_commit();
      }
      return;
    }
  }
  store_tile<O, Config>(sums, staging, out, row0, row_end, col0, n);
}

// act(x) in the epilogue, without a branch: x sigmoid(z), z = x (SiLU) or
// 2 sqrt(2 / pi) (x + 0.044715 x^3) (GELU's tanh approximation: (1 +
// tanh(z / 2)) / 2 is sigmoid(z)), as x / (1 + 2^(-z log2 e)) with the
// special-function unit's exponential and reciprocal: within a few float32
// ulps of value_and_slope's value, where the correctly rounded reciprocal's
// slow path, a call per value, cost the epilogue more than the pass it
// replaces (bench/NOTES.md). Both flush subnormal results to zero, which
// changes nothing here (an exponential below 2^-126 vanishes next to 1), and
// saves their range fix-ups; where 1 + e^-z passes 2^126 the value is 0 (a
// tail below 1e-36, as __fdividef's).
template <bool GELU>
__device__ __forceinline__ float epilogue_activation(float x) {
  const float z = GELU ? 2.f * GELU_SCALE * (x + GELU_CUBIC * x * x * x) : x;
  float exponential, reciprocal;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(exponential) : "f"(z * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(reciprocal) : "f"(1.f + exponential));
  return x * reciprocal;
}

// ragged_dot_activation's epilogue is split between the consumers and the
// producer warpgroup's other three warps, the helpers: the consumers stage a
// tile's pre-activation and go on to the next tile's main loop, the helpers
// store it, compute the hidden activation from it and store that
// (store_staged_activation). Named barriers pass the staging between the 256
// consumers and the 96 helpers (5: staged, 6: free again); the helpers meet at 7.
constexpr int HELPERS = 96, STAGED_BARRIER = 5, DRAINED_BARRIER = 6, HELPERS_BARRIER = 7;
__device__ __forceinline__ bool is_helper() { return threadIdx.x >= 32 && threadIdx.x < 32 + HELPERS; }
// The helper that issues the bulk stores.
__device__ __forceinline__ bool leads_helpers() { return threadIdx.x == 32; }
__device__ __forceinline__ void helpers_sync() { named_sync(HELPERS_BARRIER, HELPERS); }

// Copies rows [0, rows) of COUNT staged 64 x 64 boxes to dst (row 0 of the
// tile's 64 rows, row stride `stride`) with the helpers, 16 bytes a thread:
// box b holds columns col0 + 64 (b % PER_HALF) of the (b / PER_HALF)-th
// `features` columns of each row; columns from `features` on are left out.
template <typename O, int COUNT, int PER_HALF>
__device__ __forceinline__ void copy_staged_rows(unsigned char* boxes, O* dst, int stride, int rows, int col0,
                                                 int features) {
  for (unsigned e = threadIdx.x - 32; e < COUNT * 64 * 8; e += HELPERS) {
    const unsigned box = e / 512, r = e / 8 % 64, piece = e % 8;
    const int col = col0 + 64 * (box % PER_HALF) + 8 * piece;
    if (static_cast<int>(r) < rows && col < features)
      *reinterpret_cast<uint4*>(dst + static_cast<size_t>(r) * stride + box / PER_HALF * features + col) =
          *reinterpret_cast<const uint4*>(box_piece(boxes + box * CHUNK_BYTES, r, piece));
  }
}

// The helpers' part of ragged_dot_activation's epilogue: the two consumer
// warpgroups have staged the tile's pre-activation at W hidden columns from
// col0, rows row0 + 64 half on at staging + half * half_bytes (write_boxes;
// gated, the gate's W / 64 boxes then the up's). The helpers store it in out,
// put the hidden activation in place of each half's first W / 64 boxes,
// act(gate) * up (ungated: act(x)) rounded to O, and store it in hidden. 64
// rows all the tile's leave by TMA (out_map, hidden_map: see
// ragged_dot_hopper), the others 16 bytes a thread, rows below row_end. On
// return the staging is free again.
template <typename O, int ACTIVATION, int W>
__device__ __forceinline__ void store_staged_activation(unsigned char* staging, int half_bytes,
                                                        const TensorMap* out_map, const TensorMap* hidden_map, O* out,
                                                        O* hidden, int row0, int row_end, int col0, int features) {
  constexpr bool GATED = is_gated(ACTIVATION);
  constexpr int HIDDEN_BOXES = W / 64, BOXES = GATED ? 2 * HIDDEN_BOXES : HIDDEN_BOXES;
  const bool leader = leads_helpers();
  const int width = GATED ? 2 * features : features;
  // Stores each half's first `boxes` boxes: 64 rows all the tile's by TMA (the
  // leader hands each box to tma(its shared memory, box, first row) and waits
  // for the reads), the others by every helper (copy(the half's boxes, first row)).
  auto store = [&](int boxes, auto tma, auto copy) {
    for (int half = 0; half < 2; ++half) {
      const int rows0 = row0 + 64 * half;
      unsigned char* at = staging + half * half_bytes;
      if (rows0 + 64 > row_end) {
        copy(at, rows0);
      } else if (leader) {
        for (int box = 0; box < boxes; ++box) tma(at + box * CHUNK_BYTES, box, rows0);
      }
    }
    if (leader) {
      bulk_commit();
      bulk_wait_read();
    }
  };
  store(
      BOXES,
      [&](const unsigned char* box_at, int box, int rows0) {
        if constexpr (GATED) {
          tma_store(out_map, box_at, col0 + 64 * (box % HIDDEN_BOXES), box / HIDDEN_BOXES, rows0);
        } else {
          tma_store(out_map, box_at, col0 + 64 * box, rows0);
        }
      },
      [&](unsigned char* at, int rows0) {
        copy_staged_rows<O, BOXES, HIDDEN_BOXES>(at, out + static_cast<size_t>(rows0) * width, width, row_end - rows0,
                                                 col0, features);
      });
  helpers_sync();  // the gate's boxes are read
  for (unsigned e = threadIdx.x - 32; e < 2 * HIDDEN_BOXES * 512; e += HELPERS) {
    const unsigned box = e / 512;  // of both halves' hidden boxes
    unsigned char* piece =
        box_piece(staging + box / HIDDEN_BOXES * half_bytes + box % HIDDEN_BOXES * CHUNK_BYTES, e / 8 % 64, e % 8);
    Pack<O, 16> x, up, h;
    x.raw = *reinterpret_cast<const uint4*>(piece);
    if constexpr (GATED) up.raw = *reinterpret_cast<const uint4*>(piece + HIDDEN_BOXES * CHUNK_BYTES);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float value = epilogue_activation<is_gelu(ACTIVATION)>(to_float(x.elems[i]));
      h.elems[i] = from_float<O>(GATED ? value * to_float(up.elems[i]) : value);
    }
    *reinterpret_cast<uint4*>(piece) = h.raw;
  }
  fence_async_shared();
  helpers_sync();  // the hidden activation is staged
  store(
      HIDDEN_BOXES,
      [&](const unsigned char* box_at, int box, int rows0) { tma_store(hidden_map, box_at, col0 + 64 * box, rows0); },
      [&](unsigned char* at, int rows0) {
        copy_staged_rows<O, HIDDEN_BOXES, HIDDEN_BOXES>(at, hidden + static_cast<size_t>(rows0) * features, features,
                                                        row_end - rows0, col0, features);
      });
}

// Before a consumer warpgroup exits: its last tiles' bulk stores have completed.
__device__ __forceinline__ void finish_bulk_stores() {
  if (stores_tiles_in_bulk()) bulk_wait();
}

// Before the consumer warpgroups of a block of a CLUSTER-block cluster exit:
// their bulk stores have completed, and no block exits while another of its
// cluster may still arrive on its barriers.
template <int CLUSTER>
__device__ __forceinline__ void finish_clustered_consumers() {
  finish_bulk_stores();
  if constexpr (CLUSTER > 1) cluster_sync();
}

// A block's share of a persistent kernel's tiles in clusters of CLUSTER
// blocks: every block of a cluster takes the cluster's tiles (first, then
// every stride-th), each block the columns of its rank.
struct ClusterTiles {
  int rank, first, stride;
};
template <int CLUSTER>
__device__ __forceinline__ ClusterTiles cluster_tiles() {
  return {CLUSTER > 1 ? static_cast<int>(cluster_rank()) : 0, static_cast<int>(blockIdx.x / CLUSTER),
          static_cast<int>(gridDim.x / CLUSTER)};
}

// Zeroes rows [row0, row_end) x columns [col0, col0 + BN) ∩ [0, n) of out
// (row stride `stride`) with the 256 consumer threads (n, stride and out's
// offset multiples of 8).
template <typename O, int BN>
__device__ __forceinline__ void zero_tile(O* out, int row0, int row_end, int col0, int n, int stride) {
  constexpr int PER = 16 / sizeof(O);
  const int rows = min(row_end - row0, BLOCK_M), columns = min(BN, n - col0) / PER;
  for (int e = threadIdx.x - 128; e < rows * (BN / PER); e += 256) {
    const int r = e / (BN / PER), c = e % (BN / PER);
    if (c < columns)
      *reinterpret_cast<uint4*>(out + static_cast<size_t>(row0 + r) * stride + col0 + c * PER) = make_uint4(0, 0, 0, 0);
  }
}

// The tile order of ragged_dot: the tiles of local group 0 (row blocks of 128,
// each across the columns), then group 1's, ..., then, when zero_unused_rows,
// tiles of zeros over the rows before and after the window (without them the
// walk ends with the groups' tiles, and those rows are left unwritten).
template <int BN>
struct RaggedTiles {
  const int* bounds;
  const int* tiles;
  int local_groups, m, n;
  int column_tiles, group_tiles, head_tiles, total;
  int cursor = 0;  // the group of the last tile asked for (tiles are asked in order)

  __device__ RaggedTiles(const int* bounds, const int* tiles, int local_groups, int m, int n, bool zero_unused_rows)
      : bounds(bounds), tiles(tiles), local_groups(local_groups), m(m), n(n) {
    column_tiles = (n + BN - 1) / BN;
    group_tiles = tiles[local_groups];
    head_tiles = (bounds[0] + BLOCK_M - 1) / BLOCK_M * column_tiles;
    const int tail_tiles = (m - bounds[local_groups] + BLOCK_M - 1) / BLOCK_M * column_tiles;
    total = group_tiles + (zero_unused_rows ? head_tiles + tail_tiles : 0);
  }

  struct Tile {
    bool zeros;
    int group, row0, row_end, col0;
  };

  __device__ Tile at(int t) {
    if (t < group_tiles) {
      while (tiles[cursor + 1] <= t) ++cursor;
      const int local = t - tiles[cursor];
      return {false, cursor, bounds[cursor] + local / column_tiles * BLOCK_M, bounds[cursor + 1],
              local % column_tiles * BN};
    }
    int z = t - group_tiles;
    const bool head = z < head_tiles;
    if (!head) z -= head_tiles;
    const int row0 = (head ? 0 : bounds[local_groups]) + z / column_tiles * BLOCK_M;
    return {true, -1, row0, head ? bounds[0] : m, z % column_tiles * BN};
  }
};

// The tile order of a transposed product: each local group's [k, n] output in
// tiles of 128 rows by BN columns, row-block-major, group after group.
template <int BN>
struct TransposedTiles {
  int column_tiles, per_group, total;

  __device__ TransposedTiles(int local_groups, int k, int n)
      : column_tiles((n + BN - 1) / BN), per_group((k + BLOCK_M - 1) / BLOCK_M * column_tiles),
        total(local_groups * per_group) {}

  struct Tile {
    int group, row0, col0;
  };

  __device__ Tile at(int t) const {
    const int local = t % per_group;
    return {t / per_group, local / column_tiles * BLOCK_M, local % column_tiles * BN};
  }
};

// The first tile of each local group (rows in blocks of 128, columns in
// blocks of BN), after bounds; one warp.
template <int BN>
__device__ void group_tiles(const int* bounds, int local_groups, int n, int* tiles) {
  const int lane = threadIdx.x % 32, column_tiles = (n + BN - 1) / BN;
  int before = 0;
  for (int base = 0; base <= local_groups; base += 32) {
    const int i = base + lane;
    const int count = i < local_groups ? (bounds[i + 1] - bounds[i] + BLOCK_M - 1) / BLOCK_M * column_tiles : 0;
    int inclusive = count;
    for (int delta = 1; delta < 32; delta *= 2) {
      const int up = __shfl_up_sync(0xffffffffu, inclusive, delta);
      if (lane >= delta) inclusive += up;
    }
    if (i <= local_groups) tiles[i] = before + inclusive - count;
    before += __shfl_sync(0xffffffffu, inclusive, 31);
  }
}

// The start of a ragged_dot kernel: its shared memory carved, the barriers
// set up, the window's row bounds and each local group's first tile of the
// cluster (n columns in tiles of CLUSTER_COLUMNS) in the tables (one warp),
// every thread waiting for them (and for the other blocks of the cluster,
// whose loads and arrivals reach this block's barriers).
template <typename Config, int CLUSTER_COLUMNS = Config::CLUSTER_BN>
__device__ __forceinline__ Shared<Config> start_ragged_dot(unsigned char* raw, const int* group_sizes, int groups,
                                                           const int* group_offset, int local_groups, int m, int n) {
  const Shared<Config> s = Shared<Config>::carve(raw);
  if (threadIdx.x == 0) s.init_barriers();
  if (threadIdx.x < 32) {
    window_bounds(group_sizes, groups, group_offset, local_groups, m, s.bounds);
    __syncwarp();
    group_tiles<CLUSTER_COLUMNS>(s.bounds, local_groups, n, s.tiles);
  }
  if constexpr (Config::CLUSTER > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }
  return s;
}

// The start of a transposed product's Hopper kernel: its shared memory carved
// and its barriers set up, every thread waiting for them.
template <typename Config>
__device__ __forceinline__ Shared<Config> start_transposed(unsigned char* raw) {
  const Shared<Config> s = Shared<Config>::carve(raw);
  if (threadIdx.x == 0) s.init_barriers();
  __syncthreads();
  return s;
}

// Producer warpgroup: 40 registers; consumers: 232 (of 64K for 384 threads).
__device__ __forceinline__ void producer_registers() { asm volatile("setmaxnreg.dec.sync.aligned.u32 40;"); }
__device__ __forceinline__ void consumer_registers() { asm volatile("setmaxnreg.inc.sync.aligned.u32 232;"); }

// A stage's A tile at `a`: 128 rows of 128 bytes from (c0, row0) of `map`.
// In a cluster (whose blocks take the same rows) block `rank` loads its share
// of the rows into every block's stage, whose full barriers count them.
template <int CLUSTER>
__device__ __forceinline__ void load_a_tile(unsigned char* a, const TensorMap* map, unsigned long long* full, int c0,
                                            int row0, int rank) {
  if constexpr (CLUSTER == 1) {
    tma_load(a, map, full, c0, row0);
  } else {
    constexpr int ROWS = BLOCK_M / CLUSTER;
    tma_load_multicast(a + rank * ROWS * 128, map, full, c0, row0 + rank * ROWS, (1 << CLUSTER) - 1);
  }
}

// ragged_dot on Hopper, in clusters of CLUSTER blocks (1 or 2; with 2, the
// launch's grid is even and n spans an even number of BN-column tiles).
// lhs_map: lhs [m, k], box 64 x (128 / CLUSTER) rows. rhs_map: rhs [groups,
// k, n] (box 64 columns x 64 rows x 1) or, RHS_K_MAJOR, [groups, n, k] (box
// 64 x BN rows x 1). out_map: out [m, n], 64 x 64 boxes (16-bit outputs;
// float32 ones are stored from registers).
//
// With an ACTIVATION (ragged_dot_activation; rhs [groups, k, n], 16-bit), out
// is the pre-activation and `hidden` [m, F] its activation (hidden_map, 64 x
// 64 boxes), F = n / 2 gated, else n. Tiles then span W = BN / 2 columns of
// F gated, their B tiles the gate's W columns then the up's (columns F + j),
// so that a thread holds both sums of its columns; out_map sees out as [m,
// 2, F] when gated. The producer warpgroup's warps 1-3 store each tile (see
// store_staged_activation).
//
// The rows outside the window are zero in out (and hidden) when
// zero_unused_rows, else left unwritten (see RaggedTiles).
template <typename T, typename O, bool RHS_K_MAJOR, int CLUSTER, int ACTIVATION, int BN, int STAGES,
          int MAX_LOCAL_GROUPS, int THREADS, int SHARED_BYTES>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 1) ragged_dot_hopper(
    const __grid_constant__ TensorMap lhs_map, const __grid_constant__ TensorMap rhs_map,
    const int* __restrict__ group_sizes, int groups, const int* __restrict__ group_offset, int local_groups, int m,
    int k, int n, O* __restrict__ out, const __grid_constant__ TensorMap out_map, O* __restrict__ hidden,
    const __grid_constant__ TensorMap hidden_map, bool zero_unused_rows) {
  using Config = HopperConfig<BN, STAGES, MAX_LOCAL_GROUPS, CLUSTER>;
  constexpr bool ACTIVATED = ACTIVATION != NO_ACTIVATION, GATED = is_gated(ACTIVATION);
  static_assert(!ACTIVATED || (!RHS_K_MAJOR && sizeof(O) == 2), "activations take rhs [groups, k, n], 16-bit out");
  // A tile's columns of the hidden activation (of out, unactivated) and F.
  constexpr int W = GATED ? BN / 2 : BN;
  const int features = GATED ? n / 2 : n;
  check_hopper_launch<Config, THREADS, SHARED_BYTES>();
  extern __shared__ unsigned char raw[];
  const Shared<Config> s =
      start_ragged_dot<Config, W * CLUSTER>(raw, group_sizes, groups, group_offset, local_groups, m, features);
  RaggedTiles<W * CLUSTER> walk(s.bounds, s.tiles, local_groups, m, features, zero_unused_rows);
  const int k_blocks = (k + BLOCK_K - 1) / BLOCK_K;
  const auto [rank, first, clusters] = cluster_tiles<CLUSTER>();
  Ring ring;

  if (threadIdx.x < 128) {
    producer_registers();
    if constexpr (ACTIVATED) {
      if (is_helper()) {
        for (int t = first; t < walk.total; t += clusters) {
          const auto tile = walk.at(t);
          if (tile.zeros) continue;
          named_sync(STAGED_BARRIER, 256 + HELPERS);
          store_staged_activation<O, ACTIVATION, W>(reinterpret_cast<unsigned char*>(s.out), 64 * Config::OUT_PITCH * 2,
                                                    &out_map, &hidden_map, out, hidden, tile.row0, tile.row_end,
                                                    tile.col0 + rank * W, features);
          named_arrive(DRAINED_BARRIER, 256 + HELPERS);
        }
        if (leads_helpers()) bulk_wait();
        return;
      }
    }
    if (threadIdx.x != 0) return;
    for (int t = first; t < walk.total; t += clusters) {
      const auto tile = walk.at(t);
      if (tile.zeros) continue;
      const int col0 = tile.col0 + rank * W;
      for (int kb = 0; kb < k_blocks; ++kb, ring.advance<Config::STAGES>()) {
        barrier_wait(&s.empty[ring.stage], ring.phase ^ 1);
        unsigned long long* full = &s.full[ring.stage];
        barrier_expect_bytes(full, Config::STAGE_BYTES);
        load_a_tile<CLUSTER>(s.a + ring.stage * Config::A_BYTES, &lhs_map, full, kb * BLOCK_K, tile.row0, rank);
        unsigned char* b = s.b + ring.stage * Config::B_BYTES;
        if constexpr (RHS_K_MAJOR) {
          tma_load(b, &rhs_map, full, kb * BLOCK_K, col0, tile.group);
        } else {
#pragma unroll
          for (int j = 0; j < BN / 64; ++j) {
            // Gated, boxes W / 64 on are the up half's, F columns on.
            const int column = GATED ? col0 + 64 * (j % (W / 64)) + j / (W / 64) * features : col0 + 64 * j;
            tma_load(b + j * CHUNK_BYTES, &rhs_map, full, column, kb * BLOCK_K, tile.group);
          }
        }
      }
    }
    return;
  }

  consumer_registers();
  const int half = threadIdx.x / 128 - 1;  // this warpgroup's 64 rows of the tile
  float d[BN / 2];
  bool staged = false;  // ACTIVATED: a tile is in the staging, with the helper warps
  for (int t = first; t < walk.total; t += clusters) {
    const auto tile = walk.at(t);
    const int col0 = tile.col0 + rank * W;
    if (tile.zeros) {
      if constexpr (GATED) {
        zero_tile<O, W>(out, tile.row0, tile.row_end, col0, features, n);
        zero_tile<O, W>(out + features, tile.row0, tile.row_end, col0, features, n);
      } else {
        zero_tile<O, BN>(out, tile.row0, tile.row_end, col0, n, n);
      }
      if constexpr (ACTIVATED) zero_tile<O, W>(hidden, tile.row0, tile.row_end, col0, features, features);
      continue;
    }
    // Zeroing d (rather than a first wgmma that ignores it) tells the compiler
    // that d is dead between tiles, which keeps the consumers from spilling.
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    for (int kb = 0; kb < k_blocks; ++kb, ring.advance<Config::STAGES>()) {
      barrier_wait(&s.full[ring.stage], ring.phase);
      const unsigned char* a = s.a + ring.stage * Config::A_BYTES + half * (BLOCK_M / 2) * 128;
      const unsigned char* b = s.b + ring.stage * Config::B_BYTES;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
        // 16 deep: 32 bytes along a K-major row, or 16 rows of an MN-major tile.
        const auto desc_b = RHS_K_MAJOR ? matrix_descriptor(b + kk * 32, 16)
                                        : matrix_descriptor(b + kk * 16 * 128, CHUNK_BYTES);
        wgmma<T, BN, 0, RHS_K_MAJOR ? 0 : 1>(d, matrix_descriptor(a + kk * 32, 16), desc_b);
      }
      wgmma_commit();
      release_previous_stage<CLUSTER>(s.empty, ring, Config::STAGES, kb > 0);
    }
    wgmma_wait<0>();
    keep_in_registers(d);
    if (k_blocks > 0) release_stage<CLUSTER>(s.empty, (ring.stage + Config::STAGES - 1) % Config::STAGES);
    unsigned short* staging = s.out + half * 64 * Config::OUT_PITCH;
    if constexpr (ACTIVATED) {
      if (staged) named_sync(DRAINED_BARRIER, 256 + HELPERS);
      write_boxes<O, BN>(d, reinterpret_cast<unsigned char*>(staging));
      fence_async_shared();
      named_arrive(STAGED_BARRIER, 256 + HELPERS);
      staged = true;
    } else {
      store_tile_in_bulk<O, Config>(d, staging, &out_map, out, tile.row0 + half * 64, tile.row_end, col0, n);
    }
  }
  if (staged) named_sync(DRAINED_BARRIER, 256 + HELPERS);  // (ACTIVATED) the last tile's hand-over is matched
  finish_clustered_consumers<CLUSTER>();
}

// Zeroes rows [valid, 64) of `chunks` consecutive 64-row boxes at `boxes`
// (rows of the next group, or past m), with the 256 consumer threads. (The
// 128-byte swizzle moves 16-byte pieces within a row, never across rows.)
__device__ __forceinline__ void zero_rows_from(unsigned char* boxes, int chunks, int valid) {
  const int vectors = (64 - valid) * 8;  // 16-byte vectors per box
  for (int e = threadIdx.x - 128; e < chunks * vectors; e += 256) {
    const int chunk = e / vectors, v = e % vectors;
    *reinterpret_cast<uint4*>(boxes + chunk * CHUNK_BYTES + valid * 128 + v * 16) = make_uint4(0, 0, 0, 0);
  }
}

// Makes the consumers' shared-memory stores visible to the tensor cores
// before any consumer warpgroup issues its wgmma.
__device__ __forceinline__ void consumers_publish_shared() {
  fence_async_shared();
  named_sync(1, 256);
}

// Each chunk's tensor maps: lhs [m_c, k] and rhs [m_c, n], 2-D with 64 x
// 64-row boxes.
struct ChunkMaps {
  TensorMap lhs[MAX_CHUNKS];
  TensorMap rhs[MAX_CHUNKS];
};

// transposed_ragged_dot on Hopper: out[i] ([k, n]) = lhs_iᵀ · rhs_i over the
// rows of local group i in each chunk. lhs's columns are out's rows, so A is
// MN-major, and B is MN-major. A tile is 128 rows of out[i] by BN columns; the
// contraction walks the group's rows 64 at a time, chunk after chunk.
// out_map: out's local groups as one [groups x k, n] matrix, 64 x 64 boxes
// (16-bit outputs).
template <typename T, typename O, int BN, int STAGES, int MAX_LOCAL_GROUPS, int THREADS, int SHARED_BYTES>
__global__ void __launch_bounds__(THREADS, 1) transposed_ragged_dot_hopper(
    const __grid_constant__ ChunkMaps maps, int chunks, const ChunkBounds rows, int k, int n, O* __restrict__ out,
    const __grid_constant__ TensorMap out_map) {
  using Config = HopperConfig<BN, STAGES, MAX_LOCAL_GROUPS>;
  check_hopper_launch<Config, THREADS, SHARED_BYTES>();
  extern __shared__ unsigned char raw[];
  const Shared<Config> s = start_transposed<Config>(raw);
  const TransposedTiles<BN> walk(rows.local_groups, k, n);
  Ring ring;

  if (threadIdx.x < 128) {
    producer_registers();
    if (threadIdx.x != 0) return;
    for (int t = blockIdx.x; t < walk.total; t += gridDim.x) {
      const auto [g, out_row0, col0] = walk.at(t);
      for (int c = 0; c < chunks; ++c) {
        const int end = rows.end(c, g);
        for (int row = rows.begin(c, g); row < end; row += 64, ring.advance<Config::STAGES>()) {
          barrier_wait(&s.empty[ring.stage], ring.phase ^ 1);
          unsigned long long* full = &s.full[ring.stage];
          barrier_expect_bytes(full, Config::STAGE_BYTES);
          unsigned char* a = s.a + ring.stage * Config::A_BYTES;
          tma_load(a, &maps.lhs[c], full, out_row0, row);
          tma_load(a + CHUNK_BYTES, &maps.lhs[c], full, out_row0 + 64, row);
          unsigned char* b = s.b + ring.stage * Config::B_BYTES;
#pragma unroll
          for (int j = 0; j < BN / 64; ++j) tma_load(b + j * CHUNK_BYTES, &maps.rhs[c], full, col0 + 64 * j, row);
        }
      }
    }
    return;
  }

  consumer_registers();
  const int half = threadIdx.x / 128 - 1;
  float d[BN / 2];
  for (int t = blockIdx.x; t < walk.total; t += gridDim.x) {
    const auto [g, out_row0, col0] = walk.at(t);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    bool loaded = false;  // whether a stage of this tile has been multiplied
    for (int c = 0; c < chunks; ++c) {
      const int end = rows.end(c, g);
      for (int row = rows.begin(c, g); row < end; row += 64, ring.advance<Config::STAGES>()) {
        barrier_wait(&s.full[ring.stage], ring.phase);
        unsigned char* a = s.a + ring.stage * Config::A_BYTES;
        unsigned char* b = s.b + ring.stage * Config::B_BYTES;
        if (end - row < 64) {
          // The last rows of the box belong to the next group (or lie past the
          // chunk): zero them in both operands (a product with a stray inf or
          // NaN would not be zero).
          zero_rows_from(a, 2, end - row);
          zero_rows_from(b, BN / 64, end - row);
          consumers_publish_shared();
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          wgmma<T, BN, 1, 1>(d, matrix_descriptor(a + half * CHUNK_BYTES + kk * 16 * 128, CHUNK_BYTES),
                             matrix_descriptor(b + kk * 16 * 128, CHUNK_BYTES));
        }
        wgmma_commit();
        release_previous_stage(s.empty, ring, Config::STAGES, loaded);
        loaded = true;
      }
    }
    wgmma_wait<0>();
    keep_in_registers(d);
    if (loaded) release_stage(s.empty, (ring.stage + Config::STAGES - 1) % Config::STAGES);
    // out's local groups are one [groups x k, n] matrix to the map.
    store_tile_in_bulk<O, Config>(d, s.out + half * 64 * Config::OUT_PITCH, &out_map, out,
                                  g * k + out_row0 + half * 64, (g + 1) * k, col0, n);
  }
  finish_bulk_stores();
}

// ---------------------------------------------------------------------------
// FP8 on Hopper: the RHS_TRANSPOSED form of fp8_ragged_dot_simt, both operands
// K-major as 8-bit wgmma takes them: lhs [m, k] and rhs [groups, n, k]. A
// stage is one 128-deep scale block: 128 rows of lhs and 128 of rhs, 128
// bytes each. Its four wgmmas leave the block's partial in the tensor cores'
// accumulator; the consumers scale it by the row's and the weight block's
// scales and add it to their float32 sums (DeepSeek-V3's promotion). The two
// consumer warpgroups issue their blocks at once: made to take turns (one
// issuing once the other's block had completed, so that each promotion ran
// under the other's wgmmas), the forward measured 10% slower on an H200; the
// weight gradient, 9% faster before the stage's other instructions were
// trimmed, was then 3-7% slower at two of three shapes and the same at the
// third.

constexpr int FP8_BN = 128;  // the partial and the sums: 2 x 64 registers a thread

// SCALE_BYTES: the scales a stage carries beside its tiles (0: the consumers
// load them from global memory).
template <int STAGES_, int MAX_LOCAL_GROUPS_, int SCALE_BYTES_, int CLUSTER_> struct Fp8HopperConfig {
  static constexpr int BN = FP8_BN;
  static constexpr int STAGES = STAGES_;
  static constexpr int MAX_LOCAL_GROUPS = MAX_LOCAL_GROUPS_;
  static constexpr int CLUSTER = CLUSTER_, CLUSTER_BN = BN * CLUSTER;
  static constexpr int A_BYTES = BLOCK_M * FP8_BLOCK;
  static constexpr int B_BYTES = BN * FP8_BLOCK;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int OUT_PITCH = BN + 8;
  static constexpr int OUT_BYTES = 2 * 64 * OUT_PITCH * 2;
  static constexpr int SCALE_BYTES = SCALE_BYTES_;
  static constexpr int SHARED_BYTES = 1024 + STAGES * STAGE_BYTES + OUT_BYTES + 2 * STAGES * 8 +
                                      STAGES * SCALE_BYTES + 2 * (MAX_LOCAL_GROUPS + 1) * 4;
};

// The wgmma descriptors of a warpgroup's operands in stage 0 of the ring: its
// 64 rows of the A tiles and the 128 rows of the B tiles, K-major. A stage's
// are these plus its offset (descriptors count 16-byte units), so the loop
// adds instead of rebuilding them from addresses.
struct Fp8StageDescriptors {
  unsigned long long a, b;
  template <typename Config>
  __device__ static Fp8StageDescriptors of(const Shared<Config>& s, int half) {
    Fp8StageDescriptors d{matrix_descriptor(s.a + half * 64 * FP8_BLOCK, 16), matrix_descriptor(s.b, 16)};
    // Opaque to the compiler, which would otherwise rebuild them from the
    // shared-memory address in every stage, ahead of its first wgmma.
    asm volatile("" : "+l"(d.a), "+l"(d.b));
    return d;
  }
};

// This thread's consumer warpgroup, 0 or 1, as a value the compiler knows
// is the same across the warp (so that descriptors live in uniform registers).
__device__ __forceinline__ int consumer_half() { return __shfl_sync(0xffffffff, threadIdx.x / 128, 0) - 1; }

// One 128-deep block's partial into `partial`: four wgmmas over stage
// `stage`'s K-major tiles, committed and not yet waited for.
template <typename Config>
__device__ __forceinline__ void fp8_block_product(float (&partial)[FP8_BN / 2], Fp8StageDescriptors descriptors,
                                                  int stage) {
  const unsigned long long a = descriptors.a + stage * (Config::A_BYTES >> 4);
  const unsigned long long b = descriptors.b + stage * (Config::B_BYTES >> 4);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < FP8_BLOCK / 32; ++kk) wgmma_e4m3(partial, a + kk * (32 >> 4), b + kk * (32 >> 4), kk > 0);
  wgmma_commit();
}

// out[r] for the rows r of local group i: for each 128 of K, the partial of
// lhs[r] · rhs[i][col] times lhs_scales[r, b] rhs_scales[i, col / 128, b];
// zero for rows outside the window; in clusters of CLUSTER blocks (1 or 2;
// with 2, the grid is even and n spans an even number of 128-column tiles)
// that share each A tile, as ragged_dot_hopper's. lhs_map: lhs, box 128 x
// (128 / CLUSTER) rows; rhs_map: rhs, box 128 x 128 rows x 1; out_map: out,
// 64 x 64 boxes (16-bit outputs). K (not 0) and N are multiples of FP8_BLOCK.
template <typename O, int CLUSTER, int STAGES, int MAX_LOCAL_GROUPS, int THREADS, int SHARED_BYTES>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 1) fp8_ragged_dot_hopper(
    const __grid_constant__ TensorMap lhs_map, const float* __restrict__ lhs_scales,
    const __grid_constant__ TensorMap rhs_map, const float* __restrict__ rhs_scales,
    const int* __restrict__ group_sizes, int groups, const int* __restrict__ group_offset, int local_groups, int m,
    int k, int n, O* __restrict__ out, const __grid_constant__ TensorMap out_map) {
  using Config = Fp8HopperConfig<STAGES, MAX_LOCAL_GROUPS, 0, CLUSTER>;
  constexpr int BN = Config::BN;
  check_hopper_launch<Config, THREADS, SHARED_BYTES>();
  extern __shared__ unsigned char raw[];
  const Shared<Config> s = start_ragged_dot<Config>(raw, group_sizes, groups, group_offset, local_groups, m, n);
  RaggedTiles<Config::CLUSTER_BN> walk(s.bounds, s.tiles, local_groups, m, n, /*zero_unused_rows=*/true);
  const int k_blocks = k / FP8_BLOCK, n_blocks = n / FP8_BLOCK;
  const auto [rank, first, clusters] = cluster_tiles<CLUSTER>();
  Ring ring;

  if (threadIdx.x < 128) {
    producer_registers();
    if (threadIdx.x != 0) return;
    for (int t = first; t < walk.total; t += clusters) {
      const auto tile = walk.at(t);
      if (tile.zeros) continue;
      for (int kb = 0; kb < k_blocks; ++kb, ring.advance<STAGES>()) {
        barrier_wait(&s.empty[ring.stage], ring.phase ^ 1);
        unsigned long long* full = &s.full[ring.stage];
        barrier_expect_bytes(full, Config::STAGE_BYTES);
        load_a_tile<CLUSTER>(s.a + ring.stage * Config::A_BYTES, &lhs_map, full, kb * FP8_BLOCK, tile.row0, rank);
        tma_load(s.b + ring.stage * Config::B_BYTES, &rhs_map, full, kb * FP8_BLOCK, tile.col0 + rank * BN,
                 tile.group);
      }
    }
    return;
  }

  consumer_registers();
  const int half = consumer_half();  // this warpgroup's 64 rows of the tile
  const auto descriptors = Fp8StageDescriptors::of(s, half);
  // The tile rows of this thread's accumulators: row and row + 8.
  const int row = half * 64 + threadIdx.x / 32 % 4 * 16 + threadIdx.x % 32 / 4;
  float partial[BN / 2], sums[BN / 2];
  for (int t = first; t < walk.total; t += clusters) {
    const auto tile = walk.at(t);
    const int col0 = tile.col0 + rank * BN;
    if (tile.zeros) {
      zero_tile<O, BN>(out, tile.row0, tile.row_end, col0, n, n);
      continue;
    }
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) sums[i] = 0.f;
    // Rows past m are never stored: they read the last row's scales.
    const float* row_scales = lhs_scales + static_cast<size_t>(min(tile.row0 + row, m - 1)) * k_blocks;
    const float* row8_scales = lhs_scales + static_cast<size_t>(min(tile.row0 + row + 8, m - 1)) * k_blocks;
    const float* block_scales = rhs_scales + (static_cast<size_t>(tile.group) * n_blocks + col0 / FP8_BLOCK) * k_blocks;
    // Each block's scales are loaded a block ahead: loaded with the block's
    // wgmmas, their L2 latency outlasted them (ncu on an H200).
    float block_scale = block_scales[0], row_scale = row_scales[0], row8_scale = row8_scales[0];
    for (int kb = 0; kb < k_blocks; ++kb, ring.advance<STAGES>()) {
      const float scale = row_scale * block_scale, scale8 = row8_scale * block_scale;
      const int next = min(kb + 1, k_blocks - 1);
      block_scale = block_scales[next], row_scale = row_scales[next], row8_scale = row8_scales[next];
      barrier_wait(&s.full[ring.stage], ring.phase);
      fp8_block_product<Config>(partial, descriptors, ring.stage);
      wgmma_wait<0>();
      keep_in_registers(partial);
      release_stage<CLUSTER>(s.empty, ring.stage);
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        sums[4 * i] += partial[4 * i] * scale;
        sums[4 * i + 1] += partial[4 * i + 1] * scale;
        sums[4 * i + 2] += partial[4 * i + 2] * scale8;
        sums[4 * i + 3] += partial[4 * i + 3] * scale8;
      }
    }
    store_tile_in_bulk<O, Config>(sums, s.out + half * 64 * Config::OUT_PITCH, &out_map, out, tile.row0 + half * 64,
                                  tile.row_end, col0, n);
  }
  finish_clustered_consumers<CLUSTER>();
}

// Each chunk's K-major FP8 operands of the weight gradient: lhsᵀ [k, m_c] and
// rhsᵀ [n, m_c] (tensor maps, boxes 128 x 128 rows), and the scales of their
// 128-token blocks ([m_c / 128, k] and [m_c / 128, n / RHS_BLOCK_COLUMNS]).
struct Fp8ChunkMaps {
  TensorMap lhs[MAX_CHUNKS];
  TensorMap rhs[MAX_CHUNKS];
  const float* lhs_scales[MAX_CHUNKS];
  const float* rhs_scales[MAX_CHUNKS];
};

// Zeroes the columns outside [lo, hi) of a stage's A and B tiles (128 rows of
// 128 bytes each; the 128-byte swizzle puts 16-byte piece q of row r at piece
// q ^ r % 8), with the 256 consumer threads: a 128-row block's rows of other
// groups, whose values may be anything (an FP8 NaN times zero is NaN).
__device__ __forceinline__ void zero_columns_outside(unsigned char* a, unsigned char* b, int lo, int hi) {
  const int t = threadIdx.x - 128, r = t % 128;
  unsigned char* row = (t < 128 ? a : b) + r * 128;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    unsigned char* piece = row + (q ^ r % 8) * 16;
    if (q * 16 >= lo && q * 16 + 16 <= hi) continue;
    if (q * 16 + 16 <= lo || q * 16 >= hi) {
      *reinterpret_cast<uint4*>(piece) = make_uint4(0, 0, 0, 0);
      continue;
    }
    for (int j = 0; j < 16; ++j)
      if (q * 16 + j < lo || q * 16 + j >= hi) piece[j] = 0;
  }
}

// fp8_transposed_ragged_dot_simt on Hopper: out[i] ([k, n]) over the rows of
// local group i in each chunk, a stage per 128-row block that holds any of
// them (its other rows zeroed), each block's partial scaled by the row's
// lhs scale and the column's rhs scale. A tile is 128 rows of out[i] by 128
// columns; K and N are multiples of 128, and so is each chunk's m_c. A stage
// carries its block's scales of the tile's rows and columns (2 x 512 bytes,
// contiguous in global memory): loaded by the consumers, their L2 latency
// outlasted the block's four wgmmas (ncu on an H200: a third of the stalls).
// With rhs in 128 x 128 blocks (RHS_BLOCK_COLUMNS 128) a block has one rhs
// scale for the whole tile, which the producer stores in the stage beside the
// row scales (loaded by the consumers as the stage began, its L2 latency fell
// among the block's wgmmas): the promotion is then the forward's, one factor a
// row instead of one an element.
// In clusters of CLUSTER blocks (1 or 2; with 2, the grid is even and n spans
// an even number of 128-column tiles) that share each A tile, as
// ragged_dot_hopper's: lhs's maps then have boxes of 128 x (128 / CLUSTER)
// rows. out_map: out's local groups as one [groups x k, n] matrix, 64 x 64
// boxes (16-bit outputs).
template <typename O, int RHS_BLOCK_COLUMNS, int CLUSTER, int STAGES, int THREADS, int SHARED_BYTES>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 1) fp8_transposed_ragged_dot_hopper(
    const __grid_constant__ Fp8ChunkMaps operands, int chunks, const ChunkBounds rows, int k, int n,
    O* __restrict__ out, const __grid_constant__ TensorMap out_map) {
  using Config = Fp8HopperConfig<STAGES, 0, 2 * FP8_BLOCK * 4, CLUSTER>;
  constexpr int BN = Config::BN;
  static_assert(RHS_BLOCK_COLUMNS == 1 || RHS_BLOCK_COLUMNS == BN, "an rhs scale a column, or one a tile");
  // The scales a stage's bulk copies bring: the tile's rows', and its columns' unless one serves them all.
  constexpr int STAGE_SCALE_BYTES = (RHS_BLOCK_COLUMNS == 1 ? 2 : 1) * FP8_BLOCK * 4;
  static_assert((Config::STAGES * Config::STAGE_BYTES + Config::OUT_BYTES + 2 * Config::STAGES * 8) % 16 == 0,
                "the stages' scales start 16-byte aligned");
  check_hopper_launch<Config, THREADS, SHARED_BYTES>();
  extern __shared__ unsigned char raw[];
  const Shared<Config> s = start_transposed<Config>(raw);
  const TransposedTiles<Config::CLUSTER_BN> walk(rows.local_groups, k, n);
  const auto [rank, first, clusters] = cluster_tiles<CLUSTER>();
  Ring ring;

  if (threadIdx.x < 128) {
    producer_registers();
    if (threadIdx.x != 0) return;
    for (int t = first; t < walk.total; t += clusters) {
      const auto tile = walk.at(t);
      const int g = tile.group, out_row0 = tile.row0, col0 = tile.col0 + rank * BN;
      for (int c = 0; c < chunks; ++c) {
        const int begin = rows.begin(c, g), end = rows.end(c, g);
        for (int b = begin / FP8_BLOCK; begin < end && b * FP8_BLOCK < end; ++b, ring.advance<STAGES>()) {
          // The tile's one rhs scale of the block (128 x 128 blocks), loaded before the wait that it passes under.
          float tile_column_scale = 0.f;
          if constexpr (RHS_BLOCK_COLUMNS == BN)
            tile_column_scale = operands.rhs_scales[c][static_cast<size_t>(b) * (n / BN) + col0 / BN];
          barrier_wait(&s.empty[ring.stage], ring.phase ^ 1);
          unsigned long long* full = &s.full[ring.stage];
          float* scales = s.scales + ring.stage * Config::SCALE_BYTES / 4;
          // Stored in the stage's column-scale slot before the full barrier's arrival, which releases it.
          if constexpr (RHS_BLOCK_COLUMNS == BN) scales[FP8_BLOCK] = tile_column_scale;
          barrier_expect_bytes(full, Config::STAGE_BYTES + STAGE_SCALE_BYTES);
          load_a_tile<CLUSTER>(s.a + ring.stage * Config::A_BYTES, &operands.lhs[c], full, b * FP8_BLOCK, out_row0,
                               rank);
          tma_load(s.b + ring.stage * Config::B_BYTES, &operands.rhs[c], full, b * FP8_BLOCK, col0);
          bulk_load(scales, operands.lhs_scales[c] + static_cast<size_t>(b) * k + out_row0, FP8_BLOCK * 4, full);
          if constexpr (RHS_BLOCK_COLUMNS == 1)
            bulk_load(scales + FP8_BLOCK, operands.rhs_scales[c] + static_cast<size_t>(b) * n + col0, FP8_BLOCK * 4,
                      full);
        }
      }
    }
    return;
  }

  consumer_registers();
  const int half = consumer_half();  // this warpgroup's 64 rows of the tile
  const auto descriptors = Fp8StageDescriptors::of(s, half);
  // The tile rows of this thread's accumulators (row and row + 8) and their
  // first column (then + 1, and 8 columns apart).
  const int row = half * 64 + threadIdx.x / 32 % 4 * 16 + threadIdx.x % 32 / 4, col = 2 * (threadIdx.x % 4);
  float partial[BN / 2], sums[BN / 2];
  for (int t = first; t < walk.total; t += clusters) {
    const auto tile = walk.at(t);
    const int g = tile.group, out_row0 = tile.row0, col0 = tile.col0 + rank * BN;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) sums[i] = 0.f;
    for (int c = 0; c < chunks; ++c) {
      const int begin = rows.begin(c, g), end = rows.end(c, g);
      for (int b = begin / FP8_BLOCK; begin < end && b * FP8_BLOCK < end; ++b, ring.advance<STAGES>()) {
        barrier_wait(&s.full[ring.stage], ring.phase);
        unsigned char* a = s.a + ring.stage * Config::A_BYTES;
        unsigned char* w = s.b + ring.stage * Config::B_BYTES;
        const int lo = max(begin - b * FP8_BLOCK, 0), hi = min(end - b * FP8_BLOCK, FP8_BLOCK);
        if (lo > 0 || hi < FP8_BLOCK) {  // block-uniform
          zero_columns_outside(a, w, lo, hi);
          consumers_publish_shared();
        }
        fp8_block_product<Config>(partial, descriptors, ring.stage);
        const float* row_scales = s.scales + ring.stage * Config::SCALE_BYTES / 4;
        // The tile's columns' scales (128 x 1 blocks), or its one scale (128 x 128).
        const float* column_scales = row_scales + FP8_BLOCK;
        const float row_scale = row_scales[row], row8_scale = row_scales[row + 8];
        // With one rhs scale a tile, every factor below is row_scale's or row8_scale's
        // product with it: the compiler computes the two once (the forward's promotion).
        float2 column_scale[BN / 8];
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
          column_scale[i] = RHS_BLOCK_COLUMNS == BN ? make_float2(column_scales[0], column_scales[0])
                                                    : *reinterpret_cast<const float2*>(column_scales + col + 8 * i);
        wgmma_wait<0>();
        keep_in_registers(partial);
        release_stage<CLUSTER>(s.empty, ring.stage);
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
          sums[4 * i] += partial[4 * i] * (row_scale * column_scale[i].x);
          sums[4 * i + 1] += partial[4 * i + 1] * (row_scale * column_scale[i].y);
          sums[4 * i + 2] += partial[4 * i + 2] * (row8_scale * column_scale[i].x);
          sums[4 * i + 3] += partial[4 * i + 3] * (row8_scale * column_scale[i].y);
        }
      }
    }
    // out's local groups are one [groups x k, n] matrix to the map.
    store_tile_in_bulk<O, Config>(sums, s.out + half * 64 * Config::OUT_PITCH, &out_map, out,
                                  g * k + out_row0 + half * 64, (g + 1) * k, col0, n);
  }
  finish_clustered_consumers<CLUSTER>();
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
