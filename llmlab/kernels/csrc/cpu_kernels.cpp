// llmlab's CPU kernels: paged attention that reads the KV cache where it lives.
//
// Plain C++17 + OpenMP, no torch headers, called through ctypes
// (llmlab/kernels/cpu_kernels.py), so it compiles in about a second and does not depend
// on torch's C++ ABI. It joins torch's OpenMP pool: torch ships libgomp.so.1 and loads it
// first, so this library's libgomp.so.1 dependency resolves to that same copy.
//
// Layout of one layer (cpu_backend.CpuPagedAttention.kv_cache_shape):
//   keys   [num_kv_heads, num_blocks, head_dim, block_size]  (each block transposed)
//   values [num_kv_heads, num_blocks, block_size, head_dim]
// Token `offset` of block `b` is flat slot b * block_size + offset, as everywhere else.
// Keys are stored transposed within a block so that the scores of 16 consecutive keys are
// 16 lanes of one vector: q . k for a block is head_dim vertical multiply-adds, with no
// horizontal sum per key. Values keep rows of head_dim for the p * v accumulation.
//
// Each work item is (sequence, KV head, tile of up to TILE_Q query tokens). It reads each
// K/V block of its context once for all query heads of the group (grouped-query attention
// folded into the rows) and every query of the tile, with an online softmax (running max
// and sum per row), so nothing of size context is ever materialised.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#ifndef LLMLAB_SOURCE_HASH
#define LLMLAB_SOURCE_HASH "unknown"
#endif

