// Block-scaled FP8 quantization (oxmoe.fp8.quantize, quantize_with_transpose,
// requantize): x [batch, rows, cols] (float, bf16 or f16) to float8_e4m3fn values and
// one float32 scale per block of a result, whose blocks are BLOCK_ROWS x BLOCK_COLS
// (1 x 128, 128 x 128 or 128 x 1). Two results, either or both from one read of x:
// AS_IS, x's quantization (values [batch, rows, cols]); TRANSPOSED, the quantization
// of each batch element's transpose (values [batch, cols, rows]), read from x as it
// is. With FP8_INPUT, x is FP8 values and their 1 x 128 blocks' scales, dequantized
// to T as they are read (no copy of x in T). src/quantize/cpu.rs states the
// semantics; each step below says which of it it computes.
//
// Layout, and why. The op moves bytes: 2 (or 4) read and 1 written per
// element and result, a few integer and float operations each. So everything
// is arranged for whole 32-byte sectors at both ends and for enough bytes in
// flight.
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
// - Block maxima, per result: a block of x that is one row of the tile (1 x
//   128 in x) is reduced over the 16 (or 32) lanes holding that row with
//   shuffles; a column (128 x 1 in x), over each thread's rows, then across
//   the warps through shared memory; a 128 x 128 block is the whole tile.
//   Magnitudes are compared as their bits (the same order for non-negative
//   floats; a NaN's bits lie above infinity's, so one comparison keeps the
//   largest and finds NaNs). A 1 x 128 result's blocks are rows of x and its
//   transpose's columns of x (128 x 1 the other way round); 128 x 128 blocks
//   are the same for both results, reduced once.
// - The as-is values: each thread writes its piece of each row (8 or 4
//   bytes), a warp 128 contiguous bytes per row.
// - The transposed values: the result's row is a column of the tile. Each
//   thread holds, for each of its columns, ROWS consecutive bytes of that
//   result row, and stores them as one 8- or 16-byte unit into a 128 x
//   128-byte staging tile in shared memory (16 KiB), row = the tile's column.
//   Units are swizzled: unit k of staged row c sits at k ^ (c / VEC % UNITS),
//   so that the lanes of one store, whose columns are VEC apart, hit distinct
//   banks (without it, all 16 lanes of a half-warp would hit the same bank
//   pair: their rows are 8 x 128 bytes apart). Then each result row leaves
//   as 8 threads' 16-byte stores (128 contiguous bytes), read from shared
//   memory unswizzled, 8 lanes on 8 distinct 16-byte slots.
// - Both results: the tile is read once and held; the as-is values are
//   stored first, then the transposed ones are reduced, staged and stored.
// - FP8 input: each thread loads the same elements, VEC bytes a row (a warp
//   128 contiguous bytes of a row or two), and its rows' scales (one a row:
//   its piece lies in one 1 x 128 block), and holds them dequantized in T,
//   the layout above from there on. Its rows may be gathered through a map
//   (source_rows: the layer's tokens read as the dispatch's rows, with no
//   copy of those rows): the same loads, from the rows the map names.
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

// a * b in float32 with subnormal operands and results flushed to zeros of
// their sign: x / scale as the CPU computes it (x times the reciprocal; a
// subnormal product rounds to zero in FP8 anyway), and an FP8 value times its
// scale as cpu.rs's dequantized.
__device__ __forceinline__ float flushed_product(float a, float b) {
  float product;
  asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(product) : "f"(a), "f"(b));
  return product;
}

// Word w of a 16-byte piece.
__device__ __forceinline__ unsigned word_of(const uint4& piece, int w) {
  Pack<unsigned, 16> words;
  words.raw = piece;
  return words.elems[w];
}

// Element e of a 16-byte piece of T, as float, taken from the piece's 32-bit
// words: read through 16-bit elements, the compiler kept each half of a word
// in a register of its own and rebuilt the words with byte permutes wherever
// a word was needed (the block maxima), three instructions a word.
template <typename T>
__device__ __forceinline__ float element(const uint4& piece, int e) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(word_of(piece, e));
  } else {
    const unsigned word = word_of(piece, e / 2);
    return to_float(T{static_cast<unsigned short>(e % 2 == 0 ? word : word >> 16)});
  }
}

// Block maxima over 16-byte pieces of T, word by word: each word of a piece
// holds two 16-bit elements (bf16, f16) or one float, and its magnitudes are
// taken and compared in place, two at once in 16 bits (a 16-bit magnitude's
// bits are ordered as the magnitudes, NaNs above infinity, as a float's): no
// element is converted to float for its maximum, only each block's maximum.
template <typename T>
struct Magnitudes {
  static constexpr int PER_WORD = 4 / sizeof(T);  // elements of a word: 2 or 1
  static constexpr unsigned MASK = sizeof(T) == 2 ? 0x7fff7fffu : 0x7fffffffu;

  // Word w of the piece's magnitudes.
  static __device__ __forceinline__ unsigned of(const uint4& piece, int w) { return word_of(piece, w) & MASK; }

