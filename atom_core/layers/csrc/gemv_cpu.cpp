// Weight-streaming GEMM: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), built for decode steps (M of
// 1 to MAX_ROWS rows), and serving any M where oneDNN has no kernel for the weights' dtype
// (bfloat16 on CPUs without avx512_bf16 or AMX, where oneDNN lacks or emulates it).
//
// At a few rows a Linear is a stream over its weight: each weight is read once and used M
// times, so the kernel's job is to keep the memory bus busy (oneDNN's packed GEMM reads it
// well below the copy bandwidth at one row; docs/performance.md).
//
// The weight is laid out for this kernel (linear.py's `gemv_weight`): tiles of TILE output
// rows (two vectors: 32 with AVX-512, 16 with AVX2), and within a tile, for each k
// (bfloat16: each pair k, k + 1), the TILE rows' values side by side, two vectors whose lane
// c belongs to output row c. A tile is one sequential stream, which these hosts serve best
// (variants that read two streams side by side lost from memory), and x is broadcast: one
// load of x serves TILE outputs, and no output needs a horizontal sum (the row-major kernel
// this replaced was bound by its x loads and cross-lane sums at 6-8 rows, not by memory).
// Each thread takes a contiguous run of tiles, each line prefetched (non-temporal)
// PREFETCH_BYTES ahead; rows go through a tile a few at a time (as many as the registers
// hold accumulators for), further passes reading the tile from cache. Past CHUNK_ROWS rows
// (a GEMM), x is taken a chunk at a time so that the chunk stays in L2 under the tiles.
// Where widening bfloat16 in the registers leaves room for fewer rows a pass than float32
// (AVX2), a chunk of more than two such passes widens each tile a block of k at a time
// into L1 and takes float32's passes over the block (`kblock_passes`).
//
// Each output is one chain of float32 sums in k order: fused multiply-adds of the widened
// values, or, on CPUs with avx512_bf16, for bfloat16 weights and activations one vdpbf16ps
// per pair (its two products added into the chain in turn, each rounded, as Zen 5 computes
// it). Every output sums alike whatever M and wherever its row sits in a tile, so a row
// computes alike at any row count and a column alike in any subset of the weight's rows
// (the LM head screen's exact recomputation relies on it; within one variant). Each output
// rounds once to the activation dtype. The weights themselves sit in 2 MiB pages
// (`memory.weight_arena`).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "out_tensor.h"
#include "simd.h"

// The loops over a tile's rows (M, MB: compile-time constants) unroll fully, so that their
// accumulators live in registers: left to itself GCC 12 kept those of small tiles in stack
// memory, one store and reload per FMA.
#define UNROLL _Pragma("GCC unroll 16")

namespace {

using atom::from_float;
using atom::to_float;
#if defined(__AVX512F__) && defined(__AVX512BW__)
using atom::bf16_bits;
using atom::store_lanes;
#endif
namespace simd = atom::simd;
using simd::vf;

constexpr int64_t L = simd::kLanes;
constexpr int64_t TILE = 2 * L;  // output rows per tile: two vectors
// Rows of x per pass over a tile of W: their 2 * rows accumulators, the tile's vectors and a
// broadcast fit in the registers (AVX-512: 32; AVX2: 16, which hold six rows beside a float32
// tile's two vectors but four beside a bfloat16 pair's four); more rows take more passes, from cache.
template <typename W>
constexpr int rows_per_pass() {
  return simd::kRegisters == 32 ? 8 : std::is_same_v<W, c10::BFloat16> ? 4 : 6;
}
// Rows of x per chunk in a GEMM (many rows): a chunk of x stays in L2 while a thread's run
// of tiles passes under it.
constexpr int64_t CHUNK_ROWS = 64;
// k values of a tile widened at a time (`kblock_passes`; even: bfloat16 pairs stay whole):
// the block and the chunk's sums stay in L1 (64 read faster than 128 or 256).
constexpr int64_t KBLOCK = 64;
// How far ahead in a tile's stream each line is prefetched: 8 KiB read 2-6% faster than 4
// at 6-8 rows (in fast spells) and level at 1-2.
constexpr int64_t PREFETCH_BYTES = 8192;

// A step of BYTES in a tile's stream (float32: a k's row; bfloat16: a pair's; float16: a k's,
// half a line with AVX2, whose steps prefetch on the line's first half).
template <int64_t BYTES = TILE * 4>
inline void prefetch_step(const void* p) {
  const char* c = static_cast<const char*>(p) + PREFETCH_BYTES;
  if (BYTES < 64 && reinterpret_cast<uintptr_t>(p) % 64 != 0) return;
  for (int64_t off = 0; off < BYTES; off += 64) simd::prefetch_stream(c + off);
}

// K values of one tile against the M rows of x (row stride ldx): acc[h][m] holds outputs
// L h .. L h + L - 1 of row m. Weights float32, or float16 widened exactly (F16C) as they
// are loaded: the same products and sums as float32 weights of the same values.
// kStream: w is read from memory (prefetched ahead), not a widened block already in cache.
template <int M, bool kStream = true, typename W>
inline void tile_f32(const float* x, int64_t ldx, int64_t K, const W* w, vf (&acc)[2][M]) {
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * TILE;
    if constexpr (kStream) prefetch_step<TILE * sizeof(W)>(wk);
    const vf w0 = simd::load(wk), w1 = simd::load(wk + L);
    UNROLL for (int m = 0; m < M; ++m) {
      const vf xv = simd::set1(x[m * ldx + k]);
      acc[0][m] = simd::fmadd(w0, xv, acc[0][m]);
      acc[1][m] = simd::fmadd(w1, xv, acc[1][m]);
    }
  }
}

// bfloat16 weights (lane c of a pair's vector: row c's values at k and k + 1, low half first)
// against float32 activations: the weights widened exactly, two fused multiply-adds.
template <int M>
inline void tile_bf16_f32(const float* x, int64_t K, const c10::BFloat16* w, vf (&acc)[2][M]) {
  for (int64_t k = 0; k < K; k += 2) {
    const c10::BFloat16* wk = w + k * TILE;
    prefetch_step(wk);
    vf even[2], odd[2];
    UNROLL for (int h = 0; h < 2; ++h) simd::load_pairs(wk + 2 * L * h, even[h], odd[h]);
    UNROLL for (int m = 0; m < M; ++m) {
      const vf x0 = simd::set1(x[m * K + k]), x1 = simd::set1(x[m * K + k + 1]);
      UNROLL for (int h = 0; h < 2; ++h) acc[h][m] = simd::fmadd(odd[h], x1, simd::fmadd(even[h], x0, acc[h][m]));
    }
  }
}

// K values of a bfloat16 tile widened (exactly) into the float32 tile layout [K][TILE]: every
// pass of `tile_bf16_f32` widens the tile again, and with AVX2's four rows a pass those
// shifts and ands take issue slots from the FMAs.
inline void widen_tile(const c10::BFloat16* w, int64_t K, float* out) {
  for (int64_t k = 0; k < K; k += 2) {
    const c10::BFloat16* wk = w + k * TILE;
    prefetch_step(wk);
    UNROLL for (int h = 0; h < 2; ++h) {
      vf even, odd;
      simd::load_pairs(wk + 2 * L * h, even, odd);
      simd::store(out + k * TILE + L * h, even);
      simd::store(out + (k + 1) * TILE + L * h, odd);
    }
  }
}

// Rows m of x (row stride ldx) against kn values of a widened tile block, continuing the
// sums acc_rows[m] (TILE floats a row; zeros where `first`): `tile_f32` over the block, the
// same fused multiply-adds in the same order as `tile_bf16_f32` over the whole tile (k, then
// k + 1), so the same bits.
template <int M>
inline void block_rows(const float* x, int64_t ldx, int64_t kn, const float* wide, float* acc_rows, bool first) {
  vf acc[2][M];
  UNROLL for (int h = 0; h < 2; ++h)
    UNROLL for (int m = 0; m < M; ++m) acc[h][m] = first ? simd::zero() : simd::load(acc_rows + m * TILE + h * L);
  tile_f32<M, false>(x, ldx, kn, wide, acc);
  UNROLL for (int h = 0; h < 2; ++h)
    UNROLL for (int m = 0; m < M; ++m) simd::store(acc_rows + m * TILE + h * L, acc[h][m]);
}

#if defined(__AVX512BF16__)
// bfloat16 weights and activations: one vdpbf16ps per pair (x's pair broadcast as 32 bits).
// Without avx512_bf16, bfloat16 activations are widened to float32 first (`gemv`).
template <int M>
inline void tile_bf16(const c10::BFloat16* x, int64_t K, const c10::BFloat16* w, __m512 (&acc)[2][M]) {
  const int32_t* pairs = reinterpret_cast<const int32_t*>(x);
  const int64_t P = K / 2;
  for (int64_t p = 0; p < P; ++p) {
    const c10::BFloat16* wp = w + p * 2 * TILE;
    prefetch_step(wp);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    UNROLL for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pairs[m * P + p]);
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], w0, xv);
      acc[1][m] = _mm512_dpbf16_ps(acc[1][m], w1, xv);
    }
  }
}
#endif