namespace {

constexpr int64_t TILE_Q = 16;  // query tokens per work item in prefill
constexpr int64_t LANES = 16;   // floats per vector (one AVX-512 register)
constexpr int64_t PREFETCH_AHEAD = 2;  // K/V blocks requested ahead of use
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

typedef uint16_t bf16;
// GCC/Clang vector extensions: the compiler maps them onto the machine's SIMD registers.
typedef float vfloat __attribute__((vector_size(4 * LANES)));
typedef uint16_t vhalf __attribute__((vector_size(2 * LANES)));
typedef uint32_t vuint __attribute__((vector_size(4 * LANES)));

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) {
  uint32_t bits = uint32_t(x) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vfloat load(const bf16* p) {
#ifdef __AVX512F__
  // One widening move (GCC lowers the generic conversion below to two halves).
  const __m512i u = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return vfloat(_mm512_castsi512_ps(u));
#else
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  vuint u = __builtin_convertvector(h, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

inline void store(float x, float* out) { *out = x; }
inline void store(float x, bf16* out) {
  // Round to nearest even, as torch's float -> bfloat16 conversion does.
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *out = 0x7fc0;  // NaN stays NaN
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *out = bf16(bits >> 16);
}

// exp(x) for x in [-87, 88], branch-free so loops over it vectorise (libm's expf does not,
// without -ffast-math): Cephes' range reduction x = n ln2 + r, |r| <= ln2 / 2, and its
// degree-6 polynomial; about 1 ulp. Rounding by the 1.5 * 2^23 trick (valid for |n| < 2^22).
inline float exp_in_range(float x) {
  const float magic = 12582912.0f;
  float n = (x * 1.44269504088896341f + magic) - magic;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * (r * r) + r + 1.0f;
  int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

// exp(x) for x <= 0 (softmax terms). 2^-126 > exp(-87): n stays a normal exponent; NaN
// (a score that is never used) becomes -87.
inline float exp_nonpositive(float x) {
  x = x > -87.0f ? x : -87.0f;
  return exp_in_range(x < 0.0f ? x : 0.0f);
}

// exp(x) for any float x, clamped to the float range.
inline float exp_any(float x) {
  x = x > -87.0f ? x : -87.0f;
  return exp_in_range(x < 88.0f ? x : 88.0f);
}

struct Step {
  // One step's batch, shared by every layer (built once per step on the Python side).
  const int64_t* query_start;  // [num_seqs + 1] first flat token of each sequence
  const int64_t* seq_lens;     // [num_seqs] context length after the step
  const int64_t* block_tables; // [num_seqs, table_stride]
  const int64_t* slot_mapping; // [num_tokens] slot each new token's K/V goes to
  const int64_t* items;        // [num_items, 2]: (sequence, first query token offset)
  int64_t table_stride;
  int64_t num_seqs;
  int64_t num_tokens;
  int64_t num_items;
  int64_t block_size;
  int64_t num_threads;  // torch.get_num_threads(): this thread's OpenMP setting may differ
};

struct Layer {
  // One layer's tensors. Element strides; the last (head_dim) axis is contiguous in all.
  const void* q;
  int64_t q_token_stride, q_head_stride;
  const void* k;
  int64_t k_token_stride, k_head_stride;
  const void* v;
  int64_t v_token_stride, v_head_stride;
  void* key_cache;    // [num_kv_heads, num_blocks, head_dim, block_size]
  void* value_cache;  // [num_kv_heads, num_blocks, block_size, head_dim]
  int64_t cache_head_stride;  // num_blocks * block_size * head_dim
  int64_t num_blocks;  // blocks in the cache: every block id and slot is checked against it
  void* out;          // [num_tokens, num_heads, head_dim], contiguous
  int64_t num_heads, num_kv_heads, head_dim;
  float scale;
  int64_t sliding_window;  // 0: none
};

// Writes the new tokens' K/V. A slot outside the cache is not written: it sets `bad`.
template <typename T>
void write_kv(const Step& s, const Layer& l, int& bad) {
  const T* k = static_cast<const T*>(l.k);
  const T* v = static_cast<const T*>(l.v);
  T* kc = static_cast<T*>(l.key_cache);
  T* vc = static_cast<T*>(l.value_cache);
  const int64_t d = l.head_dim, bs = s.block_size;
#pragma omp for schedule(static)
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    const int64_t slot = s.slot_mapping[t];
    if (slot < 0 || slot >= l.num_blocks * bs) {
#pragma omp atomic write
      bad = 1;
      continue;
    }
    const int64_t block = slot / bs, offset = slot % bs;
    for (int64_t h = 0; h < l.num_kv_heads; ++h) {
      const T* src = k + t * l.k_token_stride + h * l.k_head_stride;
      T* dst = kc + h * l.cache_head_stride + block * bs * d + offset;
      for (int64_t i = 0; i < d; ++i) dst[i * bs] = src[i];
      std::memcpy(vc + h * l.cache_head_stride + slot * d,
                  v + t * l.v_token_stride + h * l.v_head_stride, d * sizeof(T));
    }
  }
}

struct Scratch {
  std::vector<float> q, acc, p, row_max, row_sum, correction;
  std::vector<int64_t> lo, hi;
};

// The rows of one work item: row r is query token (first + r / group) of the sequence,
// query head (kv_head * group + r % group). Rows go through the vector loops RB at a time
// (RB = 1, 2 or 4: as many as the item has, up to 4), padded with zero queries whose
// results are dropped, so the loops need no tails and a decode with a group of 2 does not
// compute 2 wasted rows.
constexpr int64_t ROW_BLOCK = 4;  // the most rows at once (the scalar path's block too)

// Scores of RB rows against one block: p[r][j] = q_r . k_j for j < block_size. Even and odd
// channels accumulate separately: two dependency chains per row instead of one.
template <typename T, int64_t D, int64_t RB>
inline void block_scores(const float* q, const T* kb, int64_t bs, float* p) {
  for (int64_t c = 0; c < bs; c += LANES) {
    vfloat even[RB] = {}, odd[RB] = {};
    for (int64_t i = 0; i < D; i += 2) {
      const vfloat k0 = load(kb + i * bs + c);
      const vfloat k1 = load(kb + (i + 1) * bs + c);
      for (int64_t r = 0; r < RB; ++r) {
        even[r] += q[r * D + i] * k0;
        odd[r] += q[r * D + i + 1] * k1;
      }
    }
    for (int64_t r = 0; r < RB; ++r) store(p + r * bs + c, even[r] + odd[r]);
  }
}

// acc[r] += sum_j p[r][j] * v_j over keys [j0, j1) of a block, for RB rows.
template <typename T, int64_t D, int64_t RB>
inline void block_values(const float* p, int64_t bs, const T* vb, int64_t j0, int64_t j1,
                         float* acc) {
  constexpr int64_t V = D / LANES;
  // RB rows of D / LANES vectors each: in registers for D <= 64; D = 128 spills some.
  vfloat a[RB][V];
  for (int64_t r = 0; r < RB; ++r)
    for (int64_t c = 0; c < V; ++c) a[r][c] = load(acc + r * D + c * LANES);
  for (int64_t j = j0; j < j1; ++j) {
    const T* vj = vb + j * D;
    for (int64_t c = 0; c < V; ++c) {
      const vfloat x = load(vj + c * LANES);
      for (int64_t r = 0; r < RB; ++r) a[r][c] += p[r * bs + j] * x;
    }
  }
  for (int64_t r = 0; r < RB; ++r)
    for (int64_t c = 0; c < V; ++c) store(acc + r * D + c * LANES, a[r][c]);
}

// The same two steps for any head_dim and block size, in scalar loops.
template <typename T>
inline void block_scores_any(const float* q, const T* kb, int64_t bs, int64_t d, float* p) {
  for (int64_t r = 0; r < ROW_BLOCK; ++r)
    for (int64_t j = 0; j < bs; ++j) {
      float dot = 0.0f;
      for (int64_t i = 0; i < d; ++i) dot += q[r * d + i] * to_f32(kb[i * bs + j]);
      p[r * bs + j] = dot;
    }
}

template <typename T>
inline void block_values_any(const float* p, int64_t bs, const T* vb, int64_t j0, int64_t j1,
                             int64_t d, float* acc) {
  for (int64_t r = 0; r < ROW_BLOCK; ++r)
    for (int64_t j = j0; j < j1; ++j) {
      const float pj = p[r * bs + j];
      const T* vj = vb + j * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[r * d + i] += pj * to_f32(vj[i]);
    }
}

// D > 0: head_dim known at compile time and block_size a multiple of LANES (vector path),
// RB rows at a time; D == 0: any head_dim and block size (scalar path, RB = ROW_BLOCK).
// Attends one work item. Returns false, having written nothing, if the item's lengths or
// block ids do not fit the batch and the cache (the Python side checks nothing per step:
// this is where an inconsistent batch is caught, at the cost of a compare per block).
template <typename T, int64_t D, int64_t RB>
bool attend(const Step& s, const Layer& l, int64_t seq, int64_t first, int64_t kv_head,
            Scratch& w) {
  if (seq < 0 || seq >= s.num_seqs) return false;
  const int64_t d = D > 0 ? D : l.head_dim;
  const int64_t group = l.num_heads / l.num_kv_heads;
  const int64_t q_begin = s.query_start[seq];
  const int64_t q_len = s.query_start[seq + 1] - q_begin;
  const int64_t ctx = s.seq_lens[seq];
  if (q_len < 1 || first < 0 || first >= q_len || ctx < q_len ||
      ctx > s.table_stride * s.block_size) {
    return false;
  }
  const int64_t nq = std::min(TILE_Q, q_len - first);
  const int64_t rows = nq * group;
  const int64_t padded = (rows + RB - 1) / RB * RB;
  const int64_t bs = s.block_size;
  const int64_t window = l.sliding_window;

  w.q.assign(padded * d, 0.0f);
  w.acc.assign(padded * d, 0.0f);
  w.p.assign(padded * bs, 0.0f);
  w.row_max.assign(padded, NEG_INF);
  w.row_sum.assign(padded, 0.0f);
  w.correction.assign(padded, 1.0f);
  w.lo.assign(padded, 0);
  w.hi.assign(padded, -1);

  const T* q = static_cast<const T*>(l.q);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q_begin + first + r / group;
    const int64_t head = kv_head * group + r % group;
    const T* src = q + token * l.q_token_stride + head * l.q_head_stride;
    float* dst = w.q.data() + r * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = to_f32(src[i]) * l.scale;
    const int64_t pos = ctx - q_len + first + r / group;  // the query's position
    w.hi[r] = pos;  // keys [lo, hi] are visible to row r
    w.lo[r] = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  }
  const int64_t key_lo = w.lo[0];  // the first row sees the earliest keys
  const int64_t key_hi = w.hi[rows - 1] + 1;

  const int64_t block_elems = bs * d;
  const T* kc = static_cast<const T*>(l.key_cache) + kv_head * l.cache_head_stride;
  const T* vc = static_cast<const T*>(l.value_cache) + kv_head * l.cache_head_stride;
  const int64_t* table = s.block_tables + seq * s.table_stride;

  const int64_t first_block = key_lo / bs;
  for (int64_t block = first_block; block * bs < key_hi; ++block) {
    if (table[block] < 0 || table[block] >= l.num_blocks) return false;
    const int64_t key0 = block * bs;
    const T* kb = kc + table[block] * block_elems;
    const T* vb = vc + table[block] * block_elems;
    // Blocks lie anywhere in the cache, so the hardware prefetcher cannot guess the next
    // ones: ask for the one PREFETCH_AHEAD blocks on (and, at the start, for the ones
    // before it) into L2 while this one is computed on.
    for (int64_t ahead = block == first_block ? 1 : PREFETCH_AHEAD; ahead <= PREFETCH_AHEAD;
         ++ahead) {
      if ((block + ahead) * bs >= key_hi || table[block + ahead] >= l.num_blocks) break;
      const char* nk = reinterpret_cast<const char*>(kc + table[block + ahead] * block_elems);
      const char* nv = reinterpret_cast<const char*>(vc + table[block + ahead] * block_elems);
      for (int64_t b = 0; b < block_elems * int64_t(sizeof(T)); b += 64) {
        __builtin_prefetch(nk + b, 0, 1);
        __builtin_prefetch(nv + b, 0, 1);
      }
    }
    for (int64_t r0 = 0; r0 < padded; r0 += RB) {
      if constexpr (D > 0) {
        block_scores<T, D, RB>(w.q.data() + r0 * d, kb, bs, w.p.data() + r0 * bs);
      } else {
        block_scores_any<T>(w.q.data() + r0 * d, kb, bs, d, w.p.data() + r0 * bs);
      }
    }
    // Online softmax, row by row. Keys past a row's last visible one may be unwritten
    // (NaN or garbage) in the cache: their p is set to 0, never computed from them.
    int64_t j_lo = bs, j_hi = 0;  // keys any row sees in this block
    for (int64_t r = 0; r < rows; ++r) {
      float* pr = w.p.data() + r * bs;
      const int64_t lo = std::max<int64_t>(w.lo[r] - key0, 0);
      const int64_t hi = std::min<int64_t>(w.hi[r] - key0, bs - 1);
      w.correction[r] = 1.0f;
      if (hi < lo) {
        std::fill(pr, pr + bs, 0.0f);
        continue;
      }
      j_lo = std::min(j_lo, lo);
      j_hi = std::max(j_hi, hi + 1);
      float chunk_max = NEG_INF;
#pragma omp simd reduction(max : chunk_max)
      for (int64_t j = lo; j <= hi; ++j) chunk_max = pr[j] > chunk_max ? pr[j] : chunk_max;
      const float old_max = w.row_max[r];
      const float new_max = std::max(old_max, chunk_max);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < bs; ++j) {
        const float e = exp_nonpositive(pr[j] - new_max);
        pr[j] = (j >= lo && j <= hi) ? e : 0.0f;
        sum += pr[j];
      }
      const float c = old_max == NEG_INF ? 0.0f : exp_nonpositive(old_max - new_max);
      w.row_max[r] = new_max;
      w.row_sum[r] = w.row_sum[r] * c + sum;
      w.correction[r] = c;
    }
    if (j_hi <= j_lo) continue;
    for (int64_t r = 0; r < rows; ++r) {
      const float c = w.correction[r];
      if (c == 1.0f) continue;
      float* ar = w.acc.data() + r * d;
      for (int64_t i = 0; i < d; ++i) ar[i] *= c;
    }
    for (int64_t r0 = 0; r0 < padded; r0 += RB) {
      if constexpr (D > 0) {
        block_values<T, D, RB>(w.p.data() + r0 * bs, bs, vb, j_lo, j_hi, w.acc.data() + r0 * d);
      } else {
        block_values_any<T>(w.p.data() + r0 * bs, bs, vb, j_lo, j_hi, d, w.acc.data() + r0 * d);
      }
    }
  }

  T* out = static_cast<T*>(l.out);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q_begin + first + r / group;
    const int64_t head = kv_head * group + r % group;
    T* dst = out + (token * l.num_heads + head) * d;
    const float* ar = w.acc.data() + r * d;
    // Every row sees at least its own key, so the sum is positive.
    const float inv = 1.0f / w.row_sum[r];
    for (int64_t i = 0; i < d; ++i) store(ar[i] * inv, dst + i);
  }
  return true;
}