  // The larger of two words of magnitudes, element by element.
  static __device__ __forceinline__ unsigned max(unsigned a, unsigned b) {
    if constexpr (PER_WORD == 1) {
      return ::max(a, b);
    } else {
#if __CUDA_ARCH__ >= 900
      unsigned m;
      asm("max.u16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(b));
      return m;
#else
      return ::max(a & 0xffffu, b & 0xffffu) | ::max(a & 0xffff0000u, b & 0xffff0000u);
#endif
    }
  }

  // Element h of a word of magnitudes as a float's magnitude bits (magnitude_bits):
  // the conversion keeps the order, so the maximum converted is the converted maximum.
  static __device__ __forceinline__ unsigned as_float_bits(unsigned word, int h) {
    if constexpr (PER_WORD == 1) return word;
    else return magnitude_bits(to_float(T{static_cast<unsigned short>(word >> 16 * h)}));
  }

  // The largest of a word's elements, as a float's magnitude bits.
  static __device__ __forceinline__ unsigned largest(unsigned word) {
    if constexpr (PER_WORD == 1) return word;
    else return ::max(as_float_bits(word, 0), as_float_bits(word, 1));
  }
};

// The bytes of 16-byte staged unit pairs (16-bit inputs) come out swapped
// where the swizzle is odd.
__device__ __forceinline__ uint4 swap_halves(uint4 v) { return make_uint4(v.z, v.w, v.x, v.y); }

// How a thread holds its part of a tile of T.
template <typename T>
struct TileLayout {
  static constexpr int VEC = 16 / sizeof(T);               // elements of a 16-byte piece
  static constexpr int LANES = QUANTIZE_TILE / VEC;        // threads sharing a row of the tile: 16 or 32
  static constexpr int GROUPS = QUANTIZE_THREADS / LANES;  // groups of rows
  static constexpr int ROWS = QUANTIZE_TILE / GROUPS;      // consecutive rows per thread: 8 or 16
  static constexpr int WARPS = QUANTIZE_THREADS / 32;
  static_assert(32 % LANES == 0 && ROWS % 2 == 0 && (ROWS == 8 || ROWS == 16), "a row within a warp; 8- or 16-byte units");
};

// Where a block of threads' tile lies and where a thread's part of it does:
// batch element b's x [rows, cols] from (r0, c0); the thread's ROWS rows from
// r_first, its piece's VEC columns from c.
struct TilePlace {
  int b, rows, cols, r0, c0, r_first, c, piece, group, lane, warp;
};

// How a result's blocks lie in x's tile: each one row of it (1 x 128 in x),
// one column (128 x 1 in x), or the whole tile.
enum class Blocks { ROWS, COLUMNS, TILE };

// The blocks of x [IN_ROWS, IN_COLS] of a result.
template <int IN_ROWS, int IN_COLS>
constexpr Blocks blocks_in_x() {
  static_assert((IN_ROWS == 1 && IN_COLS == QUANTIZE_TILE) || (IN_ROWS == QUANTIZE_TILE && IN_COLS == 1) ||
                (IN_ROWS == QUANTIZE_TILE && IN_COLS == QUANTIZE_TILE), "the FP8 recipe's blocks");
  return IN_ROWS == 1 ? Blocks::ROWS : IN_COLS == 1 ? Blocks::COLUMNS : Blocks::TILE;
}

// A thread's elements' reciprocal scales in one result's blocks: one per row of
// the thread's, one per column, or one for the tile.
template <Blocks BLOCKS, typename T>
struct Inverses {
  using L = TileLayout<T>;
  float of[BLOCKS == Blocks::ROWS ? L::ROWS : BLOCKS == Blocks::COLUMNS ? L::VEC : 1];

  // Of the thread's element e of its row i.
  __device__ __forceinline__ float operator()(int i, int e) const {
    if constexpr (BLOCKS == Blocks::ROWS) return of[i];
    else if constexpr (BLOCKS == Blocks::COLUMNS) return of[e];
    else return of[0];
  }
};

// The reciprocal scales of one result's blocks in the tile (cpu.rs's
// block_scale, then its reciprocal correctly rounded); each block's scale is
// handed once to put_scale(r, c, scale), (r, c) an element of the block in x.
template <Blocks BLOCKS, bool POWER_OF_TWO, typename T, typename PutScale>
__device__ __forceinline__ Inverses<BLOCKS, T> block_inverses(const uint4 (&tile)[TileLayout<T>::ROWS],
                                                              const TilePlace& at, PutScale put_scale) {
  using L = TileLayout<T>;
  using M = Magnitudes<T>;
  Inverses<BLOCKS, T> inverses;
  if constexpr (BLOCKS == Blocks::ROWS) {
    // Every lane of a row ends with its block's maximum; lane `piece` of the row's
    // LANES takes row `piece`'s scale and reciprocal (a dozen instructions each, which
    // all LANES computing all ROWS of them made a fifth of the kernel's work) and
    // hands the reciprocals round.
    unsigned mine = 0;
#pragma unroll
    for (int i = 0; i < L::ROWS; ++i) {
      unsigned word = M::of(tile[i], 0);
#pragma unroll
      for (int w = 1; w < 4; ++w) word = M::max(word, M::of(tile[i], w));
      unsigned amax = M::largest(word);
#pragma unroll
      for (int d = L::LANES / 2; d > 0; d /= 2) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, d));
      if (at.piece == i) mine = amax;
    }
    static_assert(L::ROWS <= L::LANES, "a lane per row of a thread's rows");
    const float scale = block_scale<POWER_OF_TWO>(mine), inverse_scale = __frcp_rn(scale);
    if (at.piece < L::ROWS && at.r_first + at.piece < at.rows) put_scale(at.r_first + at.piece, at.c0, scale);
#pragma unroll
    for (int i = 0; i < L::ROWS; ++i) inverses.of[i] = __shfl_sync(0xffffffffu, inverse_scale, i, L::LANES);
  } else if constexpr (BLOCKS == Blocks::COLUMNS) {
    __shared__ unsigned warp_column_max[L::WARPS][QUANTIZE_TILE];
    __shared__ float column_inverses[QUANTIZE_TILE];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      unsigned word = M::of(tile[0], w);
#pragma unroll
      for (int i = 1; i < L::ROWS; ++i) word = M::max(word, M::of(tile[i], w));
#pragma unroll
      for (int d = L::LANES; d < 32; d *= 2) word = M::max(word, __shfl_xor_sync(0xffffffffu, word, d));
      if (at.lane < L::LANES)
#pragma unroll
        for (int h = 0; h < M::PER_WORD; ++h)
          warp_column_max[at.warp][at.piece * L::VEC + w * M::PER_WORD + h] = M::as_float_bits(word, h);
    }
    __syncthreads();
    if (threadIdx.x < QUANTIZE_TILE) {
      unsigned column_max = 0;
#pragma unroll
      for (int w = 0; w < L::WARPS; ++w) column_max = max(column_max, warp_column_max[w][threadIdx.x]);
      const float scale = block_scale<POWER_OF_TWO>(column_max);
      column_inverses[threadIdx.x] = __frcp_rn(scale);
      if (at.c0 + static_cast<int>(threadIdx.x) < at.cols) put_scale(at.r0, at.c0 + threadIdx.x, scale);
    }
    __syncthreads();
