// Permutation kernels: dispatch (token rows to expert-major order with
// alignment padding), combine (back to token order, weighted and summed) and
// chunk sorting. Same semantics as src/permutation/cpu.rs.
//
// A dispatch is laid out in three small passes over the routing map
// (count per chunk of tokens, scan per expert, assign rows), then its rows
// move in one pass: a block takes a few tokens, reads each token's row once
// and writes each of its copies (scatter_rows). Combine is the mirror image:
// a block reads each of its tokens' copies and writes one row (gather_rows).
// Rows no copy refers to are zeroed by extra blocks of the same launch, or
// left unwritten where the caller reads only the groups' rows.
//
// The launch (src/permutation/cuda.rs) decides each kernel's threads (BLOCK)
// and what its grid counts on: tokens a row block moves (TOKENS), rows a
// zeroing block checks (ZERO_ROWS), rows a sort block writes (SORT_ROWS), the
// most chunks of a sort (MAX_CHUNKS). They arrive as template arguments; the
// kernels check what they assume of them.
#include "common.cuh"

constexpr int ROW_BLOCK = 128;  // threads of the row kernels (RowShape and the helpers below)
constexpr int GATHER_BLOCKS_PER_SM = 10, GATHER_COPIES = 2;  // gather_rows's occupancy and loads in flight

// A row of H elements of T, moved W bytes at a time, at most MAX_PER_THREAD
// vectors a thread per pass.
template <typename T, int H, int MAX_PER_THREAD = 8>
struct RowShape {
  static constexpr int BYTES = H * static_cast<int>(sizeof(T));
  static constexpr int W = vector_bytes(BYTES, BYTES, sizeof(T)) ? vector_bytes(BYTES, BYTES, sizeof(T)) : sizeof(T);
  using Vec = Pack<T, W>;
  static constexpr int PER = Vec::N;      // elements per vector
  static constexpr int VECTORS = H / PER; // vectors per row
  // Vectors per thread per pass over a row: all of a row when it is short,
  // else in chunks that keep the registers bounded (at least one, so that a
  // row of no elements, H = 0, compiles and moves nothing).
  static constexpr int PER_THREAD_ALL = VECTORS > ROW_BLOCK ? (VECTORS + ROW_BLOCK - 1) / ROW_BLOCK : 1;
  static constexpr int PER_THREAD = PER_THREAD_ALL < MAX_PER_THREAD ? PER_THREAD_ALL : MAX_PER_THREAD;
  static constexpr int CHUNK = PER_THREAD * ROW_BLOCK;
};

template <typename T, int H>
__device__ __forceinline__ typename RowShape<T, H>::Vec load_vector(const T* row, int v) {
  typename RowShape<T, H>::Vec pack;
  pack.raw = reinterpret_cast<const decltype(pack.raw)*>(row)[v];
  return pack;
}

template <typename T, int H>
__device__ __forceinline__ void store_vector(T* row, int v, const typename RowShape<T, H>::Vec& pack) {
  reinterpret_cast<decltype(pack.raw)*>(row)[v] = pack.raw;
}

template <typename V>
__device__ __forceinline__ V warp_inclusive_scan(V v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const V y = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += y;
  }
  return v;
}

// ---- dispatch layout ---------------------------------------------------------
//
// The tokens are cut into `num_chunks` chunks of `chunk_tokens`; thread g of a
// map pass handles expert g % E of chunk g / E, so a warp reads consecutive
// bytes of the routing map whatever E is.

// Counts the routed tokens of each (expert, chunk): chunk_ranks[e * num_chunks + c].
// Also resets what the layout fills: source_tokens to -1, the dispatched probs to 0.
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK)
count_routed(const unsigned char* __restrict__ routing_map, int tokens, int experts, int chunk_tokens,
             int num_chunks, int* __restrict__ chunk_ranks, int* __restrict__ source_tokens,
             float* __restrict__ out_probs, int rows) {
  const long long g = static_cast<long long>(blockIdx.x) * BLOCK + threadIdx.x;
  const int e = static_cast<int>(g % experts), chunk = static_cast<int>(g / experts);
  if (chunk < num_chunks) {
    const int first = chunk * chunk_tokens, last = min(tokens, first + chunk_tokens);
    int count = 0;
#pragma unroll 8
    for (int t = first; t < last; ++t) count += routing_map[static_cast<size_t>(t) * experts + e] != 0;
    chunk_ranks[static_cast<size_t>(e) * num_chunks + chunk] = count;
  }
  for (long long r = g; r < rows; r += static_cast<long long>(gridDim.x) * BLOCK) {
    source_tokens[r] = -1;
    if (out_probs) out_probs[r] = 0.f;
  }
}