// Tile t's TILE sums of a row (out) into that row of y (N columns), bias added, rounded once.
template <typename T>
inline void store_sums(const float* out, int64_t N, const float* bias, T* row, int64_t t) {
  const int64_t n0 = t * TILE, cols = std::min(TILE, N - n0);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // a vector at a time (the same sums and rounding): at a few dozen rows a tile's stores are
  // as many as its weights' cache lines
  UNROLL for (int64_t h = 0; h < TILE; h += L) {
    if (cols <= h) break;
    const __mmask16 keep = cols - h >= L ? 0xFFFF : (1u << (cols - h)) - 1;
    __m512 v = _mm512_loadu_ps(out + h);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + n0 + h));
    store_lanes(row + n0 + h, v, keep);
  }
#else
  for (int64_t c = 0; c < cols; ++c) row[n0 + c] = from_float<T>(out[c] + (bias ? bias[n0 + c] : 0.f));
#endif
}

// Tile t (its weights at wt) for rows [0, M) of x (already offset to the block's first row),
// written to y.
template <typename W, typename X, typename T, int M>
inline void one_tile(const X* x, int64_t K, const W* wt, int64_t N, const float* bias, T* y, int64_t t) {
  vf acc[2][M];
  UNROLL for (int h = 0; h < 2; ++h)
    UNROLL for (int m = 0; m < M; ++m) acc[h][m] = simd::zero();
  if constexpr (!std::is_same_v<W, c10::BFloat16>) tile_f32<M>(x, K, K, wt, acc);
  else if constexpr (std::is_same_v<X, float>) tile_bf16_f32<M>(x, K, wt, acc);
#if defined(__AVX512BF16__)
  else tile_bf16<M>(x, K, wt, acc);
#endif
  UNROLL for (int m = 0; m < M; ++m) {
    alignas(64) float out[TILE];
    simd::store(out, acc[0][m]);
    simd::store(out + L, acc[1][m]);
    store_sums(out, N, bias, y + m * N, t);
  }
}

// fn(std::integral_constant<int, rows>{}) for rows 1 .. rows_per_pass<float>(): the row
// count as a compile-time constant, so that a pass's loops over its rows unroll.
template <typename F>
inline void with_rows(int rows, F&& fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
#if defined(__AVX512F__)
    case 7: return fn(std::integral_constant<int, 7>{});
    case 8: return fn(std::integral_constant<int, 8>{});
#endif
  }
}

// The rows [c0, c1) of a chunk in as few passes of at most R rows as R allows, of equal rows:
// fn(first row, rows).
template <int R, typename F>
inline void passes_of(int64_t c0, int64_t c1, F&& fn) {
  const int64_t n = c1 - c0, npass = (n + R - 1) / R;
  for (int64_t p = 0, m0 = c0; p < npass; ++p) {
    const int64_t rows = n / npass + (p < n % npass);
    fn(m0, static_cast<int>(rows));
    m0 += rows;
  }
}

// Rows [c0, c1) of x (row stride K) against bfloat16 tile t (weights at wt), a block of
// KBLOCK k at a time: each block widened once into `block`, float32's passes over it, the
// rows' sums kept in `sums` (TILE floats a row) between blocks.
template <typename T>
void kblock_passes(const float* x, int64_t c0, int64_t c1, int64_t K, const c10::BFloat16* wt, int64_t N,
                   const float* bias, T* y, int64_t t, float* block, float* sums) {
  for (int64_t kb = 0; kb < K; kb += KBLOCK) {
    const int64_t kn = std::min(KBLOCK, K - kb);
    widen_tile(wt + kb * TILE, kn, block);
    passes_of<rows_per_pass<float>()>(c0, c1, [&](int64_t m0, int rows) {
      with_rows(rows, [&](auto r) {
        block_rows<decltype(r)::value>(x + m0 * K + kb, K, kn, block, sums + (m0 - c0) * TILE, kb == 0);
      });
    });
  }
  for (int64_t m = c0; m < c1; ++m) store_sums(sums + (m - c0) * TILE, N, bias, y + m * N, t);
}

// Every row of x against every tile. Each thread takes a contiguous run of tiles (a long
// sequential stream), at least two; within it, chunks of rows, and within a chunk each tile
// in as few passes as `rows_per_pass` allows, of equal rows (the first pass reads the tile from
// memory, the others from cache).
// bfloat16 weights against float32 rows where widening in the registers costs rows a pass
// (AVX2: four, against float32's six): a chunk of more than two such passes takes
// `kblock_passes`. Not with AVX-512 (eight rows a pass either way) nor for float16 (F16C
// widens a vector in one instruction): there the widened copy measured slower than widening
// at every pass (docs/performance.md, twenty-fifth session).
template <typename W, typename X, typename T>
void gemm_impl(const X* x, int64_t M, int64_t K, const W* w, int64_t N, const float* bias, T* y) {
  constexpr bool kWidens = std::is_same_v<W, c10::BFloat16> && std::is_same_v<X, float> &&
                           rows_per_pass<W>() < rows_per_pass<float>();
  at::parallel_for(0, (N + TILE - 1) / TILE, 2, [&](int64_t begin, int64_t end) {
    // scratch for `kblock_passes`, only where a chunk takes that path
    const bool blocks = kWidens && M > 2 * rows_per_pass<W>();
    std::vector<float> block(blocks ? TILE * KBLOCK : 0), sums(blocks ? TILE * CHUNK_ROWS : 0);
    for (int64_t c0 = 0; c0 < M; c0 += CHUNK_ROWS) {
      const int64_t c1 = std::min(M, c0 + CHUNK_ROWS);
      for (int64_t t = begin; t < end; ++t) {
        const W* wt = w + t * TILE * K;
        if constexpr (kWidens) {
          if (c1 - c0 > 2 * rows_per_pass<W>()) {
            kblock_passes(x, c0, c1, K, wt, N, bias, y, t, block.data(), sums.data());
            continue;
          }
        }
        passes_of<rows_per_pass<W>()>(c0, c1, [&](int64_t m0, int rows) {
          with_rows(rows, [&](auto r) {
            one_tile<W, X, T, decltype(r)::value>(x + m0 * K, K, wt, N, bias, y + m0 * N, t);
          });
        });
      }
    }
  });
}

#if defined(__AVX512BF16__)
// bfloat16 rows against bfloat16 weights in AMX tiles (`set_amx`), from AMX_MIN_ROWS rows on:
// there vdpbf16ps's passes reread the tile for every eight rows and fell behind the memory
// (docs/performance.md, twenty-sixth and thirty-second sessions), while one tdpbf16ps
// multiplies 16 rows by 16 columns over 32 k. The tiled layout's pair rows are B tiles as
// they lie: a tile's first 16 columns are 16 pair rows of 64 bytes at a stride of TILE pairs,
// its last 16 the same 64 bytes on. x is copied into `xb`, padded with zeros to whole tiles
// (rows to a multiple of 16, k to a multiple of AMX_K), and the weight's last partial step of
// k (K not a multiple of AMX_K) is copied into a zeroed block first, so that no tile reads
// past the tile's pairs. Each output is a float32 sum of exact products, as vdpbf16ps's,
// in another order (and with AMX's denormals flushed to zero). Up to 32 rows each B tile
// serves both row blocks and each A tile both halves of the tile's columns; from 33 rows each
// half of the columns is a pass of its own over up to four row blocks.
constexpr int64_t AMX_K = 2 * atom::amx::kRows;  // k a tile step: 16 pairs
constexpr int64_t AMX_GROUP = 4;  // row blocks of 16 a thread's tile takes at once
constexpr int64_t AMX_WS = 2 * TILE * 2;  // bytes a pair row of the tile

// The weights of step k0 of tile wt (its last partial step from `tail`), prefetched ahead of
// a pass that reads the tile from memory (kStream).
template <bool kStream>
inline const c10::BFloat16* amx_step(const c10::BFloat16* wt, const c10::BFloat16* tail, int64_t k0, int64_t Kp) {
  const c10::BFloat16* wk = k0 + AMX_K <= Kp ? wt + k0 * TILE : tail;
  if constexpr (kStream)
    for (int64_t off = 0; off < AMX_K * TILE * 2; off += 64)
      simd::prefetch_stream(reinterpret_cast<const char*>(wk) + PREFETCH_BYTES + off);
  return wk;
}

// One or two row blocks of 16 (rows of xb from its start, row stride K32) against both halves
// of tile wt: 2 x BLOCKS sums tiles, each B tile serving every block. The sums into `sums`
// (TILE floats a row). (GCC's tile intrinsics take the tile numbers as literals.)
template <int BLOCKS, bool kStream>
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_both_halves(const c10::BFloat16* xb, int64_t K32,
                                                                          int64_t Kp, const c10::BFloat16* wt,
                                                                          const c10::BFloat16* tail, float* sums) {
  static_assert(TILE == 2 * atom::amx::kRows, "a tile's columns are two AMX tiles'");
  constexpr int64_t R = atom::amx::kRows;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (BLOCKS == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k0 = 0; k0 < K32; k0 += AMX_K) {
    const c10::BFloat16* wk = amx_step<kStream>(wt, tail, k0, Kp);
    _tile_loadd(4, wk, AMX_WS);
    _tile_loadd(5, wk + R * 2, AMX_WS);
    _tile_loadd(6, xb + k0, K32 * 2);
    _tile_dpbf16ps(0, 6, 4);
    _tile_dpbf16ps(1, 6, 5);
    if constexpr (BLOCKS == 2) {
      _tile_loadd(7, xb + R * K32 + k0, K32 * 2);
      _tile_dpbf16ps(2, 7, 4);
      _tile_dpbf16ps(3, 7, 5);
    }
  }
  _tile_stored(0, sums, TILE * 4);
  _tile_stored(1, sums + R, TILE * 4);
  if constexpr (BLOCKS == 2) {
    _tile_stored(2, sums + R * TILE, TILE * 4);
    _tile_stored(3, sums + R * TILE + R, TILE * 4);
  }
}

