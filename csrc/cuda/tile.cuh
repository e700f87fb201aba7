// The quantize tile program: a CTA reads a 128x128 tile of x into shared memory once and writes
// the rowwise representation in one format and the columnwise one in another (or the same, or
// none), accumulating whatever amaxes the launch asks for. It serves every format, edge and
// option; 2-byte inputs in whole tiles go to the leaner register tile program (register_tile.cuh)
// instead, except for what only this program does (register_tile.cu says what).
//
// Launches without a column side (rowwise-only, amax pre-passes) are persistent: as many CTAs as
// fit at once, each taking every grid-th tile and fetching its next tile into a second buffer while
// the current one computes, so that loads are always in flight. The column side's stage leaves room
// for one buffer only (two would cost a third of the resident CTAs, more than the overlap gains),
// and NVFP4's registers the same, so those launch a CTA a tile.
//
// Every format's blocks (16 to 128 along a row or a column, 16x16, 128x128) nest inside the
// tile, so a tile needs no data from its neighbours; what spans tiles (a per-tensor, per-row or
// per-column amax) comes from a pre-pass of this same program with main = 0.
//
// The program is a sequence of phases separated by block barriers. Within a phase a thread reads
// only what earlier phases wrote and writes only its own chunks, so running the phases thread by
// thread on the CPU (tests/emulation) computes exactly what the GPU does.
//
// Thread mapping (256 threads, 16-element chunks, 4 per thread and direction):
//   row chunk    rc = k*256 + tid: tile row rc/8, columns 16*(rc%8) .. +15 (8 lanes cover a row,
//                so rowwise output is written 128 contiguous bytes per row);
//   column pairs pc = k*256 + tid (k < 2): tile columns 2*(pc%64) and the next, rows
//                16*(pc/64) .. +15 (a warp reads 128 contiguous bytes of a tile row at a time);
//                column outputs are staged in shared memory and written out row by row (storing
//                a transposed chunk straight to global memory would write half sectors).
#pragma once

#include <stdexcept>
#include <string>

#include "common.cuh"
#include "params.h"
#if defined(__CUDACC__)
#include <algorithm>
#include <atomic>
#include <climits>

#include "launch.cuh"
#endif

namespace gq {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kChunks = kTile * kTile / 16 / kThreads;  // chunks per thread and direction
constexpr int kStagePitch = 144;                        // bytes; 16-byte aligned, spreads banks

// Shared memory of one CTA; the column-side staging exists only with a columnwise encoder, so
// rowwise-only launches have room for a second tile buffer.
template <class In, bool kColumns, int kBuffers>
struct TileSmem {
  using Tile = typename In::S[kTile][kTile];
  alignas(16) Tile tiles[kBuffers];  // the tile the phases read (and the next one, loading)
  int current;                 // which of tiles the phases read (one buffer: the first, statically)
  GQ_HD Tile& tile() { return tiles[kBuffers == 1 ? 0 : current]; }
  GQ_HD const Tile& tile() const { return tiles[kBuffers == 1 ? 0 : current]; }
  uint32_t camax_r[kTile][8];  // amax of each row chunk [row][col/16]
  union {
    float dsum[8][kTile];        // column sums of each 16-row chunk of x (dbias; used first)
    uint32_t camax_c[8][kTile];  // amax of each column chunk, after the column transform [row/16][col]
  };
  uint32_t t16r[8][8];      // 16x16 amax from row chunks [row/16][col/16]
  uint32_t t16c[8][8];      // 16x16 amax from column chunks [row/16][col/16]
  uint32_t tile_r, tile_c;  // amax of the whole tile, row side (x) and column side (source)
  alignas(16) uint8_t stage[kColumns ? kTile : 1][kStagePitch];  // column-side output
};

struct TileCoords {
  int64_t row0, col0, tile_row;
  int g;                 // the group this tile's rows belong to
  int64_t gstart, gsize;
};

GQ_HD TileCoords tile_coords(const TileParams& p, int64_t bx, int64_t by) {
  TileCoords t;
  t.row0 = by * kTile;
  t.col0 = bx * kTile;
  t.tile_row = by;
  t.g = 0;
  t.gstart = 0;
  t.gsize = p.M;
  if (p.group_start) {
    t.g = group_of(p, t.row0);
    t.gstart = p.group_start[t.g];
    t.gsize = p.group_start[t.g + 1] - t.gstart;
  }
  return t;
}

template <class In, class Smem>
GQ_HD void read_row_chunk(const Smem& s, int r, int j, float v[16]) {
  unpack_chunk<In>(reinterpret_cast<const Vec16*>(&s.tile()[r][16 * j]), v);
}

// The column chunks (c, i) and (c + 1, i), c even: one shared-memory read brings an element of
// both columns, so a warp reads 128 contiguous bytes of a tile row at a time.
template <class In, class Smem>
GQ_HD void read_col_pair(const Smem& s, int c, int i, float v[2][16]) {
  using S = typename In::S;
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    if constexpr (sizeof(S) == 2) {
      const uint32_t u = *reinterpret_cast<const uint32_t*>(&s.tile()[16 * i + e][c]);
      v[0][e] = In::to_float(S(u & 0xFFFFu));
      v[1][e] = In::to_float(S(u >> 16));
    } else {
      v[0][e] = s.tile()[16 * i + e][c];
      v[1][e] = s.tile()[16 * i + e][c + 1];
    }
  }
}