#pragma unroll
    for (int e = 0; e < L::VEC; ++e) inverses.of[e] = column_inverses[at.piece * L::VEC + e];
  } else {
    __shared__ unsigned warp_max[L::WARPS];
    unsigned word = 0;
#pragma unroll
    for (int i = 0; i < L::ROWS; ++i)
#pragma unroll
      for (int w = 0; w < 4; ++w) word = M::max(word, M::of(tile[i], w));
    unsigned amax = M::largest(word);
#pragma unroll
    for (int d = 16; d > 0; d /= 2) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    if (at.lane == 0) warp_max[at.warp] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < L::WARPS; ++w) amax = max(amax, warp_max[w]);
    const float scale = block_scale<POWER_OF_TWO>(amax);
    inverses.of[0] = __frcp_rn(scale);
    if (threadIdx.x == 0) put_scale(at.r0, at.c0, scale);
  }
  return inverses;
}

// Two elements quantized (cpu.rs's quantized: each times its block's reciprocal
// scale, then float8_e4m3fn), lo in the low byte.
__device__ __forceinline__ unsigned quantized_pair(float lo, float lo_inverse, float hi, float hi_inverse) {
  return floats_to_e4m3x2(flushed_product(lo, lo_inverse), flushed_product(hi, hi_inverse));
}

// The thread's element (i, e) as FP8 beside its element (i2, e2), in the low byte.
template <typename T, typename Inverse>
__device__ __forceinline__ unsigned fp8_pair(const uint4 (&tile)[TileLayout<T>::ROWS], const Inverse& inverse, int i,
                                             int e, int i2, int e2) {
  return quantized_pair(element<T>(tile[i], e), inverse(i, e), element<T>(tile[i2], e2), inverse(i2, e2));
}

// The as-is values of the thread's elements: its piece of each of its rows.
template <typename T, typename Inverse>
__device__ __forceinline__ void store_rows(const uint4 (&tile)[TileLayout<T>::ROWS], const Inverse& inverse,
                                           const TilePlace& at, unsigned char* __restrict__ values) {
  using L = TileLayout<T>;
  unsigned char* dst = values + (static_cast<long long>(at.b) * at.rows + at.r_first) * at.cols + at.c;
  const bool whole_pieces = at.cols % L::VEC == 0;
#pragma unroll
  for (int i = 0; i < L::ROWS; ++i, dst += at.cols) {
    const int r = at.r_first + i;
    Pack<unsigned, L::VEC> bytes;  // VEC bytes: VEC / 4 words
#pragma unroll
    for (int w = 0; w < L::VEC / 4; ++w)
      bytes.elems[w] = fp8_pair<T>(tile, inverse, i, 4 * w, i, 4 * w + 1) |
                       fp8_pair<T>(tile, inverse, i, 4 * w + 2, i, 4 * w + 3) << 16;
    if (r >= at.rows) continue;
    if (whole_pieces) {
      if (at.c < at.cols) *reinterpret_cast<typename VectorOf<L::VEC>::type*>(dst) = bytes.raw;
    } else {
#pragma unroll
      for (int e = 0; e < L::VEC; ++e)
        if (at.c + e < at.cols) dst[e] = bytes.elems[e / 4] >> 8 * (e % 4) & 0xff;
    }
  }
}

// The transposed values of the thread's elements into the staging tile: staged
// row s (the tile's column s) holds the result row's 128 bytes in UNITS units of
// ROWS bytes; unit k sits at k ^ swizzle(s).
template <typename T, typename Inverse>
__device__ __forceinline__ void stage_columns(const uint4 (&tile)[TileLayout<T>::ROWS], const Inverse& inverse,
                                              const TilePlace& at, unsigned char* stage) {
  using L = TileLayout<T>;
  constexpr int UNITS = QUANTIZE_TILE / L::ROWS;
#pragma unroll
  for (int e = 0; e < L::VEC; ++e) {
    const int s = at.piece * L::VEC + e;  // so s / VEC % UNITS == piece % UNITS
    Pack<unsigned, L::ROWS> bytes;
#pragma unroll
    for (int w = 0; w < L::ROWS / 4; ++w)
      bytes.elems[w] = fp8_pair<T>(tile, inverse, 4 * w, e, 4 * w + 1, e) |
                       fp8_pair<T>(tile, inverse, 4 * w + 2, e, 4 * w + 3, e) << 16;
    const int unit = at.group ^ at.piece % UNITS;
    *reinterpret_cast<typename VectorOf<L::ROWS>::type*>(stage + s * QUANTIZE_TILE + unit * L::ROWS) = bytes.raw;
  }
}

