// Router kernels: top-k routing (forward, backward), the dense scores of the
// load-balancing loss (forward, backward) and the loss itself (forward,
// backward). Semantics are those of src/router/cpu.rs, tie-breaking included;
// arithmetic is f32 whatever the element type.
//
// Layout: one token row of E experts is handled by a whole warp when E >= 32
// (lane l holds experts [l * VPT, (l + 1) * VPT) in registers), or by one
// thread when E < 32; rows move with the widest vector loads their size
// allows. Top-k is k rounds in which every lane offers its best remaining
// expert as a 32-bit order-preserving key: one `redux.sync` finds the best
// key, a ballot the lowest lane holding it (lanes hold increasing experts, so
// equal keys go to the lower index; NaN ranks lowest), and only that lane
// looks for its next best.
#include "common.cuh"

// Threads of a per-token kernel. The launch (src/router/cuda.rs) passes its
// block and its token rows a block as template arguments, checked against
// this and Team::ROWS by check_per_token_launch.
constexpr int ROUTER_BLOCK = 128;

template <int E>
struct Team {
  static constexpr int LANES = E >= 32 ? 32 : 1;
  static constexpr int VPT = (E + LANES - 1) / LANES;  // experts per lane
  static constexpr int ROWS = ROUTER_BLOCK / LANES;    // rows per block
  static_assert(VPT <= 64, "a lane holds at most 64 experts (E <= 2048)");

  int lane;  // index within the team

  __device__ Team() : lane(LANES == 32 ? (threadIdx.x & 31) : 0) {}
  __device__ int row() const { return blockIdx.x * ROWS + threadIdx.x / LANES; }
  __device__ int slot() const { return threadIdx.x / LANES; }  // the team within the block
  __device__ int first() const { return lane * VPT; }          // the lane's first expert
  __device__ int count() const { return ::max(0, ::min(VPT, E - lane * VPT)); }
  __device__ unsigned long long valid() const {
    const int n = count();
    return n == 64 ? ~0ull : (1ull << n) - 1ull;
  }
  __device__ float sum(float v) const {
    if constexpr (LANES == 32) {
#pragma unroll
      for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    }
    return v;
  }
  __device__ float max(float v) const {
    if constexpr (LANES == 32) {
#pragma unroll
      for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    }
    return v;
  }
  __device__ unsigned max_key(unsigned v) const {
    if constexpr (LANES == 32) return __reduce_max_sync(0xffffffffu, v);
    return v;
  }
  // The lowest lane for which `holds` is true (some lane must hold).
  __device__ int first_lane(bool holds) const {
    if constexpr (LANES == 32) return __ffs(__ballot_sync(0xffffffffu, holds)) - 1;
    return 0;
  }
  __device__ bool any(bool v) const {
    if constexpr (LANES == 32) return __any_sync(0xffffffffu, v);
    return v;
  }
  __device__ float broadcast(float v, int from_lane) const {
    if constexpr (LANES == 32) return __shfl_sync(0xffffffffu, v, from_lane);
    return v;
  }
  __device__ void sync() const {
    if constexpr (LANES == 32) __syncwarp();
  }
};

// A per-token kernel launched with BLOCK threads of ROWS token rows each
// block: what its teams are laid out for, or it does not compile.
template <int E, int BLOCK, int ROWS>
__device__ __forceinline__ void check_per_token_launch() {
  static_assert(BLOCK == ROUTER_BLOCK, "per-token kernels run ROUTER_BLOCK threads a block");
  static_assert(ROWS == Team<E>::ROWS, "a block holds ROUTER_BLOCK / Team::LANES token rows");
}

// Vector widths for a lane's slice of a row of T, and of a bool row.
template <typename T, int E>
constexpr int row_vector() {
  return Team<E>::LANES * Team<E>::VPT == E
             ? vector_bytes(Team<E>::VPT * sizeof(T), E * sizeof(T), sizeof(T)) : 0;
}
template <int E>
constexpr int mask_vector() {
  return Team<E>::LANES * Team<E>::VPT == E ? vector_bytes(Team<E>::VPT, E, 1) : 0;
}