// Three or four row blocks against one half of tile wt (its columns 16 h ..): BLOCKS sums
// tiles, one B tile serving them all. The two halves read disjoint cache lines of the tile (a
// pair row's first and second 64 bytes), so the tile is read once over both passes.
template <int BLOCKS, bool kStream>
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_one_half(const c10::BFloat16* xb, int64_t K32,
                                                                       int64_t Kp, const c10::BFloat16* wt,
                                                                       const c10::BFloat16* tail, int h,
                                                                       float* sums) {
  static_assert(BLOCKS == 3 || BLOCKS == 4);
  constexpr int64_t R = atom::amx::kRows;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  if constexpr (BLOCKS == 4) _tile_zero(3);
  for (int64_t k0 = 0; k0 < K32; k0 += AMX_K) {
    const c10::BFloat16* wk = amx_step<kStream>(wt, tail, k0, Kp) + h * R * 2;
    _tile_loadd(4, wk, AMX_WS);
    _tile_loadd(5, xb + k0, K32 * 2);
    _tile_loadd(6, xb + R * K32 + k0, K32 * 2);
    _tile_dpbf16ps(0, 5, 4);
    _tile_loadd(7, xb + 2 * R * K32 + k0, K32 * 2);
    _tile_dpbf16ps(1, 6, 4);
    if constexpr (BLOCKS == 4) _tile_loadd(5, xb + 3 * R * K32 + k0, K32 * 2);
    _tile_dpbf16ps(2, 7, 4);
    if constexpr (BLOCKS == 4) _tile_dpbf16ps(3, 5, 4);
  }
  _tile_stored(0, sums + h * R, TILE * 4);
  _tile_stored(1, sums + R * TILE + h * R, TILE * 4);
  _tile_stored(2, sums + 2 * R * TILE + h * R, TILE * 4);
  if constexpr (BLOCKS == 4) _tile_stored(3, sums + 3 * R * TILE + h * R, TILE * 4);
}

// Up to AMX_GROUP row blocks of xb against tile wt, the sums into `sums`.
template <bool kStream>
inline void amx_group(const c10::BFloat16* xb, int64_t blocks, int64_t K32, int64_t Kp, const c10::BFloat16* wt,
                      const c10::BFloat16* tail, float* sums) {
  switch (blocks) {
    case 1: return amx_both_halves<1, kStream>(xb, K32, Kp, wt, tail, sums);
    case 2: return amx_both_halves<2, kStream>(xb, K32, Kp, wt, tail, sums);
    case 3:
      amx_one_half<3, kStream>(xb, K32, Kp, wt, tail, 0, sums);
      return amx_one_half<3, false>(xb, K32, Kp, wt, tail, 1, sums);  // its lines came with the first half's
    default:
      amx_one_half<4, kStream>(xb, K32, Kp, wt, tail, 0, sums);
      return amx_one_half<4, false>(xb, K32, Kp, wt, tail, 1, sums);
  }
}

// y = x @ w.T for bfloat16 x [M, K32] (already padded: `xb`, rows a multiple of 16) and the
// tiled bfloat16 weight (Kp k in pairs).
void gemm_amx(const c10::BFloat16* xb, int64_t M, int64_t K32, int64_t Kp, const c10::BFloat16* w, int64_t N,
              const float* bias, c10::BFloat16* y) {
  constexpr int64_t R = atom::amx::kRows;
  const int64_t blocks = atom::amx::padded_rows(M) / R, rest = Kp % AMX_K;
  at::parallel_for(0, (N + TILE - 1) / TILE, 2, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[AMX_GROUP * R * TILE];
    alignas(64) c10::BFloat16 tail[AMX_K * TILE] = {};  // zeros past the weight's last pairs
    atom::amx::configure();
    for (int64_t t = begin; t < end; ++t) {
      const c10::BFloat16* wt = w + t * TILE * Kp;
      if (rest) std::memcpy(tail, wt + (Kp - rest) * TILE, rest * TILE * sizeof(c10::BFloat16));
      for (int64_t b0 = 0; b0 < blocks; b0 += AMX_GROUP) {
        const c10::BFloat16* xr = xb + b0 * R * K32;
        const int64_t n = std::min(AMX_GROUP, blocks - b0);
        // the first group streams the tile; the others read it from cache
        if (b0 == 0) amx_group<true>(xr, n, K32, Kp, wt, tail, sums);
        else amx_group<false>(xr, n, K32, Kp, wt, tail, sums);
        const int64_t m0 = b0 * R, m1 = std::min(M, m0 + n * R);
        for (int64_t m = m0; m < m1; ++m) store_sums(sums + (m - m0) * TILE, N, bias, y + m * N, t);
      }
    }
    atom::amx::release();
  });
}
#endif

}  // namespace

// Up to this many rows, Linear takes this kernel over oneDNN's packed GEMM (which rereads
// weights from memory more slowly than this kernel computes, up to about this row count;
// benchmarks/decode_profile.py --batch 32).
constexpr int64_t MAX_ROWS = 64;

// From this many rows bfloat16 rows against bfloat16 weights run in AMX tiles where they are
// on (`set_amx`; builds for AVX-512 BF16 on CPUs with AMX).
constexpr int64_t AMX_MIN_ROWS = 4;

// Whether this build's float32 passes outran oneDNN's packed float32 GEMM at every row count,
// prompts included, so that float32 weights keep only the tiled copy: with AVX2 (six rows a
// pass from cache, against oneDNN's AVX2 kernels on Zen 2), not with AVX-512, where oneDNN's
// kernels ran near the machine's GEMM rate (docs/performance.md, "float32 at every row count").
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool F32_EVERY_ROW = true;
#else
constexpr bool F32_EVERY_ROW = false;
#endif

// y = x @ w.T (+ bias) for any rows of x; w in the tiled layout: float32 and float16
// [ceil(N / TILE), K, TILE], bfloat16 [ceil(N / TILE), ceil(K / 2), TILE, 2].
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, int64_t N, const c10::optional<at::Tensor>& bias,
                const c10::optional<at::Tensor>& out) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2, "gemv takes x [M, K], got ", x.sizes());
  TORCH_CHECK(w.is_contiguous(), "gemv weight must be contiguous");
  const auto wt = w.scalar_type(), xt = x.scalar_type();
  auto floating = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; };
  TORCH_CHECK(floating(wt), "gemv weights are float32, bfloat16 or float16, not ", wt);
  TORCH_CHECK(floating(xt), "gemv activations are float32, bfloat16 or float16, not ", xt);
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + TILE - 1) / TILE;
  const bool pairs = wt == at::kBFloat16;
  const int64_t Kp = pairs ? K + K % 2 : K;
  TORCH_CHECK(N >= 1 && (pairs ? w.dim() == 4 && w.size(1) == Kp / 2 && w.size(2) == TILE && w.size(3) == 2
                               : w.dim() == 3 && w.size(1) == K && w.size(2) == TILE) && w.size(0) == tiles,
              "gemv weight must be in its tiled layout (linear.gemv_weight, tiles of ", TILE, ") for N = ", N,
              " and K = ", K, ", got ", w.sizes());
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gemv bias must have ", N, " values");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto y = atom::output(out, {M, N}, x.options(), "gemv");
  if (M == 0) return y;
  // x padded to the weight's K (a zero after an odd K: bfloat16 weights go in pairs)
  auto padded = [&](const at::Tensor& t) { return Kp == K ? t.contiguous() : at::constant_pad_nd(t, {0, Kp - K}); };
#if defined(__AVX512BF16__)
  if (wt == at::kBFloat16 && xt == at::kBFloat16 && M >= AMX_MIN_ROWS && atom::amx::on.load()) {
    const int64_t K32 = (Kp + AMX_K - 1) / AMX_K * AMX_K;
    const at::Tensor xb = at::constant_pad_nd(x, {0, K32 - K, 0, atom::amx::padded_rows(M) - M}).contiguous();
    gemm_amx(xb.data_ptr<c10::BFloat16>(), M, K32, Kp, w.data_ptr<c10::BFloat16>(), N, bp, y.data_ptr<c10::BFloat16>());
    return y;
  }
  if (wt == at::kBFloat16 && xt == at::kBFloat16) {
    const at::Tensor xc = padded(x);
    gemm_impl(xc.data_ptr<c10::BFloat16>(), M, Kp, w.data_ptr<c10::BFloat16>(), N, bp, y.data_ptr<c10::BFloat16>());
    return y;
  }
#endif
  const at::Tensor xf = padded(x.to(at::kFloat));  // widened once, not at every broadcast
  const float* xp = xf.data_ptr<float>();
  auto run = [&](auto* wp) {
    if (xt == at::kFloat) gemm_impl(xp, M, Kp, wp, N, bp, y.data_ptr<float>());
    else if (xt == at::kBFloat16) gemm_impl(xp, M, Kp, wp, N, bp, y.data_ptr<c10::BFloat16>());
    else gemm_impl(xp, M, Kp, wp, N, bp, y.data_ptr<c10::Half>());
  };
  if (wt == at::kFloat) run(w.data_ptr<float>());
  else if (wt == at::kBFloat16) run(w.data_ptr<c10::BFloat16>());
  else run(w.data_ptr<c10::Half>());
  return y;
}