// In-place exclusive prefix sum of values[0, n) by a block of BLOCK threads,
// each taking ITEMS consecutive values per step; returns the total.
template <int BLOCK, int ITEMS, typename V>
__device__ V block_exclusive_scan(V* values, int n) {
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "whole warps, at most a block's 1024 threads");
  __shared__ V warp_totals[BLOCK / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  V carry = 0;
  for (int first = 0; first < n; first += BLOCK * ITEMS) {
    const int mine = first + threadIdx.x * ITEMS;
    V items[ITEMS], sum = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      items[i] = mine + i < n ? values[mine + i] : V(0);
      sum += items[i];
    }
    const V inclusive = warp_inclusive_scan(sum);
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    V before = carry + inclusive - sum, total = carry;
#pragma unroll
    for (int w = 0; w < BLOCK / 32; ++w) {
      if (w < warp) before += warp_totals[w];
      total += warp_totals[w];
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (mine + i < n) values[mine + i] = before;
      before += items[i];
    }
    carry = total;
    __syncthreads();
  }
  return carry;
}

// A block per expert: its chunk counts become each chunk's first rank (in
// place, 8192 chunks per step); its total goes to routed[e].
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK)
rank_chunks(int* __restrict__ chunk_ranks, int num_chunks, int* __restrict__ routed) {
  const int total = block_exclusive_scan<BLOCK, 8>(chunk_ranks + static_cast<size_t>(blockIdx.x) * num_chunks, num_chunks);
  if (threadIdx.x == 0) routed[blockIdx.x] = total;
}

// Assigns each routed (token, expert) its row: dest_rows [T, E] (-1: not
// routed, or past the output's rows), and for each row its token and
// probability. Each block first lays the experts out (the padded counts'
// prefix sum); block 0 also writes the per-expert results.
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK)
assign_rows(const unsigned char* __restrict__ routing_map, const float* __restrict__ probs, int tokens,
            int experts, int chunk_tokens, int num_chunks, const int* __restrict__ chunk_ranks,
            const int* __restrict__ routed, int align, int rows, int* __restrict__ dest_rows,
            int* __restrict__ source_tokens, float* __restrict__ out_probs, int* __restrict__ tokens_per_expert,
            int* __restrict__ real_tokens_per_expert, int* __restrict__ pad_offsets) {
  extern __shared__ long long starts[];  // [experts] padded starts, then (block 0) [experts] unpadded
  long long* expert_start = starts;
  for (int e = threadIdx.x; e < experts; e += BLOCK)
    expert_start[e] = (static_cast<long long>(routed[e]) + align - 1) / align * align;
  __syncthreads();
  block_exclusive_scan<BLOCK, 1>(expert_start, experts);
  if (blockIdx.x == 0) {
    long long* unpadded_start = starts + experts;
    for (int e = threadIdx.x; e < experts; e += BLOCK) unpadded_start[e] = routed[e];
    __syncthreads();
    block_exclusive_scan<BLOCK, 1>(unpadded_start, experts);
    for (int e = threadIdx.x; e < experts; e += BLOCK) {
      const long long start = expert_start[e], count = routed[e];
      const long long padded = (count + align - 1) / align * align;
      const long long room = max(0ll, rows - start);
      tokens_per_expert[e] = static_cast<int>(min(room, padded));
      real_tokens_per_expert[e] = static_cast<int>(min(room, count));
      pad_offsets[e] = static_cast<int>(min(start - unpadded_start[e], 0x7fffffffll));
    }
  }

  const long long g = static_cast<long long>(blockIdx.x) * BLOCK + threadIdx.x;
  const int e = static_cast<int>(g % experts), chunk = static_cast<int>(g / experts);
  if (chunk >= num_chunks) return;
  long long row = expert_start[e] + chunk_ranks[static_cast<size_t>(e) * num_chunks + chunk];
  const int first = chunk * chunk_tokens, last = min(tokens, first + chunk_tokens);
#pragma unroll 4
  for (int t = first; t < last; ++t) {
    const size_t at = static_cast<size_t>(t) * experts + e;
    int dest = -1;
    if (routing_map[at]) {
      if (row < rows) {
        dest = static_cast<int>(row);
        source_tokens[dest] = t;
        if (probs) out_probs[dest] = probs[at];
      }
      ++row;
    }
    dest_rows[at] = dest;
  }
}