template <typename T, int E>
__device__ __forceinline__ void load_row(const T* __restrict__ base, int row, const Team<E>& t, float (&out)[Team<E>::VPT]) {
  load_floats<T, Team<E>::VPT, row_vector<T, E>()>(base + static_cast<size_t>(row) * E + t.first(), t.count(), out);
}
template <typename T, int E>
__device__ __forceinline__ void store_row(T* __restrict__ base, int row, const Team<E>& t, const float (&in)[Team<E>::VPT]) {
  store_floats<T, Team<E>::VPT, row_vector<T, E>()>(base + static_cast<size_t>(row) * E + t.first(), t.count(), in);
}
// Asks L1 for the lane's slice of a row that the kernel reads later.
template <typename T, int E>
__device__ __forceinline__ void prefetch_row(const T* __restrict__ base, int row, const Team<E>& t) {
  if (t.count() > 0) asm volatile("prefetch.global.L1 [%0];" ::"l"(base + static_cast<size_t>(row) * E + t.first()));
}
template <int E>
__device__ __forceinline__ unsigned long long load_row_mask(const unsigned char* __restrict__ base, int row, const Team<E>& t) {
  return load_mask<Team<E>::VPT, mask_vector<E>()>(base + static_cast<size_t>(row) * E + t.first(), t.count());
}
template <int E>
__device__ __forceinline__ void store_row_mask(unsigned char* __restrict__ base, int row, const Team<E>& t, unsigned long long bits) {
  store_mask<Team<E>::VPT, mask_vector<E>()>(base + static_cast<size_t>(row) * E + t.first(), t.count(), bits);
}

// The rank of a value as a 32-bit key: larger key, larger value; NaN ranks
// lowest (with -inf), -0 equals +0. Every key is > 0, which means "none".
__device__ __forceinline__ unsigned rank_key(float x) {
  const float r = x != x ? negative_infinity() : (x == 0.f ? 0.f : x);
  const unsigned bits = __float_as_uint(r);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// A lane's two best candidates: keys (0 = none), positions and payloads. The
// order is key, then lower position.
struct Leaders {
  unsigned key1 = 0, key2 = 0;
  int at1 = 0, at2 = 0;
  float payload1 = 0.f, payload2 = 0.f;
};

// The best two of the lane's keys among `eligible` positions.
template <int N>
__device__ __forceinline__ Leaders lane_leaders(const unsigned (&key)[N], const float (&payload)[N],
                                                unsigned long long eligible) {
  Leaders l;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const unsigned k = ((eligible >> j) & 1ull) ? key[j] : 0u;
    if (k > l.key1) {
      l.key2 = l.key1, l.at2 = l.at1, l.payload2 = l.payload1;
      l.key1 = k, l.at1 = j, l.payload1 = payload[j];
    } else if (k > l.key2) {
      l.key2 = k, l.at2 = j, l.payload2 = payload[j];
    }
  }
  return l;
}

// Selects K of the team's eligible values in rank order (lane l holding
// positions l * N .. l * N + N - 1, in increasing order). Marks them in
// `chosen` (bits of the owning lanes) and returns, in selection order, the
// `payload` of each. A lane that wins promotes its second best; it rescans its
// registers only when it wins again.
template <int K, int N, int E>
__device__ __forceinline__ void select_top(const Team<E>& t, const unsigned (&key)[N], const float (&payload)[N],
                                           unsigned long long eligible, unsigned long long& chosen, float (&picked)[K]) {
  Leaders l = lane_leaders(key, payload, eligible & ~chosen);
  bool second_known = true;
#pragma unroll
  for (int r = 0; r < K; ++r) {
    const unsigned top = t.max_key(l.key1);
    const int owner = t.first_lane(l.key1 == top);
    float value = l.payload1;
    if (t.lane == owner) {
      chosen |= 1ull << l.at1;
      if (second_known) {
        l.key1 = l.key2, l.at1 = l.at2, l.payload1 = l.payload2;
        second_known = false;
      } else {
        l = lane_leaders(key, payload, eligible & ~chosen);
        second_known = true;
      }
    }
    picked[r] = t.broadcast(value, owner);
  }
}

// sigmoid(x) and sigmoid'(x) = s * (1 - s).
__device__ __forceinline__ void sigmoid_and_slope(float x, float& s, float& slope) {
  float complement;
  sigmoid_and_complement(x, s, complement);
  slope = s * complement;
}