// ---- 4- and 8-bit groups of 32 (GGUF Q4_0/Q4_1/Q8_0, Config.quantization int4/int8) ----------
//
// w = q * d + m per group of 32 along K, d and m in float16 (exact for GGUF's Q4_0/Q4_1/Q8_0).
// 4 bits: q in 0..15, m = zero - 8 * scale in quant.py's terms (the group minimum for Q4_1).
// 8 bits: q + 128 in 0..255, m = -128 d.
//
// Each row of x is rounded per group of 32 to integers, x = dx qx with dx = max|x| / 32767
// (act_bits 16: about 16 significant bits) or max|x| / 127 (act_bits 8, 4-bit weights only:
// what llama.cpp's Q8_1 vectors and OpenVINO's dynamic quantization keep). The group then
// adds d dx sum(q qx) + m sum(x) to each column's float sum: one conversion and two fused
// multiply-adds, sum(x) the float32 sum of the group's own values.
//
// The weight is packed in tiles of 16 output columns (quant.py's `StreamingGroupGemm`): for
// each tile and group, 16 vectors W_p (p = 0..15), lane c of W_p holding column c's two
// values at k = 2p, 2p + 1 as int16 pairs. 4 bits: a tile-group is 256 bytes, 64 for each
// W_4j .. W_4j+3, whose values at lane i sit in the four nibbles of int16 i (one and or
// shift a vector to unpack). 8 bits: 512 bytes, W_p's 32 bytes in order.
//
// act_bits 16: one vpdpwssd (AVX-512 VNNI, or AVX-VNNI on AVX2 CPUs that have it; elsewhere
// vpmaddwd and an add, the same exact integers) of W_p against the broadcast pair
// (x_2p, x_2p+1) adds 32 products into the 16 columns' int32 sums: 16 of them a group and row.
// act_bits 8: the same 64 bytes j read as bytes give two vectors of four 4-bit values a
// column, the low nibbles (k = 8j + 0, 4, 1, 5) and the high ones (8j + 2, 6, 3, 7); x's
// int8 values are stored in that order (`quad_k`), so one vpdpbusd (u8 weights times s8
// x) adds 64 products: 8 a group and row, half the instructions. Without VNNI, vpmaddubsw
// sums pairs into int16 (at most 2 * 15 * 127) and a group's eight such sums, at most
// 30480, stay in int16 until one vpmaddwd by 1 widens them: exact integers either way.
//
// With AVX2 a vector is two 8-lane halves. No horizontal reductions, and each unpacked
// vector serves up to QROWS rows of x. The portable build runs the same sums in scalar code.
//
// Every output is computed by the same instructions in the same order whatever the number
// of rows M and wherever the row sits in the batch (integer sums are exact, the float ones
// go group by group): the kernel is batch-invariant, which is what speculative decoding's
// verify step needs.

namespace {

constexpr int64_t PREFETCH_GROUPS = 32;  // how far ahead in a tile's stream (8 KiB at 4 bits)
constexpr int QCOLS = 16;  // output columns per tile: the layout, whatever the vector width

#if defined(__AVX512F__) || defined(__AVX2__)
constexpr int QROWS = simd::kRegisters == 32 ? 8 : 4;  // rows of x each unpacked weight vector serves
#else
constexpr int QROWS = 1;
#endif

// The k (0..31) of byte b of int32 word w in an int8 group: the order in which a 4-bit
// tile-group's bytes hold the weights (word 2j: the low nibbles of its 64 bytes j, 2j + 1:
// the high ones; byte b of a column's lane: int16 b / 2, nibbles 2 (b % 2) and 2 (b % 2) + 1).
constexpr int quad_k(int w, int b) { return 8 * (w / 2) + 2 * (2 * (b % 2) + w % 2) + b / 2; }
// Its inverse: where k's value sits among a group's 32 bytes (4 w + b).
constexpr int quad_byte(int k) { return 4 * (2 * (k / 8) + (k % 8) / 2 % 2) + 2 * (k % 2) + (k % 8) / 4; }
constexpr bool quad_byte_inverts_quad_k() {
  for (int k = 0; k < 32; ++k)
    if (quad_k(quad_byte(k) / 4, quad_byte(k) % 4) != k) return false;
  return true;
}
static_assert(quad_byte_inverts_quad_k());

// x as ABITS-bit integers per group of 32, with dx and the float32 sum of each group. A
// group is WORDS int32 words: int16 pairs (k = 2p, 2p + 1) or int8 quads (`quad_k`). Rows
// are interleaved in blocks of RB (QROWS), so that the rows a pass takes are one pointer
// with constant offsets (a pointer per row ran out of general registers and spilled). One
// or two rows (a batch-1 or -2 step) are blocks of their own (RB 1, 2): in a block of 8 a
// row's words lay 32 bytes apart, and a pass read eight times the cache lines it needed,
// which the weight stream kept evicting from L1 (and a second thread took from the first's
// cache).
template <int ABITS, int RB = QROWS>
struct QRows {
  static constexpr int BITS = ABITS, ROWS = RB;
  static constexpr int WORDS = ABITS == 16 ? 16 : 8;
  static constexpr float LIMIT = ABITS == 16 ? 32767.f : 127.f;
  std::vector<int32_t> q;  // see word()
  std::vector<float> scale, sum;  // see group()
  int64_t words = 0, groups = 0;  // per row
  int64_t word(int64_t m, int64_t w) const { return ((m / RB) * words + w) * RB + m % RB; }
  int64_t group(int64_t m, int64_t g) const { return ((m / RB) * groups + g) * RB + m % RB; }
  // word w of a group from its rounded values r[0..31]
  static int32_t pack(const int32_t* r, int w) {
    if constexpr (ABITS == 16) return static_cast<int32_t>((static_cast<uint32_t>(r[2 * w]) & 0xFFFFu) |
                                                           (static_cast<uint32_t>(r[2 * w + 1]) << 16));
    uint32_t v = 0;
    for (int b = 0; b < 4; ++b) v |= (static_cast<uint32_t>(r[quad_k(w, b)]) & 0xFFu) << (8 * b);
    return static_cast<int32_t>(v);
  }
};

// One group of 32 values: r = round(x / dx) (to nearest even, as the vector conversions),
// dx = max|x| / limit, and the group's sum.
template <typename T>
inline void round_group(const T* x, float limit, int32_t* r, float& scale, float& sum) {
  using simd::vf;
  constexpr int V = 32 / L;  // vectors per group
  vf v[V];
  vf amax = simd::zero(), total = simd::zero();
  UNROLL for (int i = 0; i < V; ++i) {
    v[i] = simd::load(x + i * L);
    amax = simd::max(amax, simd::abs(v[i]));
    total = simd::add(total, v[i]);
  }
  const float top = simd::reduce_max(amax);
  const float inv = top > 0.f ? limit / top : 0.f;
#if defined(__AVX512F__)
  UNROLL for (int i = 0; i < V; ++i)
    _mm512_storeu_si512(r + i * L, _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv))));
#elif defined(__AVX2__)
  UNROLL for (int i = 0; i < V; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + i * L), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv))));
#else
  for (int i = 0; i < 32; ++i) r[i] = static_cast<int32_t>(std::nearbyint(to_float(x[i]) * inv));
#endif
  scale = top / limit;
  sum = simd::reduce_add(total);
}

// A group's WORDS words from its rounded values r[0..31] (64-byte aligned): `QRows::pack`
// in vector code, the same bits. int16: r narrowed in order. int8: narrowed, then each
// 8-byte run's bytes put in `quad_k` order (k = 0, 4, 1, 5, 2, 6, 3, 7 within the run).
template <int ABITS>
inline void pack_group(const int32_t* r, int32_t* words) {
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
  const __m512i r0 = _mm512_load_si512(r), r1 = _mm512_load_si512(r + 16);
  if constexpr (ABITS == 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words), _mm512_cvtepi32_epi16(r0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + 8), _mm512_cvtepi32_epi16(r1));
    return;
  }
  const __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(r0)),
                                                _mm512_cvtepi32_epi8(r1), 1);
#else  // AVX2's packs work per 128-bit lane: a permute puts the runs back in order
  const auto* rv = reinterpret_cast<const __m256i*>(r);
  const __m256i p01 = _mm256_packs_epi32(_mm256_load_si256(rv), _mm256_load_si256(rv + 1));
  const __m256i p23 = _mm256_packs_epi32(_mm256_load_si256(rv + 2), _mm256_load_si256(rv + 3));
  if constexpr (ABITS == 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words), _mm256_permute4x64_epi64(p01, 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + 8), _mm256_permute4x64_epi64(p23, 0xD8));
    return;
  }
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#endif
  const __m256i order = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                         0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words), _mm256_shuffle_epi8(bytes, order));
#else
  for (int w = 0; w < QRows<ABITS>::WORDS; ++w) words[w] = QRows<ABITS>::pack(r, w);
#endif
}

template <int ABITS, int RB, typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, QRows<ABITS, RB>& out) {
  constexpr int W = QRows<ABITS, RB>::WORDS;
  const int64_t padded = (M + RB - 1) / RB * RB;
  out.groups = K / 32;
  out.words = out.groups * W;
  out.q.resize(padded * out.words);
  out.scale.resize(padded * out.groups);
  out.sum.resize(padded * out.groups);
  // Groups are independent: a prefill's worth (512 x 1536 values) is split over the threads.
  // A decode step's few rows are not: waking the other threads cost more than quantizing
  // them (8 rows of 1536: 3 us on one thread, 15-20 us split over two).
  at::parallel_for(0, M * out.groups, 1024, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t r[32];
    int32_t words[W];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / out.groups, g = i % out.groups;
      round_group(x + i * 32, QRows<ABITS, RB>::LIMIT, r, out.scale[out.group(m, g)], out.sum[out.group(m, g)]);
      pack_group<ABITS>(r, words);
      int32_t* dst = out.q.data() + out.word(m, W * g);
      for (int w = 0; w < W; ++w) dst[w * RB] = words[w];
    }
  });
}