template <class In, class Smem>
GQ_HD uint32_t row_chunk_amax(const Smem& s, int r, int j) {
  return stored_chunk_amax<In>(reinterpret_cast<const Vec16*>(&s.tile()[r][16 * j]));
}

// Up to 16 bytes to global memory: one 16-byte store when whole and aligned.
GQ_HD void store16(uint8_t* dst, const uint8_t q[16], int64_t valid, bool aligned) {
  if (valid >= 16 && aligned) {
    *reinterpret_cast<Vec16*>(dst) = pack16(q);
    return;
  }
  for (int e = 0; e < 16 && e < valid; ++e) dst[e] = q[e];
}

GQ_HD int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The factor an FP8 chunk is multiplied by, and the one its values decode with.
struct Fp8Scale {
  float scale, scale_inv;
};

// kGathered: the rows read through a gather (TileParams.rows), in programs of their own (kGathers
// says which), so that the lookup leaves the others' code as it is.
template <class In, int R, int C, bool kGathered = false>
struct TileProgram {
  static constexpr bool kPersistent = C == kNone && R != kNV;
  using Smem = TileSmem<In, C != kNone, kPersistent ? 2 : 1>;
  using S = typename In::S;
  static constexpr bool kRowBlocks = R == kBlock || R == kMX || R == kNV;
  static constexpr bool kColBlocks = C == kBlock || C == kMX || C == kNV;

  // Tiles cta, cta + ctas, ... of the launch (row-major over the tile grid). A persistent
  // program fetches each into the other buffer while the one before it computes, so a CTA always
  // has loads in flight (CTAs of one tile each would wait on DRAM together and leave it underused);
  // the others run tile `cta` alone (ctas = tiles), in straight-line code: the loop's state
  // alive across the phases would cost them up to twice their registers.
  template <class Runner>
  GQ_HD static void run_tiles(const Runner& phase, const TileParams& p, int64_t cta, int64_t ctas, Smem& s) {
    const int64_t tiles_x = cdiv(p.K, kTile), tiles = tiles_x * cdiv(p.M, kTile);
    if (cta >= tiles) return;
    if constexpr (!kPersistent) {
      const TilePosition at = position(cta, tiles_x);
      phase([&](int tid) {
        fetch(p, at, s.tiles[0], tid);
        await_fetch(false);
        if (tid == 0) s.tile_r = s.tile_c = 0;
      });
      run(phase, p, at.bx, at.by, s);
    } else {
      phase([&](int tid) { fetch(p, position(cta, tiles_x), s.tiles[0], tid); });
      int buffer = 0;
      for (int64_t tile = cta; tile < tiles; tile += ctas, buffer ^= 1) {
        const bool next = tile + ctas < tiles;
        phase([&](int tid) {
          if (next) fetch(p, position(tile + ctas, tiles_x), s.tiles[buffer ^ 1], tid);
          await_fetch(next);
          if (tid == 0) {
            s.current = buffer;
            s.tile_r = s.tile_c = 0;
          }
        });
        const TilePosition at = position(tile, tiles_x);
        run(phase, p, at.bx, at.by, s);
      }
    }
  }