// Returns 0, or -2 when the batch addresses something outside the cache or its lengths
// are inconsistent (nothing is then read or written out of bounds).
template <typename T, int64_t D, int64_t RB>
int paged_attention(const Step& s, const Layer& l) {
  if (s.query_start[s.num_seqs] != s.num_tokens) return -2;
  const int64_t work = s.num_items * l.num_kv_heads;
  int bad = 0;
#pragma omp parallel num_threads(int(std::max<int64_t>(1, s.num_threads)))
  {
    write_kv<T>(s, l, bad);  // ends in the implicit barrier of its omp for
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < work; ++w) {
      const int64_t item = w / l.num_kv_heads;
      if (!attend<T, D, RB>(s, l, s.items[2 * item], s.items[2 * item + 1],
                            w % l.num_kv_heads, scratch)) {
#pragma omp atomic write
        bad = 1;
      }
    }
  }
  return bad ? -2 : 0;
}

template <typename T, int64_t D>
int dispatch_rows(const Step& s, const Layer& l, bool prefill) {
  // A decode item has `group` rows; a prefill tile up to TILE_Q times that.
  const int64_t group = l.num_heads / l.num_kv_heads;
  if (!prefill && group == 1) return paged_attention<T, D, 1>(s, l);
  if (!prefill && group == 2) return paged_attention<T, D, 2>(s, l);
  return paged_attention<T, D, 4>(s, l);
}

