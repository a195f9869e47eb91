// Block-scaled FP8 quantization (oxmoe.fp8.quantize): x [batch, rows, cols]
// (float, bf16 or f16) to float8_e4m3fn values and one float32 scale per block
// of the result, whose blocks are BLOCK_ROWS x BLOCK_COLS (1 x 128, 128 x 128 or
// 128 x 1). With TRANSPOSE, the result is the quantization of each batch
// element's transpose, values [batch, cols, rows], read from x as it is.
// src/quantize/cpu.rs states the semantics; each step below says which of it
// it computes.
//
// Layout, and why. The op moves bytes: 2 (or 4) read and 1 written per
// element, a few integer and float operations each. So everything is arranged
// for whole 32-byte sectors at both ends and for enough bytes in flight.
//
// - One block of 256 threads per 128 x 128 tile of one batch element. 128 is
//   the largest block side, so every block lies in one tile and a tile's
//   scales need nothing from another; a tile is partial only along a
//   dimension whose block side is 1 (rows of 1 x 128 blocks, say), where the
//   missing elements make blocks of their own that are never written.
// - Each thread loads ROWS consecutive rows of one 16-byte piece of the
//   tile's rows (8 bf16/f16 or 4 float elements) straight into registers:
//   a warp's load covers 256 or 512 contiguous bytes of a row or two, whole
//   sectors. The tile stays in registers (32 or 64 of them), not in shared
//   memory, so shared memory holds only what crosses threads (block maxima,
//   and the transposed bytes below) and several blocks fit an SM: at 2 blocks
//   of 32-64 KiB of loads each, an SM has 64-128 KiB in flight, past what an
//   H100/H200 needs to keep its memory busy (about 30 KB per SM).
// - Block maxima: a 1 x 128 block of x is one row of the tile, reduced over
//   the 16 (or 32) lanes holding that row with shuffles; a 128 x 1 block is a
//   column, reduced over each thread's rows, then across the warps through
//   shared memory; a 128 x 128 block is the whole tile. Magnitudes are compared
//   as their bits (the same order for non-negative floats; a NaN's bits lie
//   above infinity's, so one comparison keeps the largest and finds NaNs).
// - Values without TRANSPOSE: each thread writes its piece of each row (8 or
//   4 bytes), a warp 128 contiguous bytes per row.
// - With TRANSPOSE, the result's row is a column of the tile. Each thread
//   holds, for each of its columns, ROWS consecutive bytes of that result
//   row, and stores them as one 8- or 16-byte unit into a 128 x 128-byte
//   staging tile in shared memory (16 KiB), row = the tile's column. Units
//   are swizzled: unit k of staged row c sits at k ^ (c / VEC % UNITS), so
//   that the lanes of one store, whose columns are VEC apart, hit distinct
//   banks (without it, all 16 lanes of a half-warp would hit the same bank
//   pair: their rows are 8 x 128 bytes apart). Then each result row leaves
//   as 8 threads' 16-byte stores (128 contiguous bytes), read from shared
//   memory unswizzled, 8 lanes on 8 distinct 16-byte slots.
#include "common.cuh"

constexpr int QUANTIZE_TILE = 128;
constexpr int QUANTIZE_THREADS = 256;
// 1 / 448 rounded to float (cpu.rs's INVERSE_E4M3_MAX), and 448 * 2^-126, the
// smallest largest magnitude whose scale is a normal float (SMALLEST_SCALED_AMAX).
constexpr float INVERSE_E4M3_MAX = 0x1.24924ap-9f;
constexpr float SMALLEST_SCALED_AMAX = 0x1.cp-118f;