  // Where tile `tile` of a row-major grid `tiles_x` tiles wide is. In 32 bits: a 64-bit division
  // is a long software routine on the GPU, and a grid has fewer than 2^31 tiles (launch_tile_t).
  struct TilePosition {
    int64_t bx, by;
  };
  GQ_HD static TilePosition position(int64_t tile, int64_t tiles_x) {
    const uint32_t by = uint32_t(tile) / uint32_t(tiles_x);
    return {int64_t(uint32_t(tile) - by * uint32_t(tiles_x)), int64_t(by)};
  }

  // One tile, already in s.tile().
  template <class Runner>
  GQ_HD static void run(const Runner& phase, const TileParams& p, int64_t bx, int64_t by, Smem& s) {
    const TileCoords t = tile_coords(p, bx, by);
    const bool col_acc = p.acc.col_global || p.acc.cols;
    const bool dbias = p.dbias_partial != nullptr;
    const bool row_stats = kRowBlocks || p.acc.row_global || p.acc.rows;
    const bool tile_r = (R == kBlock && p.row.two_d) || p.acc.row_global;
    const bool t16r = R == kNV && p.row.two_d;
    const bool col_encode = C != kNone && p.main;
    // The rowwise values are dequantized into the tile when the column side reads them next.
    const bool dq = R != kNone && p.dq_source && (col_encode || col_acc);
    const bool row_encode = R != kNone && (p.main || dq);
    const bool col_stats = (kColBlocks && col_encode) || col_acc;
    const bool tile_c = (C == kBlock && p.col.two_d && col_encode) || p.acc.col_global;
    const bool t16c = C == kNV && p.col.two_d && col_encode;

    if (row_stats || dbias) phase([&](int tid) { row_chunk_stats(p, s, tid, row_stats, tile_r, dbias); });
    if (t16r || p.acc.rows || p.acc.row_global || dbias) phase([&](int tid) { row_reduce(p, t, s, tid, t16r, dbias); });
    if constexpr (R != kNone) {
      if (row_encode) phase([&](int tid) { encode_rows(p, t, s, tid, dq); });
    }
    if (col_stats) {
      phase([&](int tid) { col_chunk_stats(p, s, tid, tile_c); });
      if (t16c || col_acc) phase([&](int tid) { col_reduce(p, t, s, tid, t16c); });
    }
    if constexpr (C != kNone) {
      if (col_encode) {
        phase([&](int tid) { encode_cols(p, t, s, tid); });
        phase([&](int tid) { write_stage(p, t, s, tid); });
      }
    }
  }