// The row's d probs times `scaling` on the selection, 0 elsewhere.
template <typename T, int E>
__device__ __forceinline__ void load_scaled_grad(const T* __restrict__ grad_probs, int row, const Team<E>& t,
                                                 unsigned long long selected, float scaling, float (&g)[Team<E>::VPT]) {
  load_row<T, E>(grad_probs, row, t, g);
#pragma unroll
  for (int j = 0; j < Team<E>::VPT; ++j) g[j] = ((selected >> j) & 1ull) ? scaling * g[j] : 0.f;
}

// s = softmax of the row's x over the positions in `over` (0 elsewhere).
template <int E>
__device__ __forceinline__ void softmax_row(const Team<E>& t, const float (&x)[Team<E>::VPT], unsigned long long over,
                                            float (&s)[Team<E>::VPT]) {
  constexpr int VPT = Team<E>::VPT;
  float top = negative_infinity();
#pragma unroll
  for (int j = 0; j < VPT; ++j)
    if ((over >> j) & 1ull) top = fmaxf(top, x[j]);
  top = t.max(top);
  float total = 0.f;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    s[j] = ((over >> j) & 1ull) ? expf(x[j] - top) : 0.f;
    total += s[j];
  }
  const float inv_total = __frcp_rn(t.sum(total));
#pragma unroll
  for (int j = 0; j < VPT; ++j) s[j] *= inv_total;
}

// The pointer, which the compiler can no longer tell is the same: a row read
// again through it is read again, not kept in registers from the first read.
template <typename T>
__device__ __forceinline__ const T* opaque(const T* p) {
  asm volatile("" : "+l"(p));
  return p;
}

// Sigmoids s of a row's logits x normalised over a set (the selection where
// K > 1, or the row) are shifted_sigmoid's with c = min(0, the set's largest x).
// Where one of those s is above 1/2 (the usual case: the kernels ask with one
// vote) c is 0 and they are s, and the kernels go on without x; else this is c,
// and the kernels replace every s (all, so that the old ones need no registers).
template <int E>
__device__ __forceinline__ float sigmoid_shift(const Team<E>& t, const float (&x)[Team<E>::VPT], unsigned long long over) {
  float top = negative_infinity();
#pragma unroll
  for (int j = 0; j < Team<E>::VPT; ++j)
    if ((over >> j) & 1ull) top = fmaxf(top, x[j]);
  return fminf(t.max(top), 0.f);
}

enum Score { SOFTMAX_POST = 0, SOFTMAX_PRE = 1, SIGMOID = 2 };

// A group's candidates: its best M keys as 64-bit words (rank key, then the
// inverted expert index: larger word = better, lower index on ties), best
// first, with the raw keys they came from (0 = none).
template <int M>
struct Best {
  unsigned long long word[M];
  float key[M];

  __device__ Best() {
#pragma unroll
    for (int p = 0; p < M; ++p) word[p] = 0, key[p] = 0.f;
  }
  __device__ void offer(unsigned long long w, float k) {
#pragma unroll
    for (int p = 0; p < M; ++p)
      if (w > word[p]) {  // strictly: an earlier expert keeps a tie
        const unsigned long long w0 = word[p];
        const float k0 = key[p];
        word[p] = w, key[p] = k;
        w = w0, k = k0;
      }
  }
  // The sum of the keys, best first (the CPU's order).
  __device__ float sum() const {
    float total = 0.f;
#pragma unroll
    for (int p = 0; p < M; ++p) total += key[p];
    return total;
  }
};

__device__ __forceinline__ unsigned long long expert_word(float key, int expert) {
  return (static_cast<unsigned long long>(rank_key(key)) << 32) | (0xffffffffu - static_cast<unsigned>(expert));
}