// A float's magnitude as bits: ordered as the magnitudes, NaNs above infinity.
__device__ __forceinline__ unsigned magnitude_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// The block's scale from its largest magnitude (as bits): NaN for a block
// with a NaN or an infinity, 1 below SMALLEST_SCALED_AMAX, else amax / 448 or
// the smallest power of two at least that.
template <bool POWER_OF_TWO>
__device__ __forceinline__ float block_scale(unsigned amax_bits) {
  if (amax_bits >= 0x7f800000u) return __int_as_float(0x7fc00000);
  const float amax = __uint_as_float(amax_bits);
  if (amax < SMALLEST_SCALED_AMAX) return 1.f;
  const float ratio = amax * INVERSE_E4M3_MAX;
  if (!POWER_OF_TWO) return ratio;
  const unsigned bits = __float_as_uint(ratio);
  return (bits & 0x7fffffu) == 0 ? ratio : __uint_as_float((bits & 0x7f800000u) + 0x800000u);
}

// x / scale as the CPU computes it: x times the reciprocal, with float32
// subnormals (of x, and of the product, which rounds to zero in FP8 anyway)
// flushed to zeros of their sign.
__device__ __forceinline__ float scaled(float x, float inverse) {
  float product;
  asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(product) : "f"(x), "f"(inverse));
  return product;
}

// Element e of a 16-byte piece of T, as float.
template <typename T>
__device__ __forceinline__ float element(const uint4& piece, int e) {
  Pack<T, 16> pack;
  pack.raw = piece;
  return to_float(pack.elems[e]);
}

// The bytes of 16-byte staged unit pairs (16-bit inputs) come out swapped
// where the swizzle is odd.
__device__ __forceinline__ uint4 swap_halves(uint4 v) { return make_uint4(v.z, v.w, v.x, v.y); }