// The staging tile's rows to the transposed values, 16 bytes a thread.
template <typename T>
__device__ __forceinline__ void store_staged(const unsigned char* stage, const TilePlace& at,
                                             unsigned char* __restrict__ values) {
  using L = TileLayout<T>;
  constexpr int UNITS = QUANTIZE_TILE / L::ROWS;
  constexpr int PIECES = QUANTIZE_TILE / 16;     // 16-byte pieces of a result row
  constexpr int UNITS_PER_PIECE = 16 / L::ROWS;  // 2 or 1
  constexpr int ROWS_A_PASS = QUANTIZE_THREADS / PIECES;
  const bool whole_out_pieces = at.rows % 16 == 0;
  const int p = threadIdx.x % PIECES, out_col = at.r0 + 16 * p;
  // The thread's piece of its first staged row's result row; each pass's is ROWS_A_PASS rows further.
  unsigned char* dst =
      values + (static_cast<long long>(at.b) * at.cols + at.c0 + threadIdx.x / PIECES) * at.rows + out_col;
#pragma unroll
  for (int pass = 0; pass < QUANTIZE_TILE / ROWS_A_PASS; ++pass, dst += ROWS_A_PASS * static_cast<long long>(at.rows)) {
    const int s = threadIdx.x / PIECES + pass * ROWS_A_PASS;
    const int swizzle = s / L::VEC % UNITS;
    uint4 v = *reinterpret_cast<const uint4*>(stage + s * QUANTIZE_TILE + 16 * (p ^ swizzle / UNITS_PER_PIECE));
    if (UNITS_PER_PIECE == 2 && swizzle % 2 == 1) v = swap_halves(v);
    if (at.c0 + s >= at.cols) continue;
    if (whole_out_pieces) {
      if (out_col < at.rows) *reinterpret_cast<uint4*>(dst) = v;
    } else {
      const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (out_col + j < at.rows) dst[j] = words[j / 4] >> 8 * (j % 4) & 0xff;
    }
  }
}

// The thread's ROWS rows of its piece of x, zeros past x's edges.
template <typename T>
__device__ __forceinline__ void load_tile(const T* __restrict__ x, const TilePlace& at,
                                          uint4 (&tile)[TileLayout<T>::ROWS]) {
  using L = TileLayout<T>;
  // The thread's first row's piece; each next row's is cols further (a 64-bit
  // add a row, not a 64-bit product).
  const T* src = x + (static_cast<long long>(at.b) * at.rows + at.r_first) * at.cols + at.c;
  // 16-byte pieces are aligned and wholly in or out of x when rows are whole pieces.
  const bool whole_pieces = at.cols % L::VEC == 0;
#pragma unroll
  for (int i = 0; i < L::ROWS; ++i, src += at.cols) {
    const int r = at.r_first + i;
    if (whole_pieces) {
      tile[i] = r < at.rows && at.c < at.cols ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
    } else {
      Pack<T, 16> pack;
#pragma unroll
      for (int e = 0; e < L::VEC; ++e) pack.elems[e] = r < at.rows && at.c + e < at.cols ? src[e] : T{};
      tile[i] = pack.raw;
    }
  }
}

// Two float8_e4m3fn (lo in the low byte) as floats, exactly: one conversion to
// f16x2 from sm_89 on (every e4m3 value is an f16), common.cuh's decoding before.
__device__ __forceinline__ float2 e4m3x2_to_floats(unsigned short pair) {
#if __CUDA_ARCH__ >= 890
  unsigned halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(pair));
  return make_float2(to_float(f16{static_cast<unsigned short>(halves & 0xffff)}),
                     to_float(f16{static_cast<unsigned short>(halves >> 16)}));
#else
  return make_float2(e4m3_to_float(pair & 0xff), e4m3_to_float(pair >> 8));
#endif
}

// a * b, 64 bits from 32-bit unsigned operands: one instruction, where the
// compiler left some such products as 64 x 64-bit ones (several).
__device__ __forceinline__ unsigned long long wide_product(unsigned a, unsigned b) {
  unsigned long long product;
  asm("mul.wide.u32 %0, %1, %2;" : "=l"(product) : "r"(a), "r"(b));
  return product;
}

// load_tile of x dequantized: x's FP8 values [rows, cols] times their 1 x 128
// blocks' scales [rows, cols / 128] (one float32 product, subnormal operands and
// results flushed to zeros of their sign, as cpu.rs's dequantized), rounded to T.
// Rows are whole 1 x 128 blocks, so whole pieces; rows past the end read as
// zeros with scale 0, whose products are the zeros load_tile gives them. Every
// row's loads are issued before any conversion: loaded and converted row by row
// (a branch a row), a thread had one load in flight at a time, and the kernel
// ran at 32% of copy on an H200.
//
// With source_rows (batch 1), x's row r is the FP8 input's row source_rows[r]
// of its input_rows: zeros for -1 (scale 0, as past the end), NaNs for an
// entry out of range (FP8 NaNs, scale 1), as src/quantize/ops.rs's SourceRow.
template <typename T>
__device__ __forceinline__ void load_dequantized(const unsigned char* __restrict__ x,
                                                 const float* __restrict__ x_scales,
                                                 const int* __restrict__ source_rows, int input_rows,
                                                 const TilePlace& at, uint4 (&tile)[TileLayout<T>::ROWS]) {
  using L = TileLayout<T>;
  using Bytes = typename VectorOf<L::VEC>::type;  // VEC FP8 values
  // The FP8 row each of the thread's rows reads (of all x's rows, fewer than
  // 2^31: x's values are 128 bytes or more a row); -1: zeros, -2: NaNs. An int,
  // not a 64-bit offset: the 64-bit selects, compares and products of each
  // row's two addresses were a quarter of requantize's instructions.
  int source[L::ROWS];
#pragma unroll
  for (int i = 0; i < L::ROWS; ++i) {
    const int r = at.r_first + i;
    if (r >= at.rows) {
      source[i] = -1;
    } else if (source_rows == nullptr) {
      source[i] = at.b * at.rows + r;
    } else {
      const int entry = source_rows[r];
      source[i] = static_cast<unsigned>(entry) < static_cast<unsigned>(input_rows) ? entry : entry == -1 ? -1 : -2;
    }
  }
  Pack<unsigned, L::VEC> nans;  // float8_e4m3fn NaNs (0x7f)
#pragma unroll
  for (int w = 0; w < L::VEC / 4; ++w) nans.elems[w] = 0x7f7f7f7fu;
  // Row s's piece and its block's scale, s rows from the first row's: one
  // 32 x 32 -> 64-bit product an address (a signed 64-bit product was a
  // handful of instructions, two a row).
  const unsigned char* piece = x + at.c;
  const unsigned char* block_scale = reinterpret_cast<const unsigned char*>(x_scales + at.c0 / QUANTIZE_TILE);
  const unsigned row_bytes = at.cols, scale_row_bytes = at.cols / QUANTIZE_TILE * sizeof(float);
  Bytes raw[L::ROWS];
  float scale[L::ROWS];
#pragma unroll
  for (int i = 0; i < L::ROWS; ++i) {
    const int s = source[i];
    if (s >= 0) {
      raw[i] = *reinterpret_cast<const Bytes*>(piece + wide_product(s, row_bytes));
      scale[i] = *reinterpret_cast<const float*>(block_scale + wide_product(s, scale_row_bytes));
    } else {
      raw[i] = s == -1 ? Bytes{} : nans.raw;
      scale[i] = s == -1 ? 0.f : 1.f;
    }
  }
#pragma unroll
  for (int i = 0; i < L::ROWS; ++i) {
    Pack<unsigned short, L::VEC> bytes;  // two FP8 values a pair
    bytes.raw = raw[i];
    float values[L::VEC];
#pragma unroll
    for (int e = 0; e < L::VEC; e += 2) {
      const float2 pair = e4m3x2_to_floats(bytes.elems[e / 2]);
      values[e] = flushed_product(pair.x, scale[i]);
      values[e + 1] = flushed_product(pair.y, scale[i]);
    }
    tile[i] = packed<T, 16>(values);
  }
}