// Experts of the groups not among the best GK are removed from `eligible`. A
// group ranks by the sum of its best K / GK keys, summed best first.
template <int E, int K, int G, int GK>
__device__ __forceinline__ void limit_to_best_groups(const Team<E>& t, const float (&key)[Team<E>::VPT],
                                                     unsigned long long& eligible) {
  constexpr int LANES = Team<E>::LANES, VPT = Team<E>::VPT;
  constexpr int GROUP = E / G, M = K / GK;
  constexpr int LANES_PER_GROUP = GROUP / VPT;
  if constexpr (LANES == 32 && GROUP % VPT == 0 && (LANES_PER_GROUP & (LANES_PER_GROUP - 1)) == 0) {
    // Each group is LANES_PER_GROUP whole lanes: lane-local candidates,
    // merged across the group's lanes with shuffles.
    Best<M> best;
#pragma unroll
    for (int j = 0; j < VPT; ++j) best.offer(expert_word(key[j], t.first() + j), key[j]);
#pragma unroll
    for (int off = 1; off < LANES_PER_GROUP; off *= 2) {
      Best<M> theirs;
#pragma unroll
      for (int p = 0; p < M; ++p) {
        theirs.word[p] = __shfl_xor_sync(0xffffffffu, best.word[p], off);
        theirs.key[p] = __shfl_xor_sync(0xffffffffu, best.key[p], off);
      }
#pragma unroll
      for (int p = 0; p < M; ++p) best.offer(theirs.word[p], theirs.key[p]);
    }
    const bool leader = t.lane % LANES_PER_GROUP == 0;
    const unsigned group_key[1] = {rank_key(best.sum())};
    const float unused_payload[1] = {0.f};
    unsigned long long chosen_group = 0;
    float unused[GK];
    select_top<GK>(t, group_key, unused_payload, leader ? 1ull : 0ull, chosen_group, unused);
    const int leader_lane = t.lane - t.lane % LANES_PER_GROUP;
    if (!__shfl_sync(0xffffffffu, static_cast<unsigned>(chosen_group), leader_lane)) eligible = 0;
  } else {
    // Any other layout: the row's keys through shared memory, a lane scanning
    // whole groups.
    constexpr int GPL = (G + LANES - 1) / LANES;  // groups per lane
    __shared__ float keys[Team<E>::ROWS][E];
    __shared__ unsigned char allowed[Team<E>::ROWS][G];
    float* row_keys = keys[t.slot()];
#pragma unroll
    for (int j = 0; j < VPT; ++j)
      if (j < t.count()) row_keys[t.first() + j] = key[j];
    t.sync();
    unsigned group_key[GPL];
    unsigned long long group_valid = 0;
#pragma unroll
    for (int i = 0; i < GPL; ++i) {
      const int g = t.lane * GPL + i;
      group_key[i] = 0;
      if (g >= G) continue;
      group_valid |= 1ull << i;
      Best<M> best;
      for (int e = g * GROUP; e < (g + 1) * GROUP; ++e) best.offer(expert_word(row_keys[e], e), row_keys[e]);
      group_key[i] = rank_key(best.sum());
    }
    float unused_payload[GPL], unused[GK];
#pragma unroll
    for (int i = 0; i < GPL; ++i) unused_payload[i] = 0.f;
    unsigned long long chosen_groups = 0;
    select_top<GK>(t, group_key, unused_payload, group_valid, chosen_groups, unused);
#pragma unroll
    for (int i = 0; i < GPL; ++i) {
      const int g = t.lane * GPL + i;
      if (g < G) allowed[t.slot()][g] = (chosen_groups >> i) & 1ull;
    }
    t.sync();
#pragma unroll
    for (int j = 0; j < VPT; ++j)
      if (!allowed[t.slot()][::min(G - 1, (t.first() + j) / GROUP)]) eligible &= ~(1ull << j);
  }
}