template <typename T>
int dispatch(const Step& s, const Layer& l) {
  const bool prefill = s.num_tokens > s.num_seqs;
  if (s.block_size % LANES == 0 && l.head_dim == 64) return dispatch_rows<T, 64>(s, l, prefill);
  if (s.block_size % LANES == 0 && l.head_dim == 128) return dispatch_rows<T, 128>(s, l, prefill);
  return paged_attention<T, 0, ROW_BLOCK>(s, l);
}

// ---------------------------------------------------------------------- fused elementwise
//
// Each replaces a chain of small torch ops (one pass over memory and one dispatch each) by
// one pass. Rounding follows the torch chain it replaces, so float32 results agree to
// summation order and bfloat16 ones round at the same points.

template <typename T>
inline T round_to(float x) {
  T out;
  store(x, &out);
  return out;
}

// residual <- x + residual (rounded to T), out <- weight * T(norm(residual)); or, with no
// residual, out <- weight * T(norm(x)). norm(v) = v / sqrt(mean(v^2) + eps) in float32.
template <typename T>
void add_rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t dim,
                  float eps, int64_t threads) {
#pragma omp parallel for num_threads(int(threads)) schedule(static) if (rows * dim > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    T* rr = residual ? residual + r * dim : nullptr;
    T* o = out + r * dim;
    float sum = 0.0f;
    if (rr) {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) {
        const T v = round_to<T>(to_f32(xr[i]) + to_f32(rr[i]));
        rr[i] = v;
        const float f = to_f32(v);
        sum += f * f;
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) sum += to_f32(xr[i]) * to_f32(xr[i]);
    }
    const float inv = 1.0f / std::sqrt(sum / float(dim) + eps);
    const T* v = rr ? rr : xr;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) {
      const float normed = to_f32(round_to<T>(to_f32(v[i]) * inv));
      store(to_f32(weight[i]) * normed, o + i);
    }
  }
}