  // The tile at `at` of x into dst, zero past the edges: 16-byte pieces copied asynchronously on
  // the device (await_fetch waits for them), element by element where rows are not 16-byte
  // aligned. A thread's pieces lie in one column of pieces, kRows rows apart, so one offset and
  // one bounds check of the column serve them all (each piece's 64-bit address and bounds computed
  // afresh would make the fetch a large share of a rowwise kernel's instructions). In a padded
  // layout (p.runs) a tile's rows are a run of x's rows and then zero rows: only where the run
  // starts and how long it is change, once a tile. A gathered program (p.rows) looks each
  // piece's row up.
  GQ_HD static void fetch(const TileParams& p, TilePosition at, typename Smem::Tile& dst, int tid) {
    constexpr int kPer = 16 / sizeof(S);        // elements per 16-byte piece
    constexpr int kPerRow = kTile / kPer;       // pieces per tile row
    constexpr int kRows = kThreads / kPerRow;   // tile rows between a thread's pieces
    static_assert(kThreads % kPerRow == 0, "a thread's pieces share a column");
    const int r0 = tid / kPerRow, c = tid % kPerRow * kPer;
    const int64_t gr0 = at.by * kTile + r0, gc = at.bx * kTile + c;
    const S* x = static_cast<const S*>(p.x);
    if (p.runs != nullptr) x += (int64_t(p.runs[2 * at.by]) - at.by * kTile) * p.K;  // the tile's run
    // piece k is inside when k * kRows < rows_in
    const int64_t rows_in = (p.runs != nullptr ? at.by * kTile + p.runs[2 * at.by + 1] : p.M) - gr0;
    const S* first = x + (gr0 * p.K + gc);
    const int64_t step = int64_t(kRows) * p.K;
    if (p.vec_load) {  // whole pieces: K is a multiple of kPer, so a piece is all in or all out
      const bool col_in = gc < p.K;
      const S* src = first;
#pragma unroll
      for (int k = 0; k < kTile / kRows; ++k, src += step) {
        bool in = col_in && k * kRows < rows_in;
        if constexpr (kGathered) src = gathered(p, x, gr0 + k * kRows, gc, in);
#if defined(__CUDA_ARCH__)
        const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(&dst[r0 + k * kRows][c]));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(in ? src : x), "r"(in ? 16 : 0));
#else
        *reinterpret_cast<Vec16*>(&dst[r0 + k * kRows][c]) = in ? *reinterpret_cast<const Vec16*>(src) : Vec16{0, 0, 0, 0};
#endif
      }
#if defined(__CUDA_ARCH__)
      asm volatile("cp.async.commit_group;\n" ::);
#endif
    } else if constexpr (!kGathered) {
      for (int k = 0; k < kTile / kRows; ++k) {
        for (int e = 0; e < kPer; ++e) {
          const bool in = gc + e < p.K && k * kRows < rows_in;
          dst[r0 + k * kRows][c + e] = in ? first[k * step + e] : S(0);
        }
      }
    } else {  // a loop of its own: the one above sharing the gather's pointer compiles differently
      for (int k = 0; k < kTile / kRows; ++k) {
        bool row_in = k * kRows < rows_in;
        const S* src = gathered(p, x, gr0 + k * kRows, gc, row_in);
        for (int e = 0; e < kPer; ++e) dst[r0 + k * kRows][c + e] = gc + e < p.K && row_in ? src[e] : S(0);
      }
    }
  }

  // The piece of padded row gr at column gc, where the gather puts it: the gather is read only for
  // a piece `in` the layout, which a zero row (-1) takes out.
  GQ_HD static const S* gathered(const TileParams& p, const S* x, int64_t gr, int64_t gc, bool& in) {
    const int64_t row = in ? p.rows[gr] : -1;
    in = row >= 0;
    return x + (row * p.K + gc);
  }

  // Wait for this thread's fetches but the latest (another tile still loading) or all of them.
  GQ_HD static void await_fetch(bool one_pending) {
#if defined(__CUDA_ARCH__)
    if (one_pending) asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    else asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#else
    (void)one_pending;
#endif
  }

  GQ_HD static void row_chunk_stats(const TileParams& p, Smem& s, int tid, bool stats, bool tile_r, bool dbias) {
    if (stats) {
      uint32_t tile_max = 0;
      for (int k = 0; k < kChunks; ++k) {
        const int rc = k * kThreads + tid, r = rc >> 3, j = rc & 7;
        const uint32_t m = row_chunk_amax<In>(s, r, j);
        s.camax_r[r][j] = m;
        tile_max = umax(tile_max, m);
      }
      if (tile_r) block_umax(&s.tile_r, tile_max);
    }
    if (dbias) {  // from x, before a dequantized source overwrites the tile
      for (int k = 0; k < kChunks; ++k) {
        const int cc = k * kThreads + tid, c = cc & (kTile - 1), i = cc >> 7;
        float sum = 0.0f;
        for (int e = 0; e < 16; ++e) sum += In::to_float(s.tile()[16 * i + e][c]);
        s.dsum[i][c] = sum;
      }
    }
  }

  GQ_HD static void row_reduce(const TileParams& p, const TileCoords& t, Smem& s, int tid, bool t16r, bool dbias) {
    if (t16r && tid < 64) {
      const int a = tid >> 3, j = tid & 7;
      uint32_t m = 0;
      for (int r = 0; r < 16; ++r) m = umax(m, s.camax_r[16 * a + r][j]);
      s.t16r[a][j] = m;
    }
    if (p.acc.rows && tid < kTile && t.row0 + tid < p.M) {
      uint32_t m = 0;
      for (int j = 0; j < 8; ++j) m = umax(m, s.camax_r[tid][j]);
      atomic_umax(&p.acc.rows[t.row0 + tid], m);
    }
    if (p.acc.row_global && tid == 0) atomic_umax(&p.acc.row_global[t.g], s.tile_r);
    if (dbias && tid < kTile && t.col0 + tid < p.K) {
      float sum = 0.0f;
      for (int i = 0; i < 8; ++i) sum += s.dsum[i][tid];
      p.dbias_partial[t.tile_row * p.K + t.col0 + tid] = sum;
    }
  }

  // Scale of an FP8 chunk of the row side (a, b) = (r, j) or the column side (c, i); writes the
  // block's scale where this chunk is the block's designated writer.
  template <int F, bool kRowSide>
  GQ_HD static Fp8Scale fp8_scale(const TileParams& p, const TileCoords& t, const Smem& s, const Encoder& e,
                                  int a, int b, int64_t gr, int64_t gc, bool write) {
    if constexpr (F == kPerTensor) {
      return {e.scale[t.g], e.scale_inv[t.g]};
    } else if constexpr (F == kRowScaled) {
      const int64_t n = kRowSide ? gr : t.g * p.K + gc;
      return {e.scale[n], e.scale_inv[n]};
    } else if constexpr (F == kBlock) {
      // A 1-D block is the block_chunks aligned chunks around b (a power of two dividing 8).
      const int first = b & ~(e.block_chunks - 1);
      uint32_t m = kRowSide ? s.tile_r : s.tile_c;
      if (!e.two_d) {
        m = 0;
        for (int k = 0; k < 8; ++k) {
          if ((k & ~(e.block_chunks - 1)) == first) m = umax(m, kRowSide ? s.camax_r[a][k] : s.camax_c[k][a]);
        }
      }
      const float scale = scale_from_amax(u2f(m), e.fp8, e.epsilon, e.pow2);
      const float scale_inv = 1.0f / scale;
      // 128x128: row side (row tiles, col tiles), column side (col tiles, row tiles); 1-D blocks
      // (blocks along the dim, M or K) in memory: row side outer-dim-major, column side (M / L, K).
      if (write && b == first && (!e.two_d || a == 0)) {
        float* out = static_cast<float*>(e.scales);
        // The block's index along its dim, in 32 bits (a 64-bit division is a long routine on the GPU).
        const int64_t block = uint32_t(((kRowSide ? t.col0 : t.row0) / kTile) * 8 + first) / uint32_t(e.block_chunks);
        if (kRowSide) out[e.two_d ? t.tile_row * cdiv(p.K, kTile) + t.col0 / kTile : block * p.M + gr] = scale_inv;
        else out[e.two_d ? (t.col0 / kTile) * cdiv(p.M, kTile) + t.tile_row : block * p.K + gc] = scale_inv;
      }
      return {scale, scale_inv};
    } else {  // MXFP8: chunks b and b^1 form a 32-element block
      const uint32_t m = kRowSide ? umax(s.camax_r[a][b & ~1], s.camax_r[a][b | 1])
                                  : umax(s.camax_c[b & ~1][a], s.camax_c[b | 1][a]);
      const uint8_t biased = e8m0_from_amax(u2f(m), e.fp8);
      if (write && (b & 1) == 0) {
        uint8_t* out = static_cast<uint8_t*>(e.scales);
        if (kRowSide) out[(gc / 32) * p.M + gr] = biased;  // outer-dim-major, as 1x128
        else out[(gr / 32) * p.K + gc] = biased;
      }
      return {mx_encode_multiplier(biased), mx_decode_scale(biased)};
    }
  }

  // NVFP4 codes of one chunk; returns the block's E4M3 scale and sets the dequantize factor.
  GQ_HD static uint8_t nv_encode(const Encoder& e, uint32_t key, uint32_t vec_max, uint32_t global_amax, const float v[16],
                                 uint64_t rand_index, uint8_t code[16], float* dq_factor) {
    const NvGlobal gl = nv_global(u2f(global_amax));
    const uint8_t scale = nv_block_scale(u2f(vec_max), gl.mult);
    const float encode = nv_encode_factor(scale, gl.s_dec);
    // random_bits(e.key, rand_index + i) with its per-chunk half hoisted: the 16 indices share the high
    // word, except that those past a wrap of the low word (lo + i < lo) take the next one.
    // One branch for the chunk, not one an element: each rounding's 16 steps are then contiguous code
    // (the large NVFP4 kernels otherwise stall on instruction fetch).
    if (e.sr) {
      const uint32_t lo = uint32_t(rand_index), hi = uint32_t(rand_index >> 32);
      const uint32_t stream = random_stream(key, hi), stream_next = random_stream(key, hi + 1);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const uint32_t lo_i = lo + uint32_t(i);
        code[i] = e2m1_stochastic(v[i] * encode, random_bits_at(lo_i < lo ? stream_next : stream, lo_i));
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) code[i] = e2m1_nearest(v[i] * encode);
    }
    dq_factor[0] = e4m3_value(scale);
    dq_factor[1] = gl.g_dec;
    return scale;
  }

  GQ_HD static void encode_rows(const TileParams& p, const TileCoords& t, Smem& s, int tid, bool dq) {
    const Encoder& e = p.row;
    const bool write = p.main && e.data != nullptr;
    const uint32_t key = R == kNV ? sr_key_of(e) : 0;
    for (int k = 0; k < kChunks; ++k) {
      const int rc = k * kThreads + tid, r = rc >> 3, j = rc & 7;
      const int64_t gr = t.row0 + r, gc = t.col0 + 16 * j;
      if (gr >= p.M || gc >= p.K) continue;
      float v[16], d[16];
      read_row_chunk<In>(s, r, j, v);
      if constexpr (R == kNV) {
        uint8_t code[16];
        float f[2];
        const uint32_t vec_max = e.two_d ? s.t16r[r >> 4][j] : s.camax_r[r][j];
        const uint32_t global_amax = e.amax[e.row_scaled ? gr : t.g];
        const uint64_t index = uint64_t(gr - t.gstart) * uint64_t(p.K) + uint64_t(gc);
        const uint8_t scale = nv_encode(e, key, vec_max, global_amax, v, index, code, f);
        if (write) {
          *reinterpret_cast<Vec8*>(e.data + gr * (p.K / 2) + gc / 2) = pack_e2m1(code);
          static_cast<uint8_t*>(e.scales)[gr * (p.K / 16) + gc / 16] = scale;
        }
        if (dq) for (int i = 0; i < 16; ++i) d[i] = (e2m1_value(code[i]) * f[0]) * f[1];
      } else {
        const Fp8Scale sc = fp8_scale<R, true>(p, t, s, e, r, j, gr, gc, write);
        uint8_t q[16];
        fp8_encode16(v, sc.scale, e.fp8, q, kRowBlocks ? s.camax_r[r][j] : chunk_amax(v));
        if (write) store16(e.data + gr * p.K + gc, q, p.K - gc, (p.K & 15) == 0);
        if (dq) for (int i = 0; i < 16; ++i) d[i] = fp8_decode(q[i], e.fp8) * sc.scale_inv;
      }
      if (dq) {  // Representation.dequantize(x.dtype): fp32 values rounded to the input dtype
        for (int i = 0; i < 16 && gc + i < p.K; ++i) s.tile()[r][16 * j + i] = In::from_float(d[i]);
      }
    }
  }

  // Column chunks go in pairs (read_col_pair): pass k of a thread takes columns c and c + 1 of
  // row block i.
  static constexpr int kPairs = kChunks / 2;
  GQ_HD static void col_pair(int k, int tid, int& c, int& i) {
    const int pc = k * kThreads + tid;
    c = 2 * (pc & (kTile / 2 - 1));
    i = pc / (kTile / 2);
  }

  // chunk_amax of a column pair after the column transform; without one, from the stored bits
  // as in row_chunk_amax.
  GQ_HD static void col_pair_amax(const TileParams& p, const Smem& s, int c, int i, uint32_t m[2]) {
    if constexpr (sizeof(S) == 2) {
      if (!p.col_rht) {
        uint32_t both = 0;
#pragma unroll
        for (int e = 0; e < 16; ++e) both = umax_halves(both, *reinterpret_cast<const uint32_t*>(&s.tile()[16 * i + e][c]) & 0x7FFF7FFFu);
        m[0] = abs_bits(In::to_float(S(both & 0xFFFFu)));
        m[1] = abs_bits(In::to_float(S(both >> 16)));
        return;
      }
    }
    float v[2][16];
    read_col_pair<In>(s, c, i, v);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (p.col_rht) hadamard16<In>(v[h], p.col_sign_mask);
      m[h] = chunk_amax(v[h]);
    }
  }

  GQ_HD static void col_chunk_stats(const TileParams& p, Smem& s, int tid, bool tile_c) {
    uint32_t tile_max = 0;
    for (int k = 0; k < kPairs; ++k) {
      int c, i;
      col_pair(k, tid, c, i);
      uint32_t m[2];
      col_pair_amax(p, s, c, i, m);
      s.camax_c[i][c] = m[0];
      s.camax_c[i][c + 1] = m[1];
      tile_max = umax(tile_max, umax(m[0], m[1]));
    }
    if (tile_c) block_umax(&s.tile_c, tile_max);
  }

  GQ_HD static void col_reduce(const TileParams& p, const TileCoords& t, Smem& s, int tid, bool t16c) {
    if (t16c && tid < 64) {
      const int i = tid >> 3, b = tid & 7;
      uint32_t m = 0;
      for (int c = 0; c < 16; ++c) m = umax(m, s.camax_c[i][16 * b + c]);
      s.t16c[i][b] = m;
    }
    if (p.acc.cols && tid < kTile && t.col0 + tid < p.K) {
      uint32_t m = 0;
      for (int i = 0; i < 8; ++i) m = umax(m, s.camax_c[i][tid]);
      atomic_umax(&p.acc.cols[t.g * p.K + t.col0 + tid], m);
    }
    if (p.acc.col_global && tid == 0) atomic_umax(&p.acc.col_global[t.g], s.tile_c);
  }

  GQ_HD static void encode_cols(const TileParams& p, const TileCoords& t, Smem& s, int tid) {
    const uint32_t key = C == kNV ? sr_key_of(p.col) : 0;
    for (int k = 0; k < kPairs; ++k) {
      int c, i;
      col_pair(k, tid, c, i);
      const int64_t gr = t.row0 + 16 * i;
      if (gr >= p.M) continue;
      float v[2][16];
      read_col_pair<In>(s, c, i, v);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (t.col0 + c + h < p.K) encode_col_chunk(p, t, s, c + h, i, gr, v[h], key);
      }
    }
  }

  GQ_HD static void encode_col_chunk(const TileParams& p, const TileCoords& t, Smem& s, int c, int i, int64_t gr, float v[16],
                                     uint32_t key) {
    const Encoder& e = p.col;
    const int64_t gc = t.col0 + c;
    if constexpr (C == kNV) {
      if (p.col_rht) hadamard16<In>(v, p.col_sign_mask);
      uint8_t code[16];
      float f[2];
      const uint32_t vec_max = e.two_d ? s.t16c[i][c >> 4] : s.camax_c[i][c];
      // The source is x^T (K, M): element (gc, gr) of group g has index gc * Mg + (gr - start).
      const uint64_t index = uint64_t(gc) * uint64_t(t.gsize) + uint64_t(gr - t.gstart);
      const uint8_t scale = nv_encode(e, key, vec_max, e.amax[t.g], v, index, code, f);
      *reinterpret_cast<Vec8*>(&s.stage[c][8 * i]) = pack_e2m1(code);
      static_cast<uint8_t*>(e.scales)[gc * (p.M / 16) + gr / 16] = scale;
    } else {
      const Fp8Scale sc = fp8_scale<C, false>(p, t, s, e, c, i, gr, gc, true);
      uint8_t q[16];
      fp8_encode16(v, sc.scale, e.fp8, q, kColBlocks ? s.camax_c[i][c] : chunk_amax(v));
      if (C == kMX || !e.transposed) {  // x's (M, K) layout, as MXFP8 keeps it
        for (int n = 0; n < 16; ++n) s.stage[16 * i + n][c] = q[n];
      } else {  // transposed: row c of the stage holds this column's bytes
        *reinterpret_cast<Vec16*>(&s.stage[c][16 * i]) = pack16(q);
      }
    }
  }

  GQ_HD static void write_stage(const TileParams& p, const TileCoords& t, Smem& s, int tid) {
    int64_t bytes, ld, dst_row, dst_byte, valid_rows, valid_bytes;
    if constexpr (C == kNV) {
      bytes = kTile / 2, ld = p.M / 2, dst_row = t.col0, dst_byte = t.row0 / 2;
      valid_rows = p.K - t.col0, valid_bytes = (p.M - t.row0) / 2;
    } else if (C == kMX || !p.col.transposed) {
      bytes = kTile, ld = p.K, dst_row = t.row0, dst_byte = t.col0, valid_rows = p.M - t.row0, valid_bytes = p.K - t.col0;
    } else {
      bytes = kTile, ld = p.M, dst_row = t.col0, dst_byte = t.row0, valid_rows = p.K - t.col0, valid_bytes = p.M - t.row0;
    }
    const int per_row = int(bytes / 16);
    for (int piece = tid; piece < kTile * per_row; piece += kThreads) {
      const int row = piece / per_row, b = (piece % per_row) * 16;
      if (row >= valid_rows || b >= valid_bytes) continue;
      uint8_t* dst = p.col.data + (dst_row + row) * ld + dst_byte + b;
      const uint8_t* src = &s.stage[row][b];
      if (b + 16 <= valid_bytes && (ld & 15) == 0) {
        *reinterpret_cast<Vec16*>(dst) = *reinterpret_cast<const Vec16*>(src);
      } else {
        for (int n = 0; n < 16 && b + n < valid_bytes; ++n) dst[n] = src[n];
      }
    }
  }
};