// Top-k routing, forward: probs [T, E] (zero off the selection) and the
// routing map [T, E] from logits [T, E] and, for sigmoid, a bias [E].
template <typename T, int E, int K, int G, int GK, int SCORE, bool BIAS, int BLOCK, int ROWS>
__global__ void __launch_bounds__(BLOCK)
    topk_fwd(const T* __restrict__ logits, const float* __restrict__ bias, T* __restrict__ probs,
             unsigned char* __restrict__ routing_map, int tokens, float scaling) {
  check_per_token_launch<E, BLOCK, ROWS>();
  using TeamE = Team<E>;
  constexpr int VPT = TeamE::VPT;
  const TeamE t;
  const int row = t.row();
  if (row >= tokens) return;
  const unsigned long long valid = t.valid();

  float x[VPT], s[VPT], key[VPT];
  load_row<T, E>(logits, row, t, x);
  if constexpr (SCORE == SOFTMAX_PRE) {
    softmax_row(t, x, valid, s);
#pragma unroll
    for (int j = 0; j < VPT; ++j) key[j] = s[j];
  } else if constexpr (SCORE == SIGMOID) {
    float b[VPT];
    if constexpr (BIAS) {
      load_floats<float, VPT, row_vector<float, E>()>(bias + t.first(), t.count(), b);
    }
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      s[j] = sigmoid(x[j]);
      key[j] = BIAS ? s[j] + b[j] : s[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < VPT; ++j) key[j] = s[j] = x[j];
  }

  unsigned long long eligible = valid;
  if constexpr (G > 1) limit_to_best_groups<E, K, G, GK>(t, key, eligible);

  unsigned rank[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) rank[j] = rank_key(key[j]);
  unsigned long long chosen = 0;
  float picked[K];  // the selection's logits (post-softmax) or scores, best first
  select_top<K>(t, rank, s, eligible, chosen, picked);

  // Weights, with the CPU's order of operations.
  float top = 0.f, norm = 1.f;
  if constexpr (SCORE == SOFTMAX_POST) {
    top = negative_infinity();
#pragma unroll
    for (int r = 0; r < K; ++r) top = fmaxf(top, picked[r]);
    norm = 0.f;
#pragma unroll
    for (int r = 0; r < K; ++r) norm += expf(picked[r] - top);
  } else if constexpr (SCORE == SIGMOID && K > 1) {
    bool above_half = false;  // the same in every lane, as picked is
    norm = 0.f;
#pragma unroll
    for (int r = 0; r < K; ++r) {
      above_half |= picked[r] > 0.5f;
      norm += picked[r];
    }
    if (!above_half) {  // sigmoid_shift's c, of the logits read again (not kept in registers)
      load_row<T, E>(opaque(logits), row, t, x);
      const float c = sigmoid_shift(t, x, chosen);
      norm = 0.f;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        s[j] = ((chosen >> j) & 1ull) ? shifted_sigmoid(x[j], c) : 0.f;
        norm += s[j];
      }
      norm = t.sum(norm);
    }
  }
  const float inv_norm = __frcp_rn(norm);
  float out[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const float w = SCORE == SOFTMAX_POST            ? expf(x[j] - top) * inv_norm
                    : (SCORE == SIGMOID && K > 1) ? s[j] * inv_norm
                                                  : s[j];
    out[j] = ((chosen >> j) & 1ull) ? w * scaling : 0.f;
  }
  store_row<T, E>(probs, row, t, out);
  store_row_mask<E>(routing_map, row, t, chosen);
}

// Top-k routing, backward: d logits from d probs, the selection held fixed.
template <typename T, int E, int K, int SCORE, int BLOCK, int ROWS>
__global__ void __launch_bounds__(BLOCK)
    topk_bwd(const T* __restrict__ grad_probs, const T* __restrict__ logits, const unsigned char* __restrict__ routing_map,
             T* __restrict__ grad_logits, int tokens, float scaling) {
  check_per_token_launch<E, BLOCK, ROWS>();
  using TeamE = Team<E>;
  constexpr int VPT = TeamE::VPT;
  const TeamE t;
  const int row = t.row();
  if (row >= tokens) return;
  const unsigned long long valid = t.valid();
  float g[VPT], x[VPT], out[VPT];
  if constexpr (SCORE == SIGMOID) prefetch_row<T, E>(grad_probs, row, t);  // read after the sigmoids
  load_row<T, E>(logits, row, t, x);
  const unsigned long long selected = load_row_mask<E>(routing_map, row, t) & valid;

  if constexpr (SCORE != SIGMOID) {
    // probs = scale * s on the selection, s a softmax over `over`: every expert
    // (pre-softmax) or the selection (post). Then d x = s * (g - <g, s>), with g
    // zero off the selection and s zero off `over`.
    load_scaled_grad<T, E>(grad_probs, row, t, selected, scaling, g);
    float s[VPT];
    softmax_row(t, x, SCORE == SOFTMAX_PRE ? valid : selected, s);
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) dot += g[j] * s[j];
    dot = t.sum(dot);
#pragma unroll
    for (int j = 0; j < VPT; ++j) out[j] = s[j] * (g[j] - dot);
  } else {  // sigmoid: probs = scale * s / S on the selection (S = their sum) when K > 1
    float s[VPT], slope[VPT], total = 0.f;
    bool above_half = false;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      sigmoid_and_slope(x[j], s[j], slope[j]);
      if ((selected >> j) & 1ull) above_half |= s[j] > 0.5f;
    }
    // The shifted sigmoids in the same loop as their complements: apart, 43
    // registers, not 40.
    if (K > 1 && !t.any(above_half)) {  // sigmoid_shift's c, of the logits read again
      load_row<T, E>(opaque(logits), row, t, x);
      const float c = sigmoid_shift(t, x, selected);
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        float complement;
        sigmoid_and_complement(x[j], s[j], complement);
        if ((selected >> j) & 1ull) s[j] = shifted_sigmoid(x[j], c);
        slope[j] = s[j] * complement;
      }
    }
    // d probs read after the logits are done with: fewer registers (prefetched).
    load_scaled_grad<T, E>(grad_probs, row, t, selected, scaling, g);