// ---- moving rows ------------------------------------------------------------------

// A token's copies, in increasing expert order.
template <int E>
struct Routes {
  int rows[E];
  int experts[E];
  int count;
  bool invalid;  // an entry that is neither -1 nor a row of the output
};

// Combine's backward takes its maps from the caller, who may hand it maps no
// dispatch made: a copy's gradient row is written only by the token that
// source_tokens names for that row, once (a token listing one row for several
// experts writes it with their weights summed). writes[i]: copy i writes its
// row (no earlier copy of the token lists it, and the row names the token);
// scale[i]: then the weights of the token's copies that list it, summed in
// expert order (1 a copy without weights).
template <int E>
struct CheckedRoutes : Routes<E> {
  bool writes[E];
  float scale[E];
};

// Either<C, A, B>::type is A if C, else B (NVRTC has no <type_traits>).
template <bool C, typename A, typename B> struct Either { using type = A; };
template <typename A, typename B> struct Either<false, A, B> { using type = B; };

// The calling warp lists the copies of one token (its row of dest_rows).
template <int E>
__device__ __forceinline__ void list_routes(const int* __restrict__ dest_row, int rows, Routes<E>& routes) {
  constexpr int SEGMENT = (E + 31) / 32;
  const int lane = threadIdx.x & 31;
  int entries[SEGMENT];
  int mine = 0;
  bool invalid = false;
#pragma unroll
  for (int s = 0; s < SEGMENT; ++s) {
    const int e = lane * SEGMENT + s;
    entries[s] = e < E ? dest_row[e] : -1;
    mine += entries[s] >= 0 && entries[s] < rows;
    invalid |= entries[s] < -1 || entries[s] >= rows;
  }
  const int inclusive = warp_inclusive_scan(mine);
  int at = inclusive - mine;
#pragma unroll
  for (int s = 0; s < SEGMENT; ++s) {
    if (entries[s] >= 0 && entries[s] < rows) {
      routes.rows[at] = entries[s];
      routes.experts[at] = lane * SEGMENT + s;
      ++at;
    }
  }
  invalid = __any_sync(0xffffffffu, invalid);
  if (lane == 31) routes.count = inclusive;
  if (lane == 0) routes.invalid = invalid;
}

// Warp w lists the copies of token first + w (for the block's tokens); the block waits.
template <int E, int TOKENS, typename BlockRoutes>
__device__ __forceinline__ void list_block_routes(const int* __restrict__ dest_rows, int first, int tokens, int rows,
                                                  BlockRoutes (&routes)[TOKENS]) {
  static_assert(TOKENS >= 1 && TOKENS <= ROW_BLOCK / 32, "a warp per token");
  const int warp = threadIdx.x / 32;
  if (warp < TOKENS && first + warp < tokens)
    list_routes<E>(dest_rows + static_cast<size_t>(first + warp) * E, rows, routes[warp]);
  __syncthreads();
}

// Fills each row r of `mask` (bit i: row first + i) with `value`.
template <typename T, int H>
__device__ __forceinline__ void fill_rows(T* __restrict__ out, long long first, unsigned mask, float value) {
  using Shape = RowShape<T, H>;
  typename Shape::Vec fill;
#pragma unroll
  for (int i = 0; i < Shape::PER; ++i) fill.elems[i] = from_float<T>(value);
  for (; mask; mask &= mask - 1) {
    T* row = out + (first + __ffs(mask) - 1) * H;
    for (int v = threadIdx.x; v < Shape::VECTORS; v += ROW_BLOCK) store_vector<T, H>(row, v, fill);
  }
}