#if defined(__AVX512F__) || defined(__AVX2__)

// The int32 vectors that hold a tile's 16 columns: one (AVX-512) or two (AVX2), each vector's
// lane c a column, its int16 pair the column's values at k = 2p, 2p + 1.
#if defined(__AVX512F__)
using vi = __m512i;
constexpr int kColVecs = 1;
inline vi vi_zero() { return _mm512_setzero_si512(); }
inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
inline vf vi_to_float(vi v) { return _mm512_cvtepi32_ps(v); }
// acc + the pairwise products of w and x's int16 pairs: exact integers
inline vi dot_pairs(vi acc, vi w, vi x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else  // as the AVX2 path below: the empty asm keeps each sum in its chain
  vi sum = _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
  asm("" : "+v"(sum));
  return sum;
#endif
}
#if defined(__AVX512VNNI__)
#define QGEMM_DOT_QUADS 1
// acc + the products of w's u8 and x's s8 quads, four a lane: exact integers
inline vi dot_quads(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, w, x); }
#endif
// int16 lanes: the pair sums of w's u8 times x's s8 bytes, added to acc (no VNNI)
inline vi madd_bytes(vi acc, vi w, vi x) {
  vi sum = _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x));
  asm("" : "+v"(sum));
  return sum;
}
inline vi widen_pairs(vi s) { return _mm512_madd_epi16(s, _mm512_set1_epi16(1)); }
inline vi load_vi(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vi widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vi and_vi(vi a, int16_t m) { return _mm512_and_si512(a, _mm512_set1_epi16(m)); }
template <int S>
inline vi srli16(vi a) { return _mm512_srli_epi16(a, S); }
#else
using vi = __m256i;
constexpr int kColVecs = 2;
inline vi vi_zero() { return _mm256_setzero_si256(); }
inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi vi_set1(int32_t v) { return _mm256_set1_epi32(v); }
inline vf vi_to_float(vi v) { return _mm256_cvtepi32_ps(v); }
// The empty asm keeps each sum where it is in its chain: integer adds reassociate, and GCC
// otherwise computes a whole group's products first and spills them all to add them up.
inline vi dot_pairs(vi acc, vi w, vi x) {
#if defined(__AVXVNNI__)  // AVX-VNNI (Intel since Alder Lake): the same integers in one instruction
  return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
  vi sum = _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
  asm("" : "+x"(sum));
  return sum;
#endif
}
#if defined(__AVXVNNI__)
#define QGEMM_DOT_QUADS 1
inline vi dot_quads(vi acc, vi w, vi x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#endif
inline vi madd_bytes(vi acc, vi w, vi x) {
  vi sum = _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x));
  asm("" : "+x"(sum));
  return sum;
}
inline vi widen_pairs(vi s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }
inline vi load_vi(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi and_vi(vi a, int16_t m) { return _mm256_and_si256(a, _mm256_set1_epi16(m)); }
template <int S>
inline vi srli16(vi a) { return _mm256_srli_epi16(a, S); }
#endif

// Tiles a pass takes side by side (NT). With 32 registers two, from STREAM_ROWS rows on:
// every broadcast x word then serves both tiles' weight vectors, half the broadcasts and
// chain sums a product, which (not the multipliers) had set the pace at 8 and more rows.
// At fewer rows the weights stream from memory, and one stream a thread read faster than two.
// With 16 registers one.
constexpr int kPassTiles = simd::kRegisters == 32 ? 2 : 1;
constexpr int64_t STREAM_ROWS = 3;

// Chains of integer sums a row and vector (NV of them): exact, so how they are split is free.
// Enough sums in flight that vpdpwssd's latency (not the weight stream) does not set the
// pace: a 1-row LM head once ran slower than a 2-row one.
template <int MB, int NV>
constexpr int kChains = NV == 1 ? (MB == 1 ? 4 : 2) : (MB == 1 || (simd::kRegisters == 32 && MB < 4) ? 2 : 1);

// Where vector v's 64-byte block j of a pass's tile-groups starts: vector v is tile
// v / kColVecs, part v % kColVecs of its 16 columns.
template <int NT>
inline const uint8_t* vec_block(const uint8_t* const (&tg)[NT], int v, int j) {
  return tg[v / kColVecs] + j * 64 + (v % kColVecs) * (64 / kColVecs);
}

// W_4j .. W_4j+3 of vector v of a pass's tile-groups.
template <int BITS, int NT>
inline void load_w(const uint8_t* const (&tg)[NT], int j, int v, vi (&w)[4]) {
  if constexpr (BITS == 4) {  // int16 lane i: the four vectors' values in its four nibbles
    const vi x = load_vi(vec_block(tg, v, j));
    w[0] = and_vi(x, 0x0F);
    w[1] = and_vi(srli16<4>(x), 0x0F);
    w[2] = and_vi(srli16<8>(x), 0x0F);
    w[3] = srli16<12>(x);
  } else {
    UNROLL for (int h = 0; h < 4; ++h) w[h] = widen_u8(tg[v / kColVecs] + (4 * j + h) * 32 + (v % kColVecs) * (32 / kColVecs));
  }
}

// W_p of vector v of a pass's tile-groups (one vector at a time: the 16-register path).
template <int BITS, int NT>
inline vi weight_vector(const uint8_t* const (&tg)[NT], int p, int v) {
  if constexpr (BITS == 4) {
    const vi x = load_vi(vec_block(tg, v, p / 4));
    switch (p % 4) {
      case 0: return and_vi(x, 0x0F);
      case 1: return and_vi(srli16<4>(x), 0x0F);
      case 2: return and_vi(srli16<8>(x), 0x0F);
      default: return srli16<12>(x);
    }
  } else {
    return widen_u8(tg[v / kColVecs] + p * 32 + (v % kColVecs) * (32 / kColVecs));
  }
}

// The integer sums of one group of a pass's tiles for rows m0 .. m0 + MB: total[m][v] = sum
// over k of q qx, a column a lane of vector v. xq: the group's words, row m's word w at
// xq[w * RB + m].
template <int MB, int NT, int BITS, int RB>
inline void group_sums(const uint8_t* const (&tg)[NT], const int32_t* xq, vi (&total)[MB][NT * kColVecs],
                       std::integral_constant<int, 16>) {
  constexpr int NV = NT * kColVecs, CH = kChains<MB, NV>;
  vi sums[MB][NV][CH];
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int v = 0; v < NV; ++v)
      UNROLL for (int h = 0; h < CH; ++h) sums[m][v][h] = vi_zero();
  if constexpr (simd::kRegisters == 32) {  // four weight vectors a column vector unpacked at once, each serving every row
    UNROLL for (int j = 0; j < 4; ++j) {
      vi w[NV][4];
      UNROLL for (int v = 0; v < NV; ++v) load_w<BITS, NT>(tg, j, v, w[v]);
      UNROLL for (int m = 0; m < MB; ++m) {
        UNROLL for (int h = 0; h < 4; ++h) {
          const vi xb = vi_set1(xq[(4 * j + h) * RB + m]);
          UNROLL for (int v = 0; v < NV; ++v) sums[m][v][h % CH] = dot_pairs(sums[m][v][h % CH], w[v][h], xb);
        }
      }
    }
  } else {
    // One weight vector (both halves) at a time against every row: with 16 registers,
    // unpacking four at once and broadcasting each x pair for both halves spilled them all.
    UNROLL for (int p = 0; p < 16; ++p) {
      vi w[NV];
      UNROLL for (int v = 0; v < NV; ++v) w[v] = weight_vector<BITS, NT>(tg, p, v);
      UNROLL for (int m = 0; m < MB; ++m) {
        const vi xb = vi_set1(xq[p * RB + m]);
        UNROLL for (int v = 0; v < NV; ++v) sums[m][v][p % CH] = dot_pairs(sums[m][v][p % CH], w[v], xb);
      }
    }
  }
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int v = 0; v < NV; ++v) {
      total[m][v] = sums[m][v][0];
      UNROLL for (int h = 1; h < CH; ++h) total[m][v] = vi_add(total[m][v], sums[m][v][h]);
    }
}

template <int MB, int NT, int BITS, int RB>
inline void group_sums(const uint8_t* const (&tg)[NT], const int32_t* xq, vi (&total)[MB][NT * kColVecs],
                       std::integral_constant<int, 8>) {
  static_assert(BITS == 4, "int8 activations take 4-bit weights");
  constexpr int NV = NT * kColVecs;
#if defined(QGEMM_DOT_QUADS)  // AVX-512 VNNI or AVX-VNNI
  constexpr int CH = kChains<MB, NV>;
  vi sums[MB][NV][CH];
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int v = 0; v < NV; ++v)
      UNROLL for (int h = 0; h < CH; ++h) sums[m][v][h] = vi_zero();
  UNROLL for (int j = 0; j < 4; ++j) {
    vi lo[NV], hi[NV];
    UNROLL for (int v = 0; v < NV; ++v) {
      const vi x = load_vi(vec_block(tg, v, j));
      lo[v] = and_vi(x, 0x0F0F);
      hi[v] = and_vi(srli16<4>(x), 0x0F0F);
    }
    UNROLL for (int m = 0; m < MB; ++m) {
      const vi xa = vi_set1(xq[2 * j * RB + m]), xb = vi_set1(xq[(2 * j + 1) * RB + m]);
      UNROLL for (int v = 0; v < NV; ++v) {
        sums[m][v][(2 * j) % CH] = dot_quads(sums[m][v][(2 * j) % CH], lo[v], xa);
        sums[m][v][(2 * j + 1) % CH] = dot_quads(sums[m][v][(2 * j + 1) % CH], hi[v], xb);
      }
    }
  }
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int v = 0; v < NV; ++v) {
      total[m][v] = sums[m][v][0];
      UNROLL for (int h = 1; h < CH; ++h) total[m][v] = vi_add(total[m][v], sums[m][v][h]);
    }