#pragma unroll
    for (int j = 0; j < VPT; ++j)
      if ((selected >> j) & 1ull) total += s[j];
    const float inv_total = K > 1 ? __frcp_rn(t.sum(total)) : 1.f;
    float dot = 0.f;
    if constexpr (K > 1) {
#pragma unroll
      for (int j = 0; j < VPT; ++j) dot += g[j] * s[j];
      dot = t.sum(dot) * inv_total;
    }
#pragma unroll
    for (int j = 0; j < VPT; ++j) out[j] = ((selected >> j) & 1ull) ? (g[j] - dot) * inv_total * slope[j] : 0.f;
  }
  store_row<T, E>(grad_logits, row, t, out);
}

// softmax(x), or sigmoid(x) normalised to sum 1 over the row (shifted as
// sigmoid_shift says).
template <int E, int SCORE>
__device__ __forceinline__ void normalised_scores(const Team<E>& t, const float (&x)[Team<E>::VPT], float (&q)[Team<E>::VPT]) {
  constexpr int VPT = Team<E>::VPT;
  const unsigned long long valid = t.valid();
  if constexpr (SCORE != SIGMOID) {
    softmax_row(t, x, valid, q);
  } else {
    bool above_half = false;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      q[j] = ((valid >> j) & 1ull) ? sigmoid(x[j]) : 0.f;
      above_half |= q[j] > 0.5f;
    }
    if (!t.any(above_half)) {
      const float c = sigmoid_shift(t, x, valid);
#pragma unroll
      for (int j = 0; j < VPT; ++j) q[j] = ((valid >> j) & 1ull) ? shifted_sigmoid(x[j], c) : 0.f;
    }
    float total = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) total += q[j];
    const float inv_total = __frcp_rn(t.sum(total));
#pragma unroll
    for (int j = 0; j < VPT; ++j) q[j] *= inv_total;
  }
}

// Scores of the load-balancing loss, forward: scores [T, E] f32 and the plain
// top-K routing map of the scores.
template <typename T, int E, int K, int SCORE, int BLOCK, int ROWS>
__global__ void __launch_bounds__(BLOCK)
    scores_fwd(const T* __restrict__ logits, unsigned char* __restrict__ routing_map, float* __restrict__ scores, int tokens) {
  check_per_token_launch<E, BLOCK, ROWS>();
  using TeamE = Team<E>;
  constexpr int VPT = TeamE::VPT;
  const TeamE t;
  const int row = t.row();
  if (row >= tokens) return;
  float x[VPT], q[VPT];
  unsigned rank[VPT];
  load_row<T, E>(logits, row, t, x);
  normalised_scores<E, SCORE>(t, x, q);
#pragma unroll
  for (int j = 0; j < VPT; ++j) rank[j] = rank_key(q[j]);
  unsigned long long chosen = 0;
  float unused[K];
  select_top<K>(t, rank, q, t.valid(), chosen, unused);
  store_row<float, E>(scores, row, t, q);
  store_row_mask<E>(routing_map, row, t, chosen);
}

