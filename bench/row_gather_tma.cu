// Can TMA gather a grouped GEMM's A rows on Hopper (issue 19, item 1)? Hopper's TMA has no
// row gather, but a box of one row of 64 bf16 lands in shared memory with the 128-byte swizzle
// of the address it is written to, so 128 one-row boxes build the same A tile as one 128-row
// box. This program loads 128 x 64 bf16 tiles (16 KB) into a 4-stage ring of mbarriers, a
// persistent block an SM, one consumer warp releasing each stage, in these ways:
//
//   - one 128-row box of rows gathered beforehand (what ragged_dot does after the dispatch);
//   - 128 one-row boxes of the same rows (the cost of a box alone), from one warp;
//   - 128 one-row boxes of the token matrix at each row's token, from 1, 4, 8 or 16 warps
//     (the gather itself; the lanes of a warp issue one box each in turn);
//   - the same in clusters of two blocks taking the same tiles (as ragged_dot's), each block
//     issuing 64 of a tile's rows into both, from 2 or 4 warps.
//
// It checks that every way lands the first block's tile byte for byte as the 128-row box does,
// and prints the bytes landed in shared memory a second (two rounds of 10 passes each; in
// clusters of two, whose blocks take the same tiles, each tile lands twice).
// Rows: `tokens` x 8 copies, each expert's 1/128 of them distinct random tokens in increasing
// order, as the dispatch lays them out. On a Hopper GPU:
//
//   nvcc -O3 -arch=sm_90a -std=c++17 -o row_gather_tma bench/row_gather_tma.cu -lcuda
//   ./row_gather_tma [tokens=16384] [hidden=2048]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "check.cuh"
#include "../kernels/hopper.cuh"

constexpr int STAGES = 4, ROWS = 128, COLS = 64, TILE_BYTES = ROWS * COLS * 2;
constexpr int SHARED_BYTES = 1024 + STAGES * TILE_BYTES + 2 * STAGES * 8;
constexpr int TOPK = 8, EXPERTS = 128;

// WARPS producer warps then one consumer warp, in clusters of CLUSTER blocks that take the same
// tiles. BOX_ROWS 128: warp 0's lane 0 loads a tile's rows [128 t, 128 t + 128) of `tensor_map`
// as one box; BOX_ROWS 1: each producer warp loads 128 / CLUSTER / WARPS of the tile's rows, row
// r from row rows[r] (rows null: row r itself) of `tensor_map`, into every block of the
// cluster (block `rank` the rank-th 128 / CLUSTER rows). The consumer copies the first block's
// tile `probe_block` of its first tile to `probe` and folds a word of every tile into `sink`.
template <int BOX_ROWS, int WARPS, int CLUSTER = 1>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(32 * WARPS + 32, 1)
    load_tiles(const __grid_constant__ CUtensorMap tensor_map, const int* rows, int tiles, int k_blocks,
               unsigned char* probe, int probe_block, unsigned* sink) {
  static_assert(BOX_ROWS == ROWS || BOX_ROWS == 1, "a tile's box, or a row's");
  static_assert(CLUSTER == 1 || BOX_ROWS == 1, "clusters share one-row boxes");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // hopper.cuh's helpers: the sm_90a device pass only
  constexpr int WARP_ROWS = BOX_ROWS == 1 ? ROWS / CLUSTER / WARPS : 0, PER_LANE = (WARP_ROWS + 31) / 32;
  const TensorMap* map = reinterpret_cast<const TensorMap*>(&tensor_map);
  extern __shared__ unsigned char raw[];
  unsigned char* base = raw + ((1024 - shared_address(raw) % 1024) % 1024);
  unsigned long long* full = reinterpret_cast<unsigned long long*>(base + STAGES * TILE_BYTES);
  unsigned long long* empty = full + STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], CLUSTER);  // every block's consumer frees a stage it receives rows in
    }
    barrier_init_fence();
  }
  if constexpr (CLUSTER > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int rank = CLUSTER > 1 ? static_cast<int>(cluster_rank()) : 0, first_row = rank * (ROWS / CLUSTER);
  const int first_tile = blockIdx.x / CLUSTER, stride = gridDim.x / CLUSTER;
  Ring ring;
  if (warp < WARPS) {
    for (int t = first_tile; t < tiles; t += stride) {
      int source[PER_LANE > 0 ? PER_LANE : 1];
      if constexpr (BOX_ROWS == 1) {
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
          const int r = t * ROWS + first_row + warp * WARP_ROWS + (lane + 32 * i) % WARP_ROWS;
          source[i] = rows ? rows[r] : r;
        }
      }
      for (int kb = 0; kb < k_blocks; ++kb, ring.advance<STAGES>()) {
        if (lane == 0) {
          barrier_wait(&empty[ring.stage], ring.phase ^ 1);
          if (warp == 0) barrier_expect_bytes(&full[ring.stage], TILE_BYTES);
        }
        __syncwarp();
        unsigned char* tile = base + ring.stage * TILE_BYTES;
        if constexpr (BOX_ROWS == ROWS) {
          if (lane == 0) tma_load(tile, map, &full[ring.stage], kb * COLS, t * ROWS);
        } else {
#pragma unroll
          for (int i = 0; i < PER_LANE; ++i) {
            const int r = first_row + warp * WARP_ROWS + lane + 32 * i;
            if (lane + 32 * i >= WARP_ROWS) continue;
            if constexpr (CLUSTER == 1) {
              tma_load(tile + r * 128, map, &full[ring.stage], kb * COLS, source[i]);
            } else {
              tma_load_multicast(tile + r * 128, map, &full[ring.stage], kb * COLS, source[i], (1 << CLUSTER) - 1);
            }
          }
        }
      }
    }
    return;
  }
  unsigned folded = 0;
  for (int t = first_tile; t < tiles; t += stride) {
    for (int kb = 0; kb < k_blocks; ++kb, ring.advance<STAGES>()) {
      barrier_wait(&full[ring.stage], ring.phase);
      const unsigned* words = reinterpret_cast<const unsigned*>(base + ring.stage * TILE_BYTES);
      folded ^= words[lane * 97 % (TILE_BYTES / 4)];
      if (t == 0 && kb == probe_block)
        for (int i = lane; i < TILE_BYTES / 4; i += 32) reinterpret_cast<unsigned*>(probe)[i] = words[i];
      __syncwarp();
      release_stage<CLUSTER>(empty, ring.stage);
    }
  }
  sink[blockIdx.x * 32 + lane] = folded;
  if constexpr (CLUSTER > 1) cluster_sync();  // no block leaves while its partner may still write to it