// A tile held by its threads (load_tile's layout) to its quantizations in
// BLOCK_ROWS x BLOCK_COLS blocks: as it is (AS_IS: values [b][rows][cols]) and
// transposed (TRANSPOSED: values [b][cols][rows]; in the transposed result's
// TRANSPOSED_BLOCK_ROWS x TRANSPOSED_BLOCK_COLS blocks, by default the same),
// with their scales. at says where the tile lies in x [b][rows][cols].
// stage: QUANTIZE_TILE^2 bytes of shared memory (16-byte aligned) for the
// transposed values, written only after a barrier that every thread reaches
// once it holds its part of the tile.
template <typename T, int BLOCK_ROWS, int BLOCK_COLS, bool AS_IS, bool TRANSPOSED, bool POWER_OF_TWO,
          int TRANSPOSED_BLOCK_ROWS = BLOCK_ROWS, int TRANSPOSED_BLOCK_COLS = BLOCK_COLS>
__device__ __forceinline__ void quantize_tile(const uint4 (&tile)[TileLayout<T>::ROWS], const TilePlace& at,
                                              unsigned char* __restrict__ values, float* __restrict__ scales,
                                              unsigned char* __restrict__ transposed_values,
                                              float* __restrict__ transposed_scales, unsigned char* stage) {
  static_assert(AS_IS || TRANSPOSED, "a result to write");
  // Each result's blocks in x: the transposed result's are its blocks the other way round.
  constexpr Blocks AS_IS_BLOCKS = blocks_in_x<BLOCK_ROWS, BLOCK_COLS>();
  constexpr Blocks TRANSPOSED_BLOCKS = blocks_in_x<TRANSPOSED_BLOCK_COLS, TRANSPOSED_BLOCK_ROWS>();
  // Each result's scale of x's element (r, c)'s block.
  const auto as_is_scale = [&](int r, int c) -> float& {
    return scales[(static_cast<long long>(at.b) * (at.rows / BLOCK_ROWS) + r / BLOCK_ROWS) * (at.cols / BLOCK_COLS) +
                  c / BLOCK_COLS];
  };
  const auto transposed_scale = [&](int r, int c) -> float& {
    return transposed_scales[(static_cast<long long>(at.b) * (at.cols / TRANSPOSED_BLOCK_ROWS) +
                              c / TRANSPOSED_BLOCK_ROWS) * (at.rows / TRANSPOSED_BLOCK_COLS) + r / TRANSPOSED_BLOCK_COLS];
  };
  // Each result's reciprocal scales, its scales written on the way, then its
  // values: the as-is ones first, so that their stores are in flight while the
  // transposed ones' maxima are reduced and their bytes staged, and the as-is
  // reciprocals are dead by then (registers: the float tile takes 64). When
  // both results' blocks are 128 x 128, the tile's one reduction serves both.
  constexpr bool ONE_REDUCTION = AS_IS && TRANSPOSED && AS_IS_BLOCKS == TRANSPOSED_BLOCKS;
  Inverses<AS_IS_BLOCKS, T> as_is_inverse;
  if constexpr (AS_IS) {
    as_is_inverse = block_inverses<AS_IS_BLOCKS, POWER_OF_TWO, T>(tile, at, [&](int r, int c, float scale) {
      as_is_scale(r, c) = scale;
      if constexpr (ONE_REDUCTION) transposed_scale(r, c) = scale;
    });
    store_rows<T>(tile, as_is_inverse, at, values);
  }
  if constexpr (TRANSPOSED) {
    Inverses<TRANSPOSED_BLOCKS, T> transposed_inverse;
    if constexpr (ONE_REDUCTION) {
      transposed_inverse = as_is_inverse;
    } else {
      transposed_inverse = block_inverses<TRANSPOSED_BLOCKS, POWER_OF_TWO, T>(
          tile, at, [&](int r, int c, float scale) { transposed_scale(r, c) = scale; });
    }
    // Reused by a block's next tile: its first __syncthreads (block_inverses') is
    // past every thread's reads of this one.
    stage_columns<T>(tile, transposed_inverse, at, stage);
    __syncthreads();
    store_staged<T>(stage, at, transposed_values);
  }
}