#else
  // Each row's pair of x words broadcast once and used against every vector's nibbles.
  vi s16[MB][NV];
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int v = 0; v < NV; ++v) s16[m][v] = vi_zero();
  UNROLL for (int j = 0; j < 4; ++j) {
    vi lo[NV], hi[NV];
    UNROLL for (int v = 0; v < NV; ++v) {
      const vi x = load_vi(vec_block(tg, v, j));
      lo[v] = and_vi(x, 0x0F0F);
      hi[v] = and_vi(srli16<4>(x), 0x0F0F);
    }
    UNROLL for (int m = 0; m < MB; ++m) {
      const vi xa = vi_set1(xq[2 * j * RB + m]), xb = vi_set1(xq[(2 * j + 1) * RB + m]);
      UNROLL for (int v = 0; v < NV; ++v) s16[m][v] = madd_bytes(madd_bytes(s16[m][v], lo[v], xa), hi[v], xb);
    }
  }
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int v = 0; v < NV; ++v) total[m][v] = widen_pairs(s16[m][v]);
#endif
}

// One pass: columns [16 t, 16 t + 16) of each tile t of `tiles` (NT of them, the
// tile's weight at wt + t * tile_bytes, its scales and mins at dt and mt + t * K / 2), rows
// m0 .. m0 + MB of x; cols[t] columns of tile t are written (0: none). Each column gets the
// same float operations in the same order as in any other pass or row count.
template <int MB, int NT, int BITS, typename XS, typename T>
void qgemm_tile(const XS& xs, int64_t m0, int64_t K, const uint8_t* wt, const c10::Half* dt,
                const c10::Half* mt, const float* bias, T* y, int64_t N, const int64_t (&tiles)[NT],
                int64_t tile_bytes, const int (&cols)[NT]) {
  constexpr int64_t GROUP_BYTES = BITS * 64;  // 16 columns x 32 values
  constexpr int W = XS::WORDS, NV = NT * kColVecs;
  const int64_t groups = K / 32;
  const uint8_t* base[NT];
  const c10::Half *dbase[NT], *mbase[NT];
  UNROLL for (int t = 0; t < NT; ++t) {
    base[t] = wt + tiles[t] * tile_bytes;
    dbase[t] = dt + tiles[t] * groups * QCOLS;
    mbase[t] = mt + tiles[t] * groups * QCOLS;
  }
  vf acc[MB][NV];
  UNROLL for (int m = 0; m < MB; ++m)
    UNROLL for (int v = 0; v < NV; ++v) acc[m][v] = simd::zero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* tg[NT];
    UNROLL for (int t = 0; t < NT; ++t) {
      tg[t] = base[t] + g * GROUP_BYTES;
      if (m0 > 0) continue;  // the first rows' pass brought the tiles in
      // A few groups ahead in each tile's stream; past its end, in the tile the next pass
      // reads in its place (the tile after it is this pass's other one).
      const int64_t ahead = g + PREFETCH_GROUPS / NT, skip = ahead >= groups ? NT - 1 : 0;
      const uint8_t* wnext = base[t] + ahead * GROUP_BYTES + skip * tile_bytes;
      for (int64_t off = 0; off < GROUP_BYTES; off += 64) simd::prefetch_stream(wnext + off);
      simd::prefetch_l2(dbase[t] + ahead * QCOLS + skip * groups * QCOLS);
      simd::prefetch_l2(mbase[t] + ahead * QCOLS + skip * groups * QCOLS);
    }
    vi total[MB][NV];
    group_sums<MB, NT, BITS, XS::ROWS>(tg, xs.q.data() + xs.word(m0, W * g), total,
                                       std::integral_constant<int, XS::BITS>{});
    UNROLL for (int v = 0; v < NV; ++v) {
      const int t = v / kColVecs, c = v % kColVecs;
      const vf dv = simd::load(dbase[t] + g * QCOLS + c * L), mv = simd::load(mbase[t] + g * QCOLS + c * L);
      UNROLL for (int m = 0; m < MB; ++m) {
        const int64_t xg = xs.group(m0, g) + m;
        acc[m][v] = simd::fmadd(vi_to_float(total[m][v]), simd::mul(dv, simd::set1(xs.scale[xg])), acc[m][v]);
        acc[m][v] = simd::fmadd(mv, simd::set1(xs.sum[xg]), acc[m][v]);
      }
    }
  }
  UNROLL for (int m = 0; m < MB; ++m) {
    T* row = y + (m0 + m) * N;
    if constexpr (std::is_same_v<T, float>) {
      // Whole float32 tiles as vectors: a prompt's rows write lines not in cache, and a
      // store a value filled the store buffer while they came.
      bool whole = true;
      UNROLL for (int t = 0; t < NT; ++t) whole = whole && (cols[t] == QCOLS || cols[t] == 0);
      if (whole) {
        UNROLL for (int v = 0; v < NV; ++v) {
          const int t = v / kColVecs;
          if (cols[t] == 0) continue;
          const int64_t n = tiles[t] * QCOLS + (v % kColVecs) * L;
          simd::store(row + n, bias ? simd::add(acc[m][v], simd::load(bias + n)) : acc[m][v]);
        }
        continue;
      }
    }
    alignas(64) float out[NT * QCOLS];
    UNROLL for (int v = 0; v < NV; ++v) simd::store(out + v * L, acc[m][v]);
    UNROLL for (int t = 0; t < NT; ++t) {
      const int64_t n0 = tiles[t] * QCOLS;
      for (int c = 0; c < cols[t]; ++c) row[n0 + c] = from_float<T>(out[t * QCOLS + c] + (bias ? bias[n0 + c] : 0.f));
    }
  }
}

// A pass over `rows` (1 .. MB) rows: qgemm_tile built for exactly that many.
template <int MB, int NT, int BITS, typename XS, typename T>
void qgemm_rows(int rows, const XS& xs, int64_t m0, int64_t K, const uint8_t* wt, const c10::Half* dt,
                const c10::Half* mt, const float* bias, T* y, int64_t N, const int64_t (&tiles)[NT],
                int64_t tile_bytes, const int (&cols)[NT]) {
  if constexpr (MB > 1)
    if (rows < MB) return qgemm_rows<MB - 1, NT, BITS>(rows, xs, m0, K, wt, dt, mt, bias, y, N, tiles, tile_bytes, cols);
  qgemm_tile<MB, NT, BITS>(xs, m0, K, wt, dt, mt, bias, y, N, tiles, tile_bytes, cols);
}

// A pass over MB rows, at most the rows XS interleaves (one-tile passes: fewer than STREAM_ROWS).
template <int NT, int BITS, typename XS, typename T>
void qgemm_block(int MB, const XS& xs, int64_t m0, int64_t K, const uint8_t* wt, const c10::Half* dt,
                 const c10::Half* mt, const float* bias, T* y, int64_t N, const int64_t (&tiles)[NT],
                 int64_t tile_bytes, const int (&cols)[NT]) {
  constexpr int most = NT < kPassTiles ? std::min<int>(XS::ROWS, STREAM_ROWS - 1) : XS::ROWS;
  qgemm_rows<most, NT, BITS>(MB, xs, m0, K, wt, dt, mt, bias, y, N, tiles, tile_bytes, cols);
}

#else  // portable: the same sums in scalar code

// Column col's value at k (0..31) of a tile-group, as the vector code unpacks it.
template <int BITS>
inline int32_t weight_at(const uint8_t* tg, int col, int k) {
  const int p = k / 2, lane = 2 * col + k % 2;  // int16 lane of W_p
  if constexpr (BITS == 4) {
    uint16_t v;
    std::memcpy(&v, tg + (p / 4) * 64 + lane * 2, 2);
    return (v >> (4 * (p % 4))) & 0x0F;
  } else {
    return tg[p * 32 + lane];
  }
}

// Row m's rounded value at k (0..31) of group g (QROWS is 1: a row's words are in order).
template <typename XS>
inline int32_t x_at(const XS& xs, int64_t m, int64_t g, int k) {
  const int32_t* words = xs.q.data() + xs.word(m, XS::WORDS * g);
  if constexpr (XS::BITS == 16) return reinterpret_cast<const int16_t*>(words)[k];
  return reinterpret_cast<const int8_t*>(words)[quad_byte(k)];
}

constexpr int kPassTiles = 1;
constexpr int64_t STREAM_ROWS = 0;