template <typename T, int BLOCK_ROWS, int BLOCK_COLS, bool TRANSPOSE, bool POWER_OF_TWO, int THREADS>
__global__ void __launch_bounds__(THREADS, 2)
quantize(const T* __restrict__ x, int batch, int rows, int cols, unsigned char* __restrict__ values,
         float* __restrict__ scales) {
  static_assert(THREADS == QUANTIZE_THREADS, "the launch's threads are the layout's (src/quantize/cuda.rs)");
  constexpr int TILE = QUANTIZE_TILE;
  // The block in x's rows and columns.
  constexpr int IN_ROWS = TRANSPOSE ? BLOCK_COLS : BLOCK_ROWS, IN_COLS = TRANSPOSE ? BLOCK_ROWS : BLOCK_COLS;
  constexpr bool ROW_BLOCKS = IN_ROWS == 1 && IN_COLS == TILE, COLUMN_BLOCKS = IN_ROWS == TILE && IN_COLS == 1;
  static_assert(ROW_BLOCKS || COLUMN_BLOCKS || (IN_ROWS == TILE && IN_COLS == TILE), "the FP8 recipe's blocks");
  constexpr int VEC = 16 / sizeof(T);       // elements of a 16-byte piece
  constexpr int LANES = TILE / VEC;         // threads sharing a row of the tile: 16 or 32
  constexpr int GROUPS = THREADS / LANES;   // groups of rows
  constexpr int ROWS = TILE / GROUPS;       // consecutive rows per thread: 8 or 16
  constexpr int WARPS = THREADS / 32;
  static_assert(32 % LANES == 0 && ROWS % 2 == 0 && (ROWS == 8 || ROWS == 16), "a row within a warp; 8- or 16-byte units");

  const int tiles_r = (rows + TILE - 1) / TILE, tiles_c = (cols + TILE - 1) / TILE;
  const int tile = blockIdx.x;
  const int b = tile / (tiles_r * tiles_c), r0 = tile / tiles_c % tiles_r * TILE, c0 = tile % tiles_c * TILE;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int piece = threadIdx.x % LANES, group = threadIdx.x / LANES;
  const int r_first = r0 + group * ROWS, c = c0 + piece * VEC;  // the thread's first row and column
  const T* in = x + static_cast<long long>(b) * rows * cols;
  // 16-byte pieces are aligned and wholly in or out of x when rows are whole pieces.
  const bool whole_pieces = cols % VEC == 0;

  uint4 tile_piece[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int r = r_first + i;
    const T* src = in + static_cast<long long>(r) * cols + c;
    if (whole_pieces) {
      tile_piece[i] = r < rows && c < cols ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
    } else {
      Pack<T, 16> pack;
#pragma unroll
      for (int e = 0; e < VEC; ++e) pack.elems[e] = r < rows && c + e < cols ? src[e] : T{};
      tile_piece[i] = pack.raw;
    }
  }

  // The scale index of x's element (r, c)'s block.
  const auto scale_index = [&](int r, int c) {
    return TRANSPOSE ? (static_cast<long long>(b) * (cols / IN_COLS) + c / IN_COLS) * (rows / IN_ROWS) + r / IN_ROWS
                     : (static_cast<long long>(b) * (rows / IN_ROWS) + r / IN_ROWS) * (cols / IN_COLS) + c / IN_COLS;
  };

  // Each element's reciprocal scale: per row, per column or per tile.
  float row_inverse[ROW_BLOCKS ? ROWS : 1], column_inverse[COLUMN_BLOCKS ? VEC : 1], tile_inverse = 0.f;
  if constexpr (ROW_BLOCKS) {
    // Every lane of a row ends with its block's maximum; lane `piece` of the row's
    // LANES takes row `piece`'s scale and reciprocal (a dozen instructions each, which
    // all LANES computing all ROWS of them made a fifth of the kernel's work) and
    // hands the reciprocals round.
    unsigned mine = 0;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      unsigned amax = 0;
#pragma unroll
      for (int e = 0; e < VEC; ++e) amax = max(amax, magnitude_bits(element<T>(tile_piece[i], e)));
#pragma unroll
      for (int d = LANES / 2; d > 0; d /= 2) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, d));
      if (piece == i) mine = amax;
    }
    static_assert(ROWS <= LANES, "a lane per row of a thread's rows");
    const float scale = block_scale<POWER_OF_TWO>(mine), inverse_scale = __frcp_rn(scale);
    if (piece < ROWS && r_first + piece < rows) scales[scale_index(r_first + piece, c0)] = scale;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) row_inverse[i] = __shfl_sync(0xffffffffu, inverse_scale, i, LANES);
  } else if constexpr (COLUMN_BLOCKS) {
    __shared__ unsigned warp_column_max[WARPS][TILE];
    __shared__ float column_inverses[TILE];
    unsigned amax[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      amax[e] = 0;
#pragma unroll
      for (int i = 0; i < ROWS; ++i) amax[e] = max(amax[e], magnitude_bits(element<T>(tile_piece[i], e)));
#pragma unroll
      for (int d = LANES; d < 32; d *= 2) amax[e] = max(amax[e], __shfl_xor_sync(0xffffffffu, amax[e], d));
      if (lane < LANES) warp_column_max[warp][piece * VEC + e] = amax[e];
    }
    __syncthreads();
    if (threadIdx.x < TILE) {
      unsigned column_max = 0;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) column_max = max(column_max, warp_column_max[w][threadIdx.x]);
      const float scale = block_scale<POWER_OF_TWO>(column_max);
      column_inverses[threadIdx.x] = __frcp_rn(scale);
      if (c0 + static_cast<int>(threadIdx.x) < cols) scales[scale_index(r0, c0 + threadIdx.x)] = scale;
    }
    __syncthreads();