// out[r, i] = T(T(silu(g)) * u) for g = gate_up[r, i], u = gate_up[r, half + i].
template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t rows, int64_t half, int64_t threads) {
#pragma omp parallel for num_threads(int(threads)) schedule(static) if (rows * half > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * half;
    const T* u = g + half;
    T* o = out + r * half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x = to_f32(g[i]);
      const float act = to_f32(round_to<T>(x / (1.0f + exp_any(-x))));
      store(act * to_f32(u[i]), o + i);
    }
  }
}

// In place, for each token t and head h of x ([tokens, heads, head_dim], element strides
// token_stride, head_stride): the first rot channels rotate NeoX-style by cos/sin
// ([tokens, rot], rows contiguous): y_i = x_i cos_i - x_{i+rot/2} sin_i,
// y_{i+rot/2} = x_{i+rot/2} cos_{i+rot/2} + x_i sin_{i+rot/2}; the rest pass through.
template <typename T>
void rotary(T* x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
            const T* cos, const T* sin, int64_t rot, int64_t threads) {
  const int64_t half = rot / 2;
#pragma omp parallel for num_threads(int(threads)) schedule(static) if (tokens * heads * rot > 16384)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * rot;
    const T* s = sin + t * rot;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + t * token_stride + h * head_stride;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = to_f32(v[i]), b = to_f32(v[i + half]);
        // Each product rounded, then the sum: as x * cos + rotate_half(x) * sin in T.
        const float lo = to_f32(round_to<T>(a * to_f32(c[i]))) +
                         to_f32(round_to<T>(-b * to_f32(s[i])));
        const float hi = to_f32(round_to<T>(b * to_f32(c[i + half]))) +
                         to_f32(round_to<T>(a * to_f32(s[i + half])));
        store(lo, v + i);
        store(hi, v + i + half);
      }
    }
  }
}