// Writes the rows of [first, first + ZERO_ROWS) that no token writes: zero
// where source_tokens is negative. With CHECK_MAP (maps from the caller), zero
// where it is -1 and NaN where the maps do not agree: a token out of range,
// or one whose dest_rows row does not list the row. Without zero_unused, the
// rows of no token are left unwritten (the NaN marking stays: it guards the
// caller's maps).
template <typename T, int H, int E, bool CHECK_MAP, int ZERO_ROWS>
__device__ __forceinline__ void fill_unwritten_rows(T* __restrict__ out, const int* __restrict__ source_tokens,
                                                    const int* __restrict__ dest_rows, int tokens, int rows,
                                                    long long first, bool zero_unused) {
  static_assert(ZERO_ROWS >= 1 && ZERO_ROWS <= 32, "a 32-bit mask of rows, a warp's lane each");
  __shared__ unsigned zero_mask, nan_mask;
  if constexpr (!CHECK_MAP) {
    if (!zero_unused) return;  // (the launch has no such blocks then)
    if (threadIdx.x < 32) {
      const long long r = first + threadIdx.x;
      const bool empty = threadIdx.x < ZERO_ROWS && r < rows && source_tokens[r] < 0;
      const unsigned mask = __ballot_sync(0xffffffffu, empty);
      if (threadIdx.x == 0) zero_mask = mask;
    }
    __syncthreads();
    fill_rows<T, H>(out, first, zero_mask, 0.f);
  } else {
    // Each row's token; then the expert that lists the first of them (found
    // in its token's dest_rows row) is tried for every row, one lookup a row,
    // as a dispatch's rows come grouped by expert; the rows it does not list
    // (past a group's first row, or in maps no dispatch made) are looked for
    // in their tokens' whole dest_rows rows. Where one expert's rows fill the
    // block: 32 + E + 32 lookups in three round trips, not 32 x E.
    __shared__ int source[ZERO_ROWS];
    __shared__ unsigned valid, agrees, found;
    __shared__ int expert;
    if (threadIdx.x < 32) {
      const long long r = first + threadIdx.x;
      const int s = threadIdx.x < ZERO_ROWS && r < rows ? source_tokens[r] : -1;
      if (threadIdx.x < ZERO_ROWS) source[threadIdx.x] = s;
      const unsigned mask = __ballot_sync(0xffffffffu, s >= 0 && s < tokens);
      if (threadIdx.x == 0) {
        valid = mask;
        agrees = found = 0;
        expert = E;
      }
    }
    __syncthreads();
    if (valid) {
      const int lead = __ffs(valid) - 1;
      const int* lead_row = dest_rows + static_cast<size_t>(source[lead]) * E;
      for (int e = threadIdx.x; e < E; e += ROW_BLOCK)
        if (lead_row[e] == first + lead) atomicMin(&expert, e);
      __syncthreads();
      const int i = threadIdx.x;
      if (i < ZERO_ROWS && (valid >> i & 1u) && expert < E &&
          dest_rows[static_cast<size_t>(source[i]) * E + expert] == first + i)
        atomicOr(&agrees, 1u << i);
      __syncthreads();
      const unsigned unsure = valid & ~agrees;
      if (unsure) {
        unsigned mine = 0;
        for (int p = threadIdx.x; p < ZERO_ROWS * E; p += ROW_BLOCK) {
          const int row = p / E;
          if ((unsure >> row & 1u) && dest_rows[static_cast<size_t>(source[row]) * E + p % E] == first + row)
            mine |= 1u << row;
        }
        if (mine) atomicOr(&found, mine);
        __syncthreads();
      }
    }
    if (threadIdx.x == 0) {
      zero_mask = nan_mask = 0;
      for (int i = 0; i < ZERO_ROWS && first + i < rows; ++i) {
        if (source[i] == -1) zero_mask |= static_cast<unsigned>(zero_unused) << i;
        else if (!((agrees | found) >> i & 1u)) nan_mask |= 1u << i;
      }
    }
    __syncthreads();
    fill_rows<T, H>(out, first, zero_mask, 0.f);
    fill_rows<T, H>(out, first, nan_mask, __int_as_float(0x7fc00000));
  }
}