template <int NT, int BITS, typename XS, typename T>
void qgemm_block(int, const XS& xs, int64_t m, int64_t K, const uint8_t* wt, const c10::Half* dt,
                 const c10::Half* mt, const float* bias, T* y, int64_t N, const int64_t (&tiles)[1], int64_t tile_bytes,
                 const int (&cols)[1]) {
  const int64_t groups = K / 32, n0 = tiles[0] * QCOLS;
  wt += tiles[0] * tile_bytes;
  dt += tiles[0] * groups * QCOLS;
  mt += tiles[0] * groups * QCOLS;
  for (int c = 0; c < cols[0]; ++c) {
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* tg = wt + g * BITS * 64;
      int32_t sum = 0;
      for (int k = 0; k < 32; ++k) sum += weight_at<BITS>(tg, c, k) * x_at(xs, m, g, k);
      const int64_t xg = xs.group(m, g);
      acc += static_cast<float>(sum) * (to_float(dt[g * QCOLS + c]) * xs.scale[xg]);
      acc += to_float(mt[g * QCOLS + c]) * xs.sum[xg];
    }
    y[m * N + n0 + c] = from_float<T>(acc + (bias ? bias[n0 + c] : 0.f));
  }
}

#endif

}  // namespace

// The arguments qgemm and qgemm_dense share, checked by name: x [M, K] on CPU, the packed
// weight and its float16 scales and mins for N columns. Returns the weight's bits.
int check_group_args(const char* name, const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d,
                     const at::Tensor& mn, int64_t N) {
  const auto xt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf),
              name, " takes x [M, K], float32, bfloat16 or float16, on CPU");
  const int64_t K = x.size(1), groups = K / 32, tiles = (N + 15) / 16;
  TORCH_CHECK(K % 32 == 0 && K > 0, name, " takes K a multiple of 32, got ", K);
  TORCH_CHECK(qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.dim() == 3 && qw.size(0) == tiles &&
                  qw.size(1) == groups && (qw.size(2) == 256 || qw.size(2) == 512),
              name, " weight must be uint8 [ceil(N / 16), K / 32, 256 (4 bits) or 512 (8 bits)]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && mn.scalar_type() == at::kHalf && d.is_contiguous() && mn.is_contiguous() &&
                  d.numel() == tiles * groups * 16 && mn.numel() == tiles * groups * 16,
              name, " scales and mins must be float16 [ceil(N / 16), K / 32, 16]");
  return qw.size(2) == 256 ? 4 : 8;
}

// A bias of N values as float32 (undefined where none is given).
at::Tensor float_bias(const char* name, const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == N, name, " bias must have N = ", N, " values, got ", bias->numel());
  return bias->to(at::kFloat).contiguous();
}

at::Tensor qgemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& mn, int64_t N,
                 const c10::optional<at::Tensor>& bias, int64_t act_bits, const c10::optional<at::Tensor>& out) {
  const auto xt = x.scalar_type();
  const int64_t M = x.size(0), K = x.size(1), groups = K / 32, tiles = (N + 15) / 16;
  const int bits = check_group_args("qgemm", x, qw, d, mn, N);
  TORCH_CHECK(act_bits == 16 || (act_bits == 8 && bits == 4),
              "qgemm act_bits must be 16, or 8 with 4-bit weights; got act_bits ", act_bits, " with ", bits, "-bit weights");
  const at::Tensor xc = x.contiguous();
  auto y = atom::output(out, {M, N}, x.options(), "qgemm");
  if (M == 0 || N == 0) return y;
  const at::Tensor bf = float_bias("qgemm", bias, N);
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const uint8_t* qp = qw.data_ptr<uint8_t>();
  const c10::Half* dp = d.data_ptr<c10::Half>();
  const c10::Half* mp = mn.data_ptr<c10::Half>();
  auto run = [&](auto bits_tag, const auto& xs, auto* yp) {
    constexpr int B = decltype(bits_tag)::value, RB = std::decay_t<decltype(xs)>::ROWS;
    const int64_t tile_bytes = groups * B * 64;
    auto passes = [&](auto tiles_tag, int64_t begin, int64_t end) {
      constexpr int NT = decltype(tiles_tag)::value;
      for (int64_t t = begin; t < end; t += NT) {
        // A pass's tiles; past `end` the last one again, its columns not written.
        int64_t pass[NT];
        int cols[NT];
        for (int i = 0; i < NT; ++i) {
          pass[i] = std::min(t + i, end - 1);
          cols[i] = t + i < end ? static_cast<int>(std::min<int64_t>(16, N - (t + i) * 16)) : 0;
        }
        for (int64_t m0 = 0; m0 < M; m0 += RB)  // past RB rows the tiles come from cache
          qgemm_block<NT, B>(static_cast<int>(std::min<int64_t>(RB, M - m0)), xs, m0, K, qp, dp, mp, bp, yp, N, pass,
                             tile_bytes, cols);
      }
    };
    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
      if (M < STREAM_ROWS) passes(std::integral_constant<int, 1>{}, begin, end);
      else passes(std::integral_constant<int, kPassTiles>{}, begin, end);
    });
  };
  // x rounded as QRows<act_bits, RB> (one or two rows alone, more in blocks of QROWS), then
  // the passes
  auto with_rows = [&](auto xs, const auto* xp, auto* yp) {
    quantize_rows(xp, M, K, xs);
    if (bits == 4) run(std::integral_constant<int, 4>{}, xs, yp);
    else if constexpr (decltype(xs)::BITS == 16) run(std::integral_constant<int, 8>{}, xs, yp);
  };
  auto with_bits = [&](auto abits, const auto* xp, auto* yp) {
    constexpr int A = decltype(abits)::value;
    if (M == 1) return with_rows(QRows<A, 1>{}, xp, yp);
    if constexpr (QROWS > 2)
      if (M == 2) return with_rows(QRows<A, 2>{}, xp, yp);
    with_rows(QRows<A>{}, xp, yp);
  };
  auto with_x = [&](const auto* xp, auto* yp) {
    if (act_bits == 8) with_bits(std::integral_constant<int, 8>{}, xp, yp);
    else with_bits(std::integral_constant<int, 16>{}, xp, yp);
  };
  if (xt == at::kFloat) with_x(xc.data_ptr<float>(), y.data_ptr<float>());
  else if (xt == at::kBFloat16) with_x(xc.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>());
  else with_x(xc.data_ptr<c10::Half>(), y.data_ptr<c10::Half>());
  return y;
}

// ---- 4-bit groups against 8-bit activations at prompt sizes: the weight widened, AMX ----
//
// On CPUs that multiply bfloat16 matrices in hardware (AMX), a prompt's rows at act_bits 8
// run faster through oneDNN's batch-reduce micro-kernel (`cpublas::brgemm`, as moe_cpu.cpp
// calls it; float32 sums) on the weight widened to bfloat16 than through the integer dot
// products above, although every call widens the weight again: a thread widens each panel of
// DENSE_PANEL output columns it meets (w = q * d + m in float32, exact, then rounded) into
// bfloat16 VNNI pairs that stay in L2, and runs the micro-kernel over its blocks of rows.
// x and w each round to bfloat16, 8 significant bits relative to each value: no coarser than
// x rounded per group of 32 to int8 (relative to the group's largest), which it stands in
// for. (At act_bits 16, keeping 16 bits a factor takes three such products, which on the
// AMX host measured no faster than qgemm: docs/performance.md.) Not batch-invariant against
// qgemm: Linear sends it only a prompt's many rows.

namespace {

constexpr int64_t DENSE_PANEL = 64;      // output columns a panel: four tiles
constexpr int64_t DENSE_ROW_BLOCK = 32;  // rows a micro-kernel call

inline uint32_t bf16_pair(float w0, float w1) {
  return from_float<c10::BFloat16>(w0).x | static_cast<uint32_t>(from_float<c10::BFloat16>(w1).x) << 16;
}

// Panel `panel` (columns DENSE_PANEL * panel ..) of a 4-bit weight as bfloat16 VNNI pairs,
// pairs[p * DENSE_PANEL + n] = column n's (k = 2p, 2p + 1), columns past the tiles zero. The
// packing's 32-bit lane c of W_4j..4j+3 holds column c's k = 8j + 2h + i in nibble h of
// half i: a pair is one lane's two halves, so each pair row is one 16-lane pass (vectorised).
void widen_panel(const uint8_t* qp, const c10::Half* dp, const c10::Half* mp, int64_t tiles, int64_t groups,
                 int64_t panel, uint32_t* pairs) {
  constexpr int64_t per_panel = DENSE_PANEL / QCOLS;
  for (int64_t u = 0; u < per_panel; ++u) {
    const int64_t t = panel * per_panel + u;
    for (int64_t g = 0; g < groups; ++g) {
      uint32_t* out = pairs + g * 16 * DENSE_PANEL + u * QCOLS;  // pair row 16 g, column 16 u
      if (t >= tiles) {
        for (int p = 0; p < 16; ++p) std::fill_n(out + p * DENSE_PANEL, QCOLS, 0u);
        continue;
      }
      const int64_t tg = t * groups + g;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      static_assert(QCOLS == 16, "a tile's columns are one vector's lanes");
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dp + tg * QCOLS)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mp + tg * QCOLS)));
      const __m512i nibble = _mm512_set1_epi32(15);
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(qp + tg * 256 + j * 64);
        for (int h = 0; h < 4; ++h) {  // pair row p = 4 j + h; q * d is exact, so fma rounds as q * d + m
          const __m512i word = _mm512_srli_epi32(v, 4 * h);
          const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(word, nibble)), s, m);
          const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(word, 16), nibble)), s, m);
          _mm512_storeu_si512(out + (4 * j + h) * DENSE_PANEL,
                              _mm512_or_si512(bf16_bits(w0), _mm512_slli_epi32(bf16_bits(w1), 16)));
        }
      }