// The programs a grouped site reads through a gather with: 2-byte tokens, one format a pass
// (graphquant.kernels.native.grouped_quantize_pass routes the rest), so that no other program is
// compiled twice.
template <class In, int R, int C>
constexpr bool kGathers = sizeof(typename In::S) == 2 && (R == C || R == kNone || C == kNone);

// Calls run with (an empty object of) the program that serves p: the gathered one where p reads
// its rows through a gather; an error where none is compiled, rather than a read past the gather.
template <class In, int R, int C, class Run>
void tile_program(const TileParams& p, Run&& run) {
  if (p.rows == nullptr) {
    run(TileProgram<In, R, C>{});
  } else if constexpr (kGathers<In, R, C>) {
    run(TileProgram<In, R, C, true>{});
  } else {
    throw std::invalid_argument("graphquant quantize: no kernel reads rows through a gather (rows=) of a " +
                                std::to_string(sizeof(typename In::S)) + "-byte input in formats " + std::to_string(R) + " and " +
                                std::to_string(C) + ": it takes bf16 or fp16, one format a call");
  }
}

#if defined(__CUDACC__)
struct DeviceRunner {
  template <class F>
  __device__ void operator()(F&& f) const {
    f(int(threadIdx.x));
    __syncthreads();
  }
};