// With CHECK_MAP: writes and scale of each of the block's copies, found
// before the rows move, so that no copy's stores wait on its own lookups: a
// warp a token and a lane a copy, so one round of lookups whatever E is.
template <int E, int TOKENS, bool WEIGHTED>
__device__ __forceinline__ void check_block_routes(CheckedRoutes<E> (&routes)[TOKENS], int first, int tokens,
                                                   const int* __restrict__ source_tokens,
                                                   const float* __restrict__ weights) {
  const int warp = threadIdx.x / 32, t = first + warp;
  if (warp < TOKENS && t < tokens) {
    CheckedRoutes<E>& copies = routes[warp];
    const float* w = WEIGHTED ? weights + static_cast<size_t>(t) * E : nullptr;
    for (int i = threadIdx.x & 31; i < copies.count; i += 32) {
      const int row = copies.rows[i];
      bool earlier = false;
      float scale = WEIGHTED ? w[copies.experts[i]] : 1.f;
      for (int j = 0; j < copies.count; ++j) {
        earlier |= j < i && copies.rows[j] == row;
        if (j > i && copies.rows[j] == row) scale += WEIGHTED ? w[copies.experts[j]] : 1.f;
      }
      copies.writes[i] = !earlier && source_tokens[row] == t;
      copies.scale[i] = scale;
    }
  }
  __syncthreads();
}