#else
      float s[QCOLS], m[QCOLS];
      for (int c = 0; c < QCOLS; ++c) {
        s[c] = to_float(dp[tg * QCOLS + c]);
        m[c] = to_float(mp[tg * QCOLS + c]);
      }
      uint32_t v[4][QCOLS];
      std::memcpy(v, qp + tg * 256, sizeof v);
      for (int p = 0; p < 16; ++p)
        for (int c = 0; c < QCOLS; ++c) {
          const uint32_t word = v[p / 4][c] >> (4 * (p % 4));
          out[p * DENSE_PANEL + c] = bf16_pair(static_cast<float>(word & 15u) * s[c] + m[c],
                                               static_cast<float>((word >> 16) & 15u) * s[c] + m[c]);
        }
#endif
    }
  }
}

// y[r, j] = c[r, j] + bias[j] for a micro-kernel call's mb x cols block, in y's dtype (rows of ldy).
template <typename T>
void dense_epilogue(const float* c, const float* bias, int64_t mb, int64_t cols, T* y, int64_t ldy) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (int64_t j = 0; j < cols; j += 16) {
    const __mmask16 keep = cols - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (cols - j)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + j) : _mm512_setzero_ps();
    for (int64_t r = 0; r < mb; ++r)
      store_lanes(y + r * ldy + j, _mm512_add_ps(_mm512_loadu_ps(c + r * DENSE_PANEL + j), b), keep);
  }
#else
  for (int64_t r = 0; r < mb; ++r)
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = from_float<T>(c[r * DENSE_PANEL + j] + (bias ? bias[j] : 0.f));
#endif
}

}  // namespace

// qgemm's product at act_bits 8 for 4-bit weights, through the widened weight (above).
at::Tensor qgemm_dense(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& mn, int64_t N,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& out) {
  const auto xt = x.scalar_type();
  const int64_t M = x.size(0), K = x.size(1), groups = K / 32, tiles = (N + 15) / 16;
  TORCH_CHECK(check_group_args("qgemm_dense", x, qw, d, mn, N) == 4, "qgemm_dense takes 4-bit weights, got 8-bit");
  auto y = atom::output(out, {M, N}, x.options(), "qgemm_dense");
  if (M == 0 || N == 0) return y;
  const at::Tensor bf = float_bias("qgemm_dense", bias, N);
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const at::Tensor a = x.to(at::kBFloat16).contiguous();
  const c10::BFloat16* ap = a.data_ptr<c10::BFloat16>();
  const uint8_t* qp = qw.data_ptr<uint8_t>();
  const c10::Half* dp = d.data_ptr<c10::Half>();
  const c10::Half* mp = mn.data_ptr<c10::Half>();
  // Work items: (panel, block of rows), panel-major. at::parallel_for hands each thread one
  // contiguous range of them, and a thread widens each panel of its range once, so the row
  // blocks balance the threads at the cost of one panel widened twice where two ranges meet.
  const int64_t panels = (N + DENSE_PANEL - 1) / DENSE_PANEL, blocks = (M + DENSE_ROW_BLOCK - 1) / DENSE_ROW_BLOCK;
  auto run = [&](auto* yp) {
    using T = std::remove_pointer_t<decltype(yp)>;
    at::parallel_for(0, panels * blocks, 1, [&](int64_t begin, int64_t end) {
      static thread_local std::vector<uint32_t> pairs;  // [K / 2, DENSE_PANEL]
      static thread_local std::vector<float> c;         // [DENSE_ROW_BLOCK, DENSE_PANEL]
      pairs.resize(std::max<size_t>(pairs.size(), K / 2 * DENSE_PANEL));
      c.resize(std::max<size_t>(c.size(), DENSE_ROW_BLOCK * DENSE_PANEL));
      const auto* wp = reinterpret_cast<const c10::BFloat16*>(pairs.data());
      int64_t widened = -1;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t panel = item / blocks, m0 = item % blocks * DENSE_ROW_BLOCK;
        if (panel != widened) {
          widen_panel(qp, dp, mp, tiles, groups, panel, pairs.data());
          widened = panel;
        }
        const int64_t n0 = panel * DENSE_PANEL, cols = std::min(DENSE_PANEL, N - n0);
        const int64_t mb = std::min(DENSE_ROW_BLOCK, M - m0);
        at::native::cpublas::brgemm(mb, DENSE_PANEL, K, K, DENSE_PANEL, DENSE_PANEL, false, ap + m0 * K, wp, c.data(),
                                    true);
        dense_epilogue(c.data(), bp ? bp + n0 : nullptr, mb, cols, yp + m0 * N + n0, N);
      }
      at::native::cpublas::brgemm_release(true);
    });
  };
  if (xt == at::kFloat) run(y.data_ptr<float>());
  else if (xt == at::kBFloat16) run(y.data_ptr<c10::BFloat16>());
  else run(y.data_ptr<c10::Half>());
  return y;
}

// Whether qgemm_dense's micro-kernel multiplies bfloat16 on this CPU (torch builds without
// oneDNN's micro-kernels, or CPUs it does not support, raise): one small product, checked.
bool dense_usable() {
  try {
    const int64_t m = 3, k = 4, n = DENSE_PANEL;
    std::vector<c10::BFloat16> a(m * k, c10::BFloat16(1.f)), b(k * n, c10::BFloat16(1.f));
    std::vector<float> c(m * n, 0.f);
    at::native::cpublas::brgemm(m, n, k, k, n, n, false, a.data(), b.data(), c.data(), true);
    at::native::cpublas::brgemm_release(true);
    return std::all_of(c.begin(), c.end(), [](float v) { return v == 4.f; });
  } catch (...) {
    return false;
  }
}

// Also torch ops, `<ATOM_OPS_NS>::gemv` and `::qgemm`, so a traced graph (`atom_core.compile`) can call them.
ATOM_TORCH_LIBRARY(ATOM_OPS_NS, m) {
  m.def("gemv(Tensor x, Tensor w, int N, Tensor? bias) -> Tensor");
  m.def("qgemm(Tensor x, Tensor qw, Tensor d, Tensor mn, int N, Tensor? bias, int act_bits=16) -> Tensor");
  m.def("qgemm_dense(Tensor x, Tensor qw, Tensor d, Tensor mn, int N, Tensor? bias) -> Tensor");
}
ATOM_TORCH_LIBRARY_IMPL(ATOM_OPS_NS, CPU, m) {
  m.impl("gemv", [](const at::Tensor& x, const at::Tensor& w, int64_t N, const c10::optional<at::Tensor>& bias) {
    return gemv(x, w, N, bias, c10::nullopt);
  });
  m.impl("qgemm", [](const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& mn, int64_t N,
                     const c10::optional<at::Tensor>& bias, int64_t act_bits) {
    return qgemm(x, qw, d, mn, N, bias, act_bits, c10::nullopt);
  });
  m.impl("qgemm_dense", [](const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& mn,
                           int64_t N, const c10::optional<at::Tensor>& bias) {
    return qgemm_dense(x, qw, d, mn, N, bias, c10::nullopt);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // `out`: the buffer to write (a replayed graph's, atom::output); a new tensor without it
  m.def("gemv", &gemv, "y = x @ w.T (+ bias), w in tiles of TILE rows (linear.gemv_weight), weight-streaming (CPU)",
        py::arg("x"), py::arg("w"), py::arg("N"), py::arg("bias"), py::arg("out") = py::none());
  m.def("qgemm", &qgemm, "y = x @ w.T (+ bias), w in 4- or 8-bit groups of 32 (q * d + m) packed in tiles of 16 columns, x rounded per group to act_bits (16, or 8 for 4-bit w), any rows of x, batch-invariant (CPU)",
        py::arg("x"), py::arg("qw"), py::arg("d"), py::arg("mn"), py::arg("N"), py::arg("bias"), py::arg("act_bits") = 16, py::arg("out") = py::none());
  m.def("qgemm_dense", &qgemm_dense, "qgemm's product at act_bits 8 for 4-bit w, the weight widened to bfloat16 through oneDNN's micro-kernel: for a prompt's rows on CPUs with AMX (CPU)",
        py::arg("x"), py::arg("qw"), py::arg("d"), py::arg("mn"), py::arg("N"), py::arg("bias"), py::arg("out") = py::none());
  m.def("dense_usable", &dense_usable, "whether qgemm_dense's bfloat16 micro-kernel runs on this CPU");
  m.def("set_amx", &atom::amx::set, "multiply bfloat16 rows by bfloat16 weights in AMX tiles from AMX_MIN_ROWS rows (on) or with vdpbf16ps; returns whether the tiles are on (only where this build, the CPU and Linux allow them)");
  m.def("amx_tiles", [] { return atom::amx::on.load(); }, "whether bfloat16 rows run in AMX tiles (`set_amx`)");
  m.attr("MAX_ROWS") = MAX_ROWS;
  m.attr("AMX_MIN_ROWS") = AMX_MIN_ROWS;
  m.attr("F32_EVERY_ROW") = F32_EVERY_ROW;
  m.attr("STREAM_PREFETCH") = simd::stream_nta ? "nta" : "t2";  // how weight streams are prefetched (simd.h)
  m.attr("TILE") = TILE;
  m.attr("OPS_NAMESPACE") = ATOM_STR(ATOM_OPS_NS);
  m.attr("VARIANT") = ATOM_STR(ATOM_VARIANT);
}