// The tile of block blockIdx.x (tiles row-major over each batch element's x
// [rows, cols]), and the thread's part of it.
template <typename T>
__device__ __forceinline__ TilePlace tile_place(unsigned tile_index, int rows, int cols) {
  using L = TileLayout<T>;
  const unsigned tiles_r = (rows + QUANTIZE_TILE - 1) / QUANTIZE_TILE, tiles_c = (cols + QUANTIZE_TILE - 1) / QUANTIZE_TILE;
  // Two unsigned divisions (a division by a value known only at run time is
  // some twenty instructions: three signed ones were a tenth of requantize's).
  const unsigned row_tile = tile_index / tiles_c, b = row_tile / tiles_r;  // row_tile over all batch elements
  TilePlace at;
  at.b = b, at.rows = rows, at.cols = cols;
  at.r0 = (row_tile - b * tiles_r) * QUANTIZE_TILE, at.c0 = (tile_index - row_tile * tiles_c) * QUANTIZE_TILE;
  at.lane = threadIdx.x % 32, at.warp = threadIdx.x / 32;
  at.piece = threadIdx.x % L::LANES, at.group = threadIdx.x / L::LANES;
  at.r_first = at.r0 + at.group * L::ROWS, at.c = at.c0 + at.piece * L::VEC;
  return at;
}

// at moved to the tile of x [rows, cols] whose first column is c0 (same rows).
__device__ __forceinline__ TilePlace at_columns(TilePlace at, int cols, int c0) {
  at.c += c0 - at.c0;
  at.cols = cols, at.c0 = c0;
  return at;
}

// Blocks an SM: 2 (up to 128 registers a thread); for FP8 input 3 (85), and 4
// (64) for a 16-bit tile quantized transposed only (the layer's requantize). A
// block loads half the bytes from FP8 values that it loads from bf16, so two
// blocks kept too few in flight: 3 took requantize from 47% to 67% of copy on
// an H200; with its addresses and tile in fewer registers, 4 fit it without
// spills (not float tiles, nor the as-is results). Float tiles spill 12-52
// bytes at 3, and still run 10-30% faster than at 2 (bench/NOTES.md).
template <typename T, bool AS_IS, bool TRANSPOSED, bool FP8_INPUT>
constexpr int quantize_blocks_an_sm() {
  return !FP8_INPUT ? 2 : sizeof(T) == 2 && TRANSPOSED && !AS_IS ? 4 : 3;
}

template <typename T, int BLOCK_ROWS, int BLOCK_COLS, bool AS_IS, bool TRANSPOSED, bool POWER_OF_TWO, bool FP8_INPUT,
          int THREADS>
__global__ void __launch_bounds__(THREADS, quantize_blocks_an_sm<T, AS_IS, TRANSPOSED, FP8_INPUT>())
quantize(const void* __restrict__ x, const float* __restrict__ x_scales, const int* __restrict__ source_rows,
         int input_rows, int batch, int rows, int cols,
         unsigned char* __restrict__ values, float* __restrict__ scales, unsigned char* __restrict__ transposed_values,
         float* __restrict__ transposed_scales) {
  static_assert(THREADS == QUANTIZE_THREADS, "the launch's threads are the layout's (src/quantize/cuda.rs)");
  const TilePlace at = tile_place<T>(blockIdx.x, rows, cols);
  uint4 tile[TileLayout<T>::ROWS];
  if constexpr (FP8_INPUT) {
    load_dequantized<T>(static_cast<const unsigned char*>(x), x_scales, source_rows, input_rows, at, tile);
  } else {
    load_tile<T>(static_cast<const T*>(x), at, tile);
  }
  __shared__ __align__(16) unsigned char stage[QUANTIZE_TILE * QUANTIZE_TILE];
  quantize_tile<T, BLOCK_ROWS, BLOCK_COLS, AS_IS, TRANSPOSED, POWER_OF_TWO>(tile, at, values, scales,
                                                                           transposed_values, transposed_scales, stage);
}

// The FP8 layer's activation backward (oxmoe.fp8.activation_bwd): activation.cu's
// activation_bwd, element for element (common.cuh's activation_element_grads),
// with its 16-bit results quantized as the backward's products take them,
// never written in T: the pre-activation's
// gradient [rows, W] (W = 2F gated, else F) in 1 x 128 blocks and, transposed
// ([W, rows]), in 128 x 1 blocks (SQUARE_GRAD_TRANSPOSED: 128 x 128, the whole
// tile's); the weighted hidden activation transposed
// ([F, rows]) in 128 x 1 blocks; each row weight's gradient [rows] float32.
// rows and F are multiples of 128 (src/activation/ops.rs checks), so every
// tile is whole.
//
// One block of threads per 128 rows, along the F / 128 tiles of its rows in
// turn: for each, the tiles of grad_hidden, gate and up in load_tile's layout,
// their three results computed element by element, then quantize_tile on each.
// Registers decide the layout: a tile's quantization takes ~120 registers a
// thread with the tile (the quantize kernel's), and two blocks an SM (16
// warps, for the ~60 instructions an element) allow 128. So the input tiles
// arrive in shared memory (cp.async, 16 bytes a thread and row: nothing held
// in registers while in flight), the results overwrite them in place and wait
// there for their quantization, and each quantization stages its transposed
// values in the tile it has just read into registers. A thread reads back only
// the parts it wrote: no barrier, and no bank conflicts (a warp's 16-byte parts
// are consecutive). The weight's gradient, a sum over the whole row, is summed
// per tile over the row's lanes and added to the row's running sum in shared
// memory, in a fixed order (no atomics: the same on every run).
__device__ __forceinline__ void copy_async_16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(shared))),
               "l"(global) : "memory");
}