// Scores of the load-balancing loss, backward: d logits from d scores.
template <typename T, int E, int SCORE, int BLOCK, int ROWS>
__global__ void __launch_bounds__(BLOCK)
    scores_bwd(const float* __restrict__ grad_scores, const T* __restrict__ logits, T* __restrict__ grad_logits, int tokens) {
  check_per_token_launch<E, BLOCK, ROWS>();
  using TeamE = Team<E>;
  constexpr int VPT = TeamE::VPT;
  const TeamE t;
  const int row = t.row();
  if (row >= tokens) return;
  float g[VPT], x[VPT], q[VPT], out[VPT];
  load_row<float, E>(grad_scores, row, t, g);
  load_row<T, E>(logits, row, t, x);
  normalised_scores<E, SCORE>(t, x, q);
  float dot = 0.f;
#pragma unroll
  for (int j = 0; j < VPT; ++j) dot += g[j] * q[j];
  dot = t.sum(dot);
  // q = u / sum(u): softmax u = exp(x), u' / sum = q; sigmoid u' / sum = q * (1 - sigmoid(x)),
  // with 1 - sigmoid(x) = sigmoid(-x), no cancellation near 1.
#pragma unroll
  for (int j = 0; j < VPT; ++j) out[j] = (SCORE == SIGMOID ? q[j] * sigmoid(-x[j]) : q[j]) * (g[j] - dot);
  store_row<T, E>(grad_logits, row, t, out);
}

// The load-balancing loss is scale * sum_{t,e} probs[t, e] * counts[e]. It is
// reduced deterministically, with no float atomics: block b of PARTIALS
// sums a fixed slice of rows into partials[b], then one block of PARTIALS
// threads adds the partials in order. The launch (src/router/cuda.rs) picks
// PARTIALS and the BLOCK threads of the other loss kernels.

// Elements per vector of the loss kernels: 16 bytes when rows allow, else 1.
template <typename T, int E>
constexpr int aux_vector() {
  return (E * sizeof(T)) % 16 == 0 ? 16 / sizeof(T) : 1;
}

template <typename T, typename C, int E, int BLOCK, int PARTIALS>
__global__ void __launch_bounds__(BLOCK)
    aux_loss_partials(const T* __restrict__ probs, const C* __restrict__ counts, float* __restrict__ partials, int tokens) {
  __shared__ float weight[E];
  for (int e = threadIdx.x; e < E; e += BLOCK) weight[e] = to_float(counts[e]);
  __syncthreads();
  constexpr int V = aux_vector<T, E>();
  const long long rows_per_block = (tokens + PARTIALS - 1) / PARTIALS;
  const long long first_row = blockIdx.x * rows_per_block;
  const long long last_row = min(static_cast<long long>(tokens), first_row + rows_per_block);
  // The block's rows start at column 0; a thread's column advances by a
  // constant step (no 64-bit division per vector).
  constexpr int STEP = (BLOCK * V) % E;
  float acc = 0.f;
  int column = (threadIdx.x * V) % E;
  for (long long v = first_row * E / V + threadIdx.x; v < last_row * E / V; v += BLOCK) {
    float p[V];
    load_floats<T, V, V == 1 ? 0 : 16>(probs + v * V, V, p);
#pragma unroll
    for (int i = 0; i < V; ++i) acc += p[i] * weight[column + i];
    column += STEP;
    if (column >= E) column -= E;
  }
  const float total = block_sum<BLOCK>(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

template <int PARTIALS>
__global__ void __launch_bounds__(PARTIALS)
    aux_loss_total(const float* __restrict__ partials, float* __restrict__ loss, float scale) {
  const float total = block_sum<PARTIALS>(partials[threadIdx.x]);
  if (threadIdx.x == 0) loss[0] = scale * total;
}

// The loss, backward: grad_probs[t, e] = scale * counts[e] * grad_loss.
template <typename T, typename C, int E, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    aux_loss_bwd(const float* __restrict__ grad_loss, const C* __restrict__ counts, T* __restrict__ grad_probs,
                 int tokens, float scale) {
  __shared__ float weight[E];
  const float g = grad_loss[0];
  for (int e = threadIdx.x; e < E; e += BLOCK) weight[e] = scale * to_float(counts[e]) * g;
  __syncthreads();
  constexpr int V = aux_vector<T, E>();
  const long long vectors = static_cast<long long>(tokens) * E / V;
  const long long first = static_cast<long long>(blockIdx.x) * BLOCK + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * BLOCK;
  // A thread's column advances by a fixed step: one division per thread, not per vector.
  const int step = static_cast<int>((stride * V) % E);
  int column = static_cast<int>((first * V) % E);
  for (long long v = first; v < vectors; v += stride) {
    float out[V];
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = weight[column + i];
    store_floats<T, V, V == 1 ? 0 : 16>(grad_probs + v * V, V, out);
    column += step;
    if (column >= E) column -= E;
  }
}