#pragma unroll
    for (int e = 0; e < VEC; ++e) column_inverse[e] = column_inverses[piece * VEC + e];
  } else {
    __shared__ unsigned warp_max[WARPS];
    unsigned amax = 0;
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) amax = max(amax, magnitude_bits(element<T>(tile_piece[i], e)));
#pragma unroll
    for (int d = 16; d > 0; d /= 2) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    if (lane == 0) warp_max[warp] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < WARPS; ++w) amax = max(amax, warp_max[w]);
    const float scale = block_scale<POWER_OF_TWO>(amax);
    tile_inverse = __frcp_rn(scale);
    if (threadIdx.x == 0) scales[scale_index(r0, c0)] = scale;
  }
  const auto inverse = [&](int i, int e) {
    if constexpr (ROW_BLOCKS) return row_inverse[i];
    else if constexpr (COLUMN_BLOCKS) return column_inverse[e];
    else return tile_inverse;
  };
  // Element (i, e)'s value as FP8 beside element (i2, e2)'s, in the low byte.
  const auto fp8_pair = [&](int i, int e, int i2, int e2) {
    return floats_to_e4m3x2(scaled(element<T>(tile_piece[i], e), inverse(i, e)),
                            scaled(element<T>(tile_piece[i2], e2), inverse(i2, e2)));
  };

  if constexpr (!TRANSPOSE) {
    unsigned char* out = values + static_cast<long long>(b) * rows * cols;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int r = r_first + i;
      Pack<unsigned, VEC> bytes;  // VEC bytes: VEC / 4 words
#pragma unroll
      for (int w = 0; w < VEC / 4; ++w) bytes.elems[w] = fp8_pair(i, 4 * w, i, 4 * w + 1) | fp8_pair(i, 4 * w + 2, i, 4 * w + 3) << 16;
      unsigned char* dst = out + static_cast<long long>(r) * cols + c;
      if (r >= rows) continue;
      if (whole_pieces) {
        if (c < cols) *reinterpret_cast<typename VectorOf<VEC>::type*>(dst) = bytes.raw;
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          if (c + e < cols) dst[e] = bytes.elems[e / 4] >> 8 * (e % 4) & 0xff;
      }
    }
  } else {
    // Staged row s (the tile's column s) holds the result row's 128 bytes in
    // UNITS units of ROWS bytes; unit k sits at k ^ swizzle(s).
    constexpr int UNITS = TILE / ROWS;
    __shared__ __align__(16) unsigned char stage[TILE * TILE];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int s = piece * VEC + e;  // so s / VEC % UNITS == piece % UNITS
      Pack<unsigned, ROWS> bytes;
#pragma unroll
      for (int w = 0; w < ROWS / 4; ++w)
        bytes.elems[w] = fp8_pair(4 * w, e, 4 * w + 1, e) | fp8_pair(4 * w + 2, e, 4 * w + 3, e) << 16;
      const int unit = group ^ piece % UNITS;
      *reinterpret_cast<typename VectorOf<ROWS>::type*>(stage + s * TILE + unit * ROWS) = bytes.raw;
    }
    __syncthreads();
    const bool whole_out_pieces = rows % 16 == 0;
    constexpr int PIECES = TILE / 16;             // 16-byte pieces of a result row
    constexpr int UNITS_PER_PIECE = 16 / ROWS;    // 2 or 1
#pragma unroll
    for (int pass = 0; pass < TILE * PIECES / THREADS; ++pass) {
      const int p = threadIdx.x % PIECES, s = threadIdx.x / PIECES + pass * (THREADS / PIECES);
      const int swizzle = s / VEC % UNITS;
      uint4 v = *reinterpret_cast<const uint4*>(stage + s * TILE + 16 * (p ^ swizzle / UNITS_PER_PIECE));
      if (UNITS_PER_PIECE == 2 && swizzle % 2 == 1) v = swap_halves(v);
      const int out_row = c0 + s, out_col = r0 + 16 * p;
      if (out_row >= cols) continue;
      unsigned char* dst = values + (static_cast<long long>(b) * cols + out_row) * rows + out_col;
      if (whole_out_pieces) {
        if (out_col < rows) *reinterpret_cast<uint4*>(dst) = v;
      } else {
        const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 16; ++j)
          if (out_col + j < rows) dst[j] = words[j / 4] >> 8 * (j % 4) & 0xff;
      }
    }
  }
}