// Greedy sampling with the chosen token's logprob, in one call: per row of float32
// logits, the first index of the maximum and log_softmax at it, -log(sum_j exp(x_j - max)).
// (torch: argmax, then logsumexp, then a gather: three passes and three dispatches.)
void argmax_logprob(const float* logits, int64_t rows, int64_t vocab, int64_t* tokens,
                    float* logprobs, int64_t threads) {
#pragma omp parallel for num_threads(int(threads)) schedule(static) if (rows * vocab > 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * vocab;
    float best = NEG_INF;  // NaN never wins over a number
#pragma omp simd reduction(max : best)
    for (int64_t j = 0; j < vocab; ++j) best = x[j] > best ? x[j] : best;
    int64_t arg = 0;
    for (int64_t j = 0; j < vocab; ++j) {
      if (x[j] == best) {
        arg = j;
        break;
      }
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < vocab; ++j) sum += exp_nonpositive(x[j] - best);
    tokens[r] = arg;
    logprobs[r] = -std::log(sum);
  }
}

}  // namespace

extern "C" {

// The hash of the source (and flags) this library was built from; the loader uses a
// library only if it matches, so a stale build is never used.
const char* llmlab_source_hash() { return LLMLAB_SOURCE_HASH; }

int64_t llmlab_tile_q() { return TILE_Q; }

// Write the layer's new K/V into the paged cache, then attend. dtype: 0 float32,
// 1 bfloat16 (q, k, v, caches and out all of it). Returns 0; -1 for an unknown dtype; -2
// for a batch that addresses blocks or slots outside the cache or has inconsistent lengths.
int llmlab_paged_attention(int dtype, const Step* step, const Layer* layer) {
  if (dtype == 0) return dispatch<float>(*step, *layer);
  if (dtype == 1) return dispatch<bf16>(*step, *layer);
  return -1;
}

// The fused elementwise ops (see above). dtype as for llmlab_paged_attention; every tensor
// of one call has that dtype. Each returns 0, or -1 for an unknown dtype.
int llmlab_add_rms_norm(int dtype, const void* x, void* residual, const void* weight, void* out,
                        int64_t rows, int64_t dim, float eps, int64_t threads) {
  if (dtype == 0) {
    add_rms_norm<float>(static_cast<const float*>(x), static_cast<float*>(residual),
                        static_cast<const float*>(weight), static_cast<float*>(out), rows, dim,
                        eps, threads);
  } else if (dtype == 1) {
    add_rms_norm<bf16>(static_cast<const bf16*>(x), static_cast<bf16*>(residual),
                       static_cast<const bf16*>(weight), static_cast<bf16*>(out), rows, dim,
                       eps, threads);
  } else {
    return -1;
  }
  return 0;
}

int llmlab_silu_and_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t half,
                        int64_t threads) {
  if (dtype == 0) {
    silu_and_mul<float>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows,
                        half, threads);
  } else if (dtype == 1) {
    silu_and_mul<bf16>(static_cast<const bf16*>(gate_up), static_cast<bf16*>(out), rows, half,
                       threads);
  } else {
    return -1;
  }
  return 0;
}

void llmlab_argmax_logprob(const float* logits, int64_t rows, int64_t vocab, int64_t* tokens,
                           float* logprobs, int64_t threads) {
  argmax_logprob(logits, rows, vocab, tokens, logprobs, threads);
}

int llmlab_rotary(int dtype, void* x, int64_t tokens, int64_t heads, int64_t token_stride,
                  int64_t head_stride, const void* cos, const void* sin, int64_t rot,
                  int64_t threads) {
  if (dtype == 0) {
    rotary<float>(static_cast<float*>(x), tokens, heads, token_stride, head_stride,
                  static_cast<const float*>(cos), static_cast<const float*>(sin), rot, threads);
  } else if (dtype == 1) {
    rotary<bf16>(static_cast<bf16*>(x), tokens, heads, token_stride, head_stride,
                 static_cast<const bf16*>(cos), static_cast<const bf16*>(sin), rot, threads);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