__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Tiles of T in the kernel's dynamic shared memory: ACTIVATION_BWD_TILES * QUANTIZE_TILE^2 * sizeof(T) bytes.
constexpr int ACTIVATION_BWD_TILES = 3;

// The thread's part of tile k of tiles, row i.
template <typename T>
__device__ __forceinline__ uint4& tile_part(uint4* tiles, int k, int i) {
  return tiles[(k * TileLayout<T>::ROWS + i) * QUANTIZE_THREADS + threadIdx.x];
}

// Tile k of tiles quantized in 1 x 128 blocks (if AS_IS) and transposed (in the
// transpose's 1 x 128 blocks, or with SQUARE_TRANSPOSED in 128 x 128 ones),
// staged in its own bytes.
template <typename T, bool AS_IS, bool POWER_OF_TWO, bool SQUARE_TRANSPOSED = false>
__device__ __forceinline__ void quantize_held(uint4* tiles, int k, const TilePlace& place, unsigned char* values,
                                              float* scales, unsigned char* transposed_values,
                                              float* transposed_scales) {
  using L = TileLayout<T>;
  unsigned char* stage = reinterpret_cast<unsigned char*>(&tiles[k * L::ROWS * QUANTIZE_THREADS]);
  // Opaque to the compiler: otherwise it hoists the addresses of all five
  // quantizations out of the kernel's loop, and their registers spilled.
  TilePlace at = place;
  asm volatile("" : "+r"(at.r0), "+r"(at.r_first), "+r"(at.c0), "+r"(at.c), "+r"(at.rows), "+r"(at.cols));
  uint4 tile[L::ROWS];
#pragma unroll
  for (int i = 0; i < L::ROWS; ++i) tile[i] = tile_part<T>(tiles, k, i);
  constexpr int TRANSPOSED_ROWS = SQUARE_TRANSPOSED ? QUANTIZE_TILE : 1;
  quantize_tile<T, 1, QUANTIZE_TILE, AS_IS, true, POWER_OF_TWO, TRANSPOSED_ROWS, QUANTIZE_TILE>(
      tile, at, values, scales, transposed_values, transposed_scales, stage);
}

template <typename T, int ACTIVATION, bool POWER_OF_TWO, bool SQUARE_GRAD_TRANSPOSED, int THREADS>
__global__ void __launch_bounds__(THREADS, sizeof(T) == 4 ? 1 : 2)
activation_bwd_quantized(const T* __restrict__ grad_hidden, const T* __restrict__ pre_activation,
                         const float* __restrict__ row_probs, int rows, int features,
                         unsigned char* __restrict__ grad_values, float* __restrict__ grad_scales,
                         unsigned char* __restrict__ grad_transposed_values,
                         float* __restrict__ grad_transposed_scales,
                         unsigned char* __restrict__ weighted_transposed_values,
                         float* __restrict__ weighted_transposed_scales, float* __restrict__ grad_row_probs) {
  static_assert(THREADS == QUANTIZE_THREADS, "the launch's threads are the layout's (src/activation/cuda.rs)");
  using L = TileLayout<T>;
  constexpr bool GATED = is_gated(ACTIVATION);
  // The tiles: grad_hidden's, then the first gradient (gate's or x's); the gate's
  // (or x's), then the weighted hidden activation; the up's, then its gradient.
  constexpr int FIRST = 0, WEIGHTED = 1, UP = 2;
  static_assert(UP < ACTIVATION_BWD_TILES, "the tiles the launch gives");
  extern __shared__ uint4 tiles[];
  const auto part = [&](int k, int i) -> uint4& { return tile_part<T>(tiles, k, i); };
  // The rows' weights and the running sums of their products.
  __shared__ float weights[QUANTIZE_TILE], sums[QUANTIZE_TILE];

  const int width = GATED ? 2 * features : features;
  const TilePlace rows_at = tile_place<T>(blockIdx.x, rows, QUANTIZE_TILE);
  if (threadIdx.x < QUANTIZE_TILE) {
    weights[threadIdx.x] = row_probs[rows_at.r0 + threadIdx.x];
    sums[threadIdx.x] = 0.f;
  }
  __syncthreads();
  for (int c0 = 0; c0 < features; c0 += QUANTIZE_TILE) {
    const TilePlace hidden_at = at_columns(rows_at, features, c0), gate_at = at_columns(rows_at, width, c0),
                    up_at = at_columns(rows_at, width, features + c0);
    const long long first_row = rows_at.r_first;
#pragma unroll
    for (int i = 0; i < L::ROWS; ++i) {
      copy_async_16(&part(FIRST, i), grad_hidden + (first_row + i) * features + hidden_at.c);
      copy_async_16(&part(WEIGHTED, i), pre_activation + (first_row + i) * width + gate_at.c);
      if constexpr (GATED) copy_async_16(&part(UP, i), pre_activation + (first_row + i) * width + up_at.c);
    }
    wait_copies();
#pragma unroll 1
    for (int i = 0; i < L::ROWS; ++i) {
      const uint4 g = part(FIRST, i), x = part(WEIGHTED, i);
      uint4 u{};
      if constexpr (GATED) u = part(UP, i);
      const int row = rows_at.group * L::ROWS + i;
      const float p = weights[row];
      float sum = 0.f;
      float grad_first[L::VEC], weighted[L::VEC], grad_up[L::VEC];
#pragma unroll
      for (int e = 0; e < L::VEC; ++e) {
        const ActivationElementGrads grads = activation_element_grads<T, ACTIVATION>(
            element<T>(g, e), element<T>(x, e), GATED ? element<T>(u, e) : 1.f, p);
        sum += grads.product;
        grad_first[e] = grads.grad_x, grad_up[e] = grads.grad_u, weighted[e] = grads.weighted;
      }
#pragma unroll
      for (int d = L::LANES / 2; d > 0; d /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, d);
      if (rows_at.piece == 0) sums[row] += sum;
      part(FIRST, i) = packed<T, 16>(grad_first), part(WEIGHTED, i) = packed<T, 16>(weighted);
      if constexpr (GATED) part(UP, i) = packed<T, 16>(grad_up);
    }
    quantize_held<T, true, POWER_OF_TWO, SQUARE_GRAD_TRANSPOSED>(tiles, FIRST, gate_at, grad_values, grad_scales,
                                                                 grad_transposed_values, grad_transposed_scales);
    if constexpr (GATED)
      quantize_held<T, true, POWER_OF_TWO, SQUARE_GRAD_TRANSPOSED>(tiles, UP, up_at, grad_values, grad_scales,
                                                                   grad_transposed_values, grad_transposed_scales);
    quantize_held<T, false, POWER_OF_TWO>(tiles, WEIGHTED, hidden_at, nullptr, nullptr, weighted_transposed_values,
                                          weighted_transposed_scales);
    // The next tile's copies land in the stages: every thread past its reads of them.
    __syncthreads();
  }
  if (threadIdx.x < QUANTIZE_TILE) grad_row_probs[rows_at.r0 + threadIdx.x] = sums[threadIdx.x];
}