template <class In, int R, int C, bool kGathered>
__global__ void __launch_bounds__(kThreads) tile_kernel(const TileParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  using Program = TileProgram<In, R, C, kGathered>;
  Program::run_tiles(DeviceRunner{}, p, blockIdx.x, gridDim.x, *reinterpret_cast<typename Program::Smem*>(smem));
}

template <class In, int R, int C, bool kGathered>
void launch_program(TileProgram<In, R, C, kGathered>, const TileParams& p, void* stream) {
  using Program = TileProgram<In, R, C, kGathered>;
  constexpr int smem = sizeof(typename Program::Smem);
  // Once per device (the attribute is the current device's), and never again: a call during a
  // CUDA-graph capture would be an error.
  static std::atomic<uint64_t> configured{0};
  static std::atomic<int64_t> resident[64];  // persistent: CTAs resident at once, per device
  int device = 0;
  cudaGetDevice(&device);
  if (!(configured.load() >> device & 1)) {
    cudaFuncSetAttribute(tile_kernel<In, R, C, kGathered>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if constexpr (Program::kPersistent) {
      int per_sm = 0, sms = 0;
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, tile_kernel<In, R, C, kGathered>, kThreads, smem);
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      resident[device % 64] = std::max<int64_t>(1, int64_t(per_sm) * sms);
    }
    configured.fetch_or(uint64_t(1) << device);
  }
  int64_t grid = cdiv(p.K, kTile) * cdiv(p.M, kTile);  // a CTA a tile, or as many as are resident
  if (grid > INT32_MAX) {  // TileProgram::position counts tiles in 32 bits
    throw std::invalid_argument("graphquant quantize: a " + std::to_string(p.M) + "x" + std::to_string(p.K) +
                                " input has more than 2^31 - 1 tiles of 128x128");
  }
  if constexpr (Program::kPersistent) grid = std::min(grid, resident[device % 64].load());
  tile_kernel<In, R, C, kGathered><<<unsigned(grid), kThreads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  check_launch("quantize");
}

template <class In, int R, int C>
void launch_tile_t(const TileParams& p, void* stream) {
  tile_program<In, R, C>(p, [&](auto program) { launch_program(program, p, stream); });
}

#define GQ_INSTANTIATE_ROW(In, R)                                                      \
  template void launch_tile_t<In, R, kNone>(const TileParams&, void*);                 \
  template void launch_tile_t<In, R, kPerTensor>(const TileParams&, void*);            \
  template void launch_tile_t<In, R, kBlock>(const TileParams&, void*);                \
  template void launch_tile_t<In, R, kRowScaled>(const TileParams&, void*);            \
  template void launch_tile_t<In, R, kMX>(const TileParams&, void*);                   \
  template void launch_tile_t<In, R, kNV>(const TileParams&, void*);
#endif

}  // namespace gq