// The first blocks (TOKENS tokens each): token t's row of `src`
// to each of its copies' rows of `out` (dispatch); with CHECK_MAP (combine's
// backward), to the rows it writes (see CheckedRoutes), scaled by its weights
// when WEIGHTED, and then, when WEIGHTED, the weights' gradient
// grad_weights[t, e] = <src[t], expert_tokens[row]>. Unweighted, a row of one
// copy is the token's row bit for bit (any 32-bit words move as they are).
// The blocks after them, if the launch has them, write the rows no token
// writes (fill_unwritten_rows; zero_unused: whether they zero the rows of no
// token, as opposed to only marking CHECK_MAP's NaN rows).
template <typename T, int H, int E, bool WEIGHTED, bool CHECK_MAP, int BLOCK, int TOKENS, int ZERO_ROWS>
__global__ void __launch_bounds__(BLOCK)
scatter_rows(const T* __restrict__ src, const int* __restrict__ dest_rows, const int* __restrict__ source_tokens,
             const float* __restrict__ weights, const T* __restrict__ expert_tokens,
             float* __restrict__ grad_weights, T* __restrict__ out, int tokens, int rows, int zero_unused) {
  static_assert(BLOCK == ROW_BLOCK, "row kernels run ROW_BLOCK threads a block");
  static_assert(CHECK_MAP || !WEIGHTED, "weighted rows are combine's backward, whose maps are checked");
  using Shape = RowShape<T, H>;
  using BlockRoutes = typename Either<CHECK_MAP, CheckedRoutes<E>, Routes<E>>::type;
  const int token_blocks = (tokens + TOKENS - 1) / TOKENS;
  if (static_cast<int>(blockIdx.x) >= token_blocks) {
    fill_unwritten_rows<T, H, E, CHECK_MAP, ZERO_ROWS>(out, source_tokens, dest_rows, tokens, rows,
                                                       static_cast<long long>(blockIdx.x - token_blocks) * ZERO_ROWS,
                                                       zero_unused != 0);
    return;
  }
  __shared__ BlockRoutes block_routes[TOKENS];
  __shared__ float dots[TOKENS][WEIGHTED ? E : 1];
  const int first = blockIdx.x * TOKENS;
  list_block_routes<E, TOKENS, BlockRoutes>(dest_rows, first, tokens, rows, block_routes);
  if constexpr (CHECK_MAP) check_block_routes<E, TOKENS, WEIGHTED>(block_routes, first, tokens, source_tokens, weights);

  for (int k = 0; k < TOKENS && first + k < tokens; ++k) {
    const int t = first + k;
    const BlockRoutes& routes = block_routes[k];
    const T* in = src + static_cast<size_t>(t) * H;
    float dot[WEIGHTED ? E : 1];
    if (WEIGHTED) {
      for (int i = 0; i < routes.count; ++i) dot[i] = 0.f;
    }

    for (int chunk = 0; chunk < Shape::VECTORS; chunk += Shape::CHUNK) {
      typename Shape::Vec v[Shape::PER_THREAD];
#pragma unroll
      for (int j = 0; j < Shape::PER_THREAD; ++j) {
        const int at = chunk + j * ROW_BLOCK + threadIdx.x;
        if (at < Shape::VECTORS) v[j] = load_vector<T, H>(in, at);
      }
      for (int i = 0; i < routes.count; ++i) {
        const int row = routes.rows[i];
        T* dst = out + static_cast<size_t>(row) * H;
        const T* y = WEIGHTED ? expert_tokens + static_cast<size_t>(row) * H : nullptr;
        // With CHECK_MAP: whether this copy writes its row, and its scale.
        bool writes = true;
        float scale = 1.f;
        if constexpr (CHECK_MAP) {
          writes = routes.writes[i];
          scale = routes.scale[i];
        }
        // The token's row as it is: a dispatch's copy, or an unweighted copy of scale 1.
        const bool as_is = !CHECK_MAP || (!WEIGHTED && scale == 1.f);
        float partial = 0.f;
#pragma unroll
        for (int j = 0; j < Shape::PER_THREAD; ++j) {
          const int at = chunk + j * ROW_BLOCK + threadIdx.x;
          if (at >= Shape::VECTORS) continue;
          if (writes) {
            typename Shape::Vec row = v[j];
            if (!as_is) {
#pragma unroll
              for (int e = 0; e < Shape::PER; ++e) row.elems[e] = from_float<T>(scale * to_float(v[j].elems[e]));
            }
            store_vector<T, H>(dst, at, row);
          }
          if constexpr (WEIGHTED) {
            const typename Shape::Vec other = load_vector<T, H>(y, at);
#pragma unroll
            for (int e = 0; e < Shape::PER; ++e) partial += to_float(v[j].elems[e]) * to_float(other.elems[e]);
          }
        }
        if (WEIGHTED) dot[i] += partial;
      }
    }

    if constexpr (WEIGHTED) {
      for (int i = 0; i < routes.count; ++i) {
        const float total = block_sum<ROW_BLOCK>(dot[i]);
        if (threadIdx.x == 0) dots[k][i] = total;
        __syncthreads();  // block_sum's shared memory is reused by the next copy
      }
      const int* dest_row = dest_rows + static_cast<size_t>(t) * E;
      float* grad_row = grad_weights + static_cast<size_t>(t) * E;
      for (int e = threadIdx.x; e < E; e += ROW_BLOCK) {
        const int r = dest_row[e];
        grad_row[e] = r == -1 ? 0.f : r < -1 || r >= rows ? __int_as_float(0x7fc00000) : 0.f;
      }
      __syncthreads();
      for (int i = threadIdx.x; i < routes.count; i += ROW_BLOCK) grad_row[routes.experts[i]] = dots[k][i];
    }
  }
}