// The FP8 layer's forward activation (oxmoe.fp8.activation): activation.cu's
// activation_fwd, element for element (common.cuh's hidden_activation, rounded
// to T), quantized in 1 x 128 blocks as the down projection takes it (the
// quantize kernel's steps for a block of one row), never written in T: hidden
// [rows, F] from the pre-activation [rows, W] (W = 2F gated, else F). F is a
// multiple of 128 (src/activation/ops.rs checks).
//
// A 1 x 128 block is one row's: no thread needs another's rows, so a warp takes
// ROWS_PER_WARP rows of one span of 32 pieces (16 bytes of T a lane: 256
// columns in 16 bits, 128 in float32), issues all its rows' loads (gate and up)
// first, then computes each row: the activation, the block's maximum over the
// lanes holding it (shuffles), its scale, the values (8 or 4 bytes a lane). The
// quantize kernel's 128 x 128 tiles held 64 elements a thread and ran two
// blocks (16 warps) an SM: with the activation's ~20 instructions an element on
// top of the quantization's, that ran at 56% of copy on an H200 (the warps'
// serial phases, loads then work, with too few warps to overlap them). Here a
// thread holds ROWS_PER_WARP pieces of each input and an SM runs 32 warps.
template <typename T, int ACTIVATION, bool POWER_OF_TWO, int ROWS_PER_WARP, int THREADS>
__global__ void __launch_bounds__(THREADS, 4)
activation_quantized(const T* __restrict__ pre_activation, int rows, int features, unsigned char* __restrict__ values,
                     float* __restrict__ scales) {
  static_assert(THREADS == QUANTIZE_THREADS, "the launch's threads are the layout's (src/activation/cuda.rs)");
  constexpr bool GATED = is_gated(ACTIVATION);
  constexpr int VEC = 16 / sizeof(T), LANES = QUANTIZE_TILE / VEC, SPAN = 32 * VEC;  // LANES hold a block
  constexpr int ROWS_PER_BLOCK = THREADS / 32 * ROWS_PER_WARP;
  using Bytes = typename VectorOf<VEC>::type;  // VEC FP8 values
  const int width = GATED ? 2 * features : features, spans = (features + SPAN - 1) / SPAN;
  const int lane = threadIdx.x % 32, c = blockIdx.x % spans * SPAN + lane * VEC;
  const int first_row = blockIdx.x / spans * ROWS_PER_BLOCK + threadIdx.x / 32 * ROWS_PER_WARP;
  // A span past F (F not a multiple of SPAN) leaves whole blocks of lanes idle.
  const bool in_f = c < features;
  uint4 x[ROWS_PER_WARP], up[ROWS_PER_WARP];
#pragma unroll
  for (int i = 0; i < ROWS_PER_WARP; ++i) {
    const bool loads = in_f && first_row + i < rows;
    const T* row = pre_activation + static_cast<long long>(first_row + i) * width;
    x[i] = loads ? *reinterpret_cast<const uint4*>(row + c) : make_uint4(0, 0, 0, 0);
    if constexpr (GATED) up[i] = loads ? *reinterpret_cast<const uint4*>(row + features + c) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < ROWS_PER_WARP; ++i) {
    const int r = first_row + i;
    float hidden[VEC];
    unsigned amax = 0;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      hidden[e] = rounded<T>(hidden_activation<ACTIVATION>(element<T>(x[i], e), GATED ? element<T>(up[i], e) : 1.f));
      amax = max(amax, magnitude_bits(hidden[e]));
    }
#pragma unroll
    for (int d = LANES / 2; d > 0; d /= 2) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    const float scale = block_scale<POWER_OF_TWO>(amax), inverse = __frcp_rn(scale);
    if (r >= rows || !in_f) continue;
    Pack<unsigned, VEC> bytes;  // VEC bytes: VEC / 4 words
#pragma unroll
    for (int w = 0; w < VEC / 4; ++w)
      bytes.elems[w] = quantized_pair(hidden[4 * w], inverse, hidden[4 * w + 1], inverse) |
                       quantized_pair(hidden[4 * w + 2], inverse, hidden[4 * w + 3], inverse) << 16;
    *reinterpret_cast<Bytes*>(values + static_cast<long long>(r) * features + c) = bytes.raw;
    if (lane % LANES == 0) scales[static_cast<long long>(r) * (features / QUANTIZE_TILE) + c / QUANTIZE_TILE] = scale;
  }
}