#endif
}

// A [rows, cols] bf16 matrix loaded in boxes of 64 columns by box_rows rows.
static CUtensorMap make_map(void* address, unsigned long long cols, unsigned long long rows, unsigned box_rows) {
  CUtensorMap map;
  cuuint64_t dims[2] = {cols, rows}, strides[1] = {cols * 2};
  cuuint32_t box[2] = {static_cast<cuuint32_t>(COLS), box_rows}, element_strides[2] = {1, 1};
  CHECK(cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, address, dims, strides, box, element_strides,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  return map;
}

using Kernel = void (*)(CUtensorMap, const int*, int, int, unsigned char*, int, unsigned*);

struct Way {
  const char* name;
  Kernel kernel;
  int warps, cluster;
  const CUtensorMap* map;
  const int* rows;  // each row's token (null: the rows gathered beforehand, in order)
};

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? atoi(argv[1]) : 16384, hidden = argc > 2 ? atoi(argv[2]) : 2048;
  const int rows = tokens * TOPK, tiles = rows / ROWS, k_blocks = hidden / COLS, per_expert = rows / EXPERTS;
  if (rows % (ROWS * EXPERTS) || hidden % COLS || per_expert > tokens) {
    printf("tokens x %d must be a multiple of %d, hidden of %d\n", TOPK, ROWS * EXPERTS, COLS);
    return 1;
  }
  std::mt19937 rng(0);
  std::vector<unsigned short> x(static_cast<size_t>(tokens) * hidden);
  for (auto& v : x) v = rng() & 0xffff;
  std::vector<int> source(rows), order(tokens);
  for (int i = 0; i < tokens; ++i) order[i] = i;
  for (int e = 0; e < EXPERTS; ++e) {
    std::shuffle(order.begin(), order.end(), rng);
    std::sort(order.begin(), order.begin() + per_expert);
    std::copy(order.begin(), order.begin() + per_expert, source.begin() + e * per_expert);
  }
  std::vector<unsigned short> gathered(static_cast<size_t>(rows) * hidden);
  for (int r = 0; r < rows; ++r)
    memcpy(&gathered[static_cast<size_t>(r) * hidden], &x[static_cast<size_t>(source[r]) * hidden], hidden * 2);

  CHECK(cuInit(0));
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  void *x_d, *gathered_d, *source_d, *probe_d, *sink_d;
  CHECK(cudaMalloc(&x_d, x.size() * 2));
  CHECK(cudaMalloc(&gathered_d, gathered.size() * 2));
  CHECK(cudaMalloc(&source_d, rows * 4));
  CHECK(cudaMalloc(&sink_d, sms * 32 * 4));
  CHECK(cudaMemcpy(x_d, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(gathered_d, gathered.data(), gathered.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(source_d, source.data(), rows * 4, cudaMemcpyHostToDevice));
  const CUtensorMap gathered_tiles = make_map(gathered_d, hidden, rows, ROWS);
  const CUtensorMap gathered_rows = make_map(gathered_d, hidden, rows, 1);
  const CUtensorMap token_rows = make_map(x_d, hidden, tokens, 1);
  const int* tokens_of = static_cast<const int*>(source_d);
  const Way ways[] = {
      {"one 128-row box of gathered rows", load_tiles<ROWS, 1>, 1, 1, &gathered_tiles, nullptr},
      {"128 one-row boxes of gathered rows, 1 warp", load_tiles<1, 1>, 1, 1, &gathered_rows, nullptr},
      {"128 one-row boxes of tokens, 1 warp", load_tiles<1, 1>, 1, 1, &token_rows, tokens_of},
      {"128 one-row boxes of tokens, 4 warps", load_tiles<1, 4>, 4, 1, &token_rows, tokens_of},
      {"128 one-row boxes of tokens, 8 warps", load_tiles<1, 8>, 8, 1, &token_rows, tokens_of},
      {"128 one-row boxes of tokens, 16 warps", load_tiles<1, 16>, 16, 1, &token_rows, tokens_of},
      {"pairs multicasting 64 rows each, 2 warps", load_tiles<1, 2, 2>, 2, 2, &token_rows, tokens_of},
      {"pairs multicasting 64 rows each, 4 warps", load_tiles<1, 4, 2>, 4, 2, &token_rows, tokens_of},
  };
  constexpr int WAYS = sizeof(ways) / sizeof(ways[0]);
  CHECK(cudaMalloc(&probe_d, WAYS * TILE_BYTES));
  auto launch = [&](int w, unsigned char* probe, int probe_block) {
    const Way& way = ways[w];
    way.kernel<<<sms, 32 * way.warps + 32, SHARED_BYTES>>>(*way.map, way.rows, tiles, k_blocks, probe, probe_block,
                                                          static_cast<unsigned*>(sink_d));
    CHECK(cudaGetLastError());
  };
  const double bytes = static_cast<double>(rows) * hidden * 2;
  printf("%d rows of %d bf16 (%.0f MB a pass), %d tiles x %d blocks of 64 columns, %d blocks\n", rows, hidden,
         bytes / 1e6, tiles, k_blocks, sms);
  for (int w = 0; w < WAYS; ++w) {
    CHECK(cudaFuncSetAttribute(ways[w].kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SHARED_BYTES));
    launch(w, static_cast<unsigned char*>(probe_d) + w * TILE_BYTES, 3);
  }
  CHECK(cudaDeviceSynchronize());
  std::vector<unsigned char> probe(WAYS * TILE_BYTES);
  CHECK(cudaMemcpy(probe.data(), probe_d, probe.size(), cudaMemcpyDeviceToHost));
  for (int w = 1; w < WAYS; ++w)
    printf("%-42s %s the 128-row box's tile\n", ways[w].name,
           memcmp(probe.data(), probe.data() + w * TILE_BYTES, TILE_BYTES) ? "DIFFERS from" : "lands byte for byte");
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (int round = 0; round < 2; ++round) {
    for (int w = 0; w < WAYS; ++w) {
      const int passes = 10;
      CHECK(cudaEventRecord(start));
      for (int i = 0; i < passes; ++i) launch(w, static_cast<unsigned char*>(probe_d), -1);
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      printf("round %d: %-42s %8.1f us a pass, %5.0f GB/s\n", round, ways[w].name, ms * 1e3 / passes,
             ways[w].cluster * bytes / (ms / passes * 1e-3) / 1e9);
    }
  }
  return 0;
}