// out[t] = sum over token t's copies (increasing expert order) of
// weights[t, e] * expert_tokens[row] (weight 1 unless WEIGHTED), in f32,
// starting from addend[t] (f32 [T, H]) with ADDEND, else from 0; NaN when its
// dest_rows row has an entry out of range. TOKENS tokens a block.
template <typename T, int H, int E, bool WEIGHTED, bool ADDEND, int BLOCK, int TOKENS>
__global__ void __launch_bounds__(BLOCK, GATHER_BLOCKS_PER_SM)
gather_rows(const T* __restrict__ expert_tokens, const int* __restrict__ dest_rows,
            const float* __restrict__ weights, const float* __restrict__ addend, T* __restrict__ out, int tokens,
            int rows) {
  static_assert(BLOCK == ROW_BLOCK, "row kernels run ROW_BLOCK threads a block");
  // The sum's loads are latency-bound: few vectors a thread (few f32 sums in
  // registers) so that many blocks fit an SM, and GATHER_COPIES copies' loads
  // issued before the first is summed (one copy at a time read 3.3 TB/s at
  // DeepSeek-V3's and Qwen3-30B-A3B's rows on an H200, two at a time 3.8-4.1:
  // bench/row_copy_bulk.cu and bench/RESULTS.md).
  using Shape = RowShape<T, H, 2>;
  // A vector of the row's elements as f32 in the addend.
  constexpr int ADDEND_W = vector_bytes(Shape::PER * 4, H * 4, 4);
  __shared__ Routes<E> block_routes[TOKENS];
  const int first = blockIdx.x * TOKENS;
  list_block_routes<E, TOKENS>(dest_rows, first, tokens, rows, block_routes);

  for (int k = 0; k < TOKENS && first + k < tokens; ++k) {
    const int t = first + k;
    const Routes<E>& routes = block_routes[k];
    T* out_row = out + static_cast<size_t>(t) * H;
    const float poison = routes.invalid ? __int_as_float(0x7fc00000) : 0.f;

    for (int chunk = 0; chunk < Shape::VECTORS; chunk += Shape::CHUNK) {
      float sum[Shape::PER_THREAD][Shape::PER];
#pragma unroll
      for (int j = 0; j < Shape::PER_THREAD; ++j) {
        const int at = chunk + j * ROW_BLOCK + threadIdx.x;
        // The addend is taken as it is (no 0 added: -0 stays -0), as the CPU takes it.
        if (ADDEND && !routes.invalid && at < Shape::VECTORS)
          load_floats<float, Shape::PER, ADDEND_W>(addend + static_cast<size_t>(t) * H + at * Shape::PER, Shape::PER,
                                                   sum[j]);
        else
#pragma unroll
          for (int e = 0; e < Shape::PER; ++e) sum[j][e] = poison;
      }
      for (int i = 0; i < routes.count; i += GATHER_COPIES) {
        typename Shape::Vec x[GATHER_COPIES][Shape::PER_THREAD];
        float w[GATHER_COPIES];
#pragma unroll
        for (int c = 0; c < GATHER_COPIES; ++c) {
          if (i + c >= routes.count) continue;
          const T* row = expert_tokens + static_cast<size_t>(routes.rows[i + c]) * H;
          w[c] = WEIGHTED ? weights[static_cast<size_t>(t) * E + routes.experts[i + c]] : 1.f;
#pragma unroll
          for (int j = 0; j < Shape::PER_THREAD; ++j) {
            const int at = chunk + j * ROW_BLOCK + threadIdx.x;
            if (at < Shape::VECTORS) x[c][j] = load_vector<T, H>(row, at);
          }
        }
#pragma unroll
        for (int c = 0; c < GATHER_COPIES; ++c) {
          if (i + c >= routes.count) continue;
#pragma unroll
          for (int j = 0; j < Shape::PER_THREAD; ++j) {
            const int at = chunk + j * ROW_BLOCK + threadIdx.x;
            if (at >= Shape::VECTORS) continue;
#pragma unroll
            for (int e = 0; e < Shape::PER; ++e) sum[j][e] += w[c] * to_float(x[c][j].elems[e]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < Shape::PER_THREAD; ++j) {
        const int at = chunk + j * ROW_BLOCK + threadIdx.x;
        if (at >= Shape::VECTORS) continue;
        typename Shape::Vec y;
#pragma unroll
        for (int e = 0; e < Shape::PER; ++e) y.elems[e] = from_float<T>(sum[j][e]);
        store_vector<T, H>(out_row, at, y);
      }
    }
  }
}

// ---- chunk sort ----------------------------------------------------------------------

// Chunk j is max(split_sizes[j], 0) rows of the unsorted layout, cut at
// `rows`; the sorted layout lists chunk sorted_indices[p] at position p, the
// first position that names it (indices out of range, and repeats, list
// nothing and take no rows). !INVERSE (sort_chunks): output row r of the
// sorted layout copies its row of the unsorted input; INVERSE
// (unsort_chunks): output row r of the unsorted layout copies its row of the
// sorted input. Unfilled rows are 0.
template <typename T, int H, bool INVERSE, int BLOCK, int SORT_ROWS, int MAX_CHUNKS>
__global__ void __launch_bounds__(BLOCK)
sort_chunks(const T* __restrict__ in, const int* __restrict__ split_sizes, const int* __restrict__ sorted_indices,
            T* __restrict__ out, int rows, int chunks) {
  static_assert(BLOCK == ROW_BLOCK, "row kernels run ROW_BLOCK threads a block");
  static_assert(SORT_ROWS <= BLOCK, "a thread finds each output row's source");
  using Shape = RowShape<T, H>;
  __shared__ long long scan[MAX_CHUNKS];
  __shared__ int source_start[MAX_CHUNKS], length[MAX_CHUNKS], sorted_start[MAX_CHUNKS], position[MAX_CHUNKS];
  __shared__ int source_row[SORT_ROWS];

  for (int j = threadIdx.x; j < chunks; j += ROW_BLOCK) scan[j] = min(max(split_sizes[j], 0), rows);
  __syncthreads();
  block_exclusive_scan<ROW_BLOCK, 1>(scan, chunks);
  for (int j = threadIdx.x; j < chunks; j += ROW_BLOCK) {
    const int start = static_cast<int>(min(scan[j], static_cast<long long>(rows)));
    source_start[j] = start;
    length[j] = min(max(split_sizes[j], 0), rows - start);
    position[j] = 0x7fffffff;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < chunks; p += ROW_BLOCK) {
    const int j = sorted_indices[p];
    if (j >= 0 && j < chunks) atomicMin(&position[j], p);
  }
  __syncthreads();
  for (int p = threadIdx.x; p < chunks; p += ROW_BLOCK) {
    const int j = sorted_indices[p];
    scan[p] = j >= 0 && j < chunks && position[j] == p ? length[j] : 0;
  }
  __syncthreads();
  block_exclusive_scan<ROW_BLOCK, 1>(scan, chunks);
  for (int p = threadIdx.x; p < chunks; p += ROW_BLOCK)
    sorted_start[p] = static_cast<int>(min(scan[p], static_cast<long long>(rows)));
  __syncthreads();

  const long long first = static_cast<long long>(blockIdx.x) * SORT_ROWS;
  if (threadIdx.x < SORT_ROWS) {
    const long long r = first + threadIdx.x;
    int from = -1;
    if (r < rows) {
      // The last chunk (position) starting at or before r.
      const int* starts = INVERSE ? source_start : sorted_start;
      int lo = 0, hi = chunks - 1, found = -1;
      while (lo <= hi) {
        const int mid = (lo + hi) / 2;
        if (starts[mid] <= r) { found = mid; lo = mid + 1; } else { hi = mid - 1; }
      }
      if (found >= 0) {
        const int offset = static_cast<int>(r - starts[found]);
        if (INVERSE) {
          const int p = position[found];
          if (offset < length[found] && p != 0x7fffffff && sorted_start[p] + offset < rows) from = sorted_start[p] + offset;
        } else {
          const int j = sorted_indices[found];
          if (j >= 0 && j < chunks && position[j] == found && offset < length[j]) from = source_start[j] + offset;
        }
      }
    }
    source_row[threadIdx.x] = from;
  }
  __syncthreads();

  typename Shape::Vec zero;
#pragma unroll
  for (int k = 0; k < Shape::PER; ++k) zero.elems[k] = from_float<T>(0.f);
  for (int i = threadIdx.x; i < SORT_ROWS * Shape::VECTORS; i += ROW_BLOCK) {
    const int local = i / Shape::VECTORS, v = i % Shape::VECTORS;
    const long long r = first + local;
    if (r >= rows) break;
    const int from = source_row[local];
    store_vector<T, H>(out + r * H, v, from < 0 ? zero : load_vector<T, H>(in + static_cast<size_t>(from) * H, v));
  }
}
