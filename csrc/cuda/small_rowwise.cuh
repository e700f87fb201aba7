// The rowwise quantize of a small input (a decode step's activation: a few rows) in one launch,
// NVFP4 (1x16 blocks rounded to nearest, the tensor's or each row's amax) or MXFP8.
//
// NVFP4's block scales depend on the global amax, which the tile programs take in a pre-pass of
// their own, after a launch that zeroes its accumulator: three launches, each boundary costing
// more than encoding so few bytes. Here one thread block cluster holds all of x in its registers;
// its CTAs max-reduce their parts' amaxes, exchange them through distributed shared memory across
// the cluster's barrier (hardware, not a spin on global memory), and encode what they hold. One
// cluster rather than CTAs that each take the whole tensor's amax again: those would each read
// all of x through one SM's share of the L2 bandwidth. MXFP8 scales from its blocks alone (the
// tile program's one launch already), but that program spends a 128-row tile on each few rows.
//
// Thread mapping: x's blocks (16 elements for NVFP4, 32 for MXFP8) in row-major order; thread g
// of the cluster's T holds blocks g, g + T, ..., so a warp's loads and its codes' stores are
// contiguous runs.
//
// Phases, in order (the CPU emulation runs each for every thread of every CTA before the next):
//   clear    NVFP4: the CTA's partial amaxes;
//   fetch    the thread's blocks into registers, and each block's amax;
//   reduce   NVFP4: those amaxes into the CTA's partials (the tensor's, or each row's);
//            cluster barrier
//   gather   NVFP4: each global amax from every CTA's partials (the first CTA writes them out);
//            cluster barrier (no CTA leaves while another reads its partials)
//   encode   the block scales and codes of the thread's blocks, as the tile programs make them
//            (TileProgram::nv_encode rounding to nearest, fp8_scale of MXFP8).
#pragma once

#include "common.cuh"
#include "params.h"
#if defined(__CUDACC__)
#include <cooperative_groups.h>

#include "launch.cuh"
#endif

namespace gq {

template <class In, int R>
struct SmallRowwise {
  static_assert(R == kNV || R == kMX, "the small rowwise program encodes NVFP4 and MXFP8");
  using S = typename In::S;
  static constexpr bool kGlobal = R == kNV;                              // scales from a global amax
  static constexpr int kBlock = R == kNV ? 16 : 32;                      // elements a block scale covers
  static constexpr int kChunks = kBlock / 16;                            // 16-element chunks of a block
  static constexpr int kWords = kChunks * int(sizeof(S));                // 16-byte words of a block
  static constexpr int kBlocks = kSmallBytesPerThread / (16 * kWords);  // a thread's, at most

  struct Smem {
    uint32_t part[kSmallRows];    // this CTA's amax of each group (the tensor, or each row), fp32 bits
    NvGlobal global[kSmallRows];  // each group's global scale factors, from the cluster's amax
  };

  // A thread's blocks as loaded, and their amaxes.
  struct Held {
    Vec16 words[kBlocks][kWords];
    uint32_t amax[kBlocks];
  };

  GQ_HD static int64_t block(const SmallRowwiseParams& p, int cta, int tid, int k) {
    return (int64_t(k) * p.ctas + cta) * kSmallThreads + tid;
  }
  GQ_HD static int64_t blocks(const SmallRowwiseParams& p) { return p.M * p.K / kBlock; }
  // Divisions in 32 bits (a 64-bit one is a long routine on the GPU): the program takes fewer than 2^32 blocks.
  GQ_HD static int64_t row_of(const SmallRowwiseParams& p, int64_t b) { return uint32_t(b) / uint32_t(p.K / kBlock); }
  GQ_HD static int groups(const SmallRowwiseParams& p) { return p.row_scaled ? int(p.M) : 1; }
  GQ_HD static int group(const SmallRowwiseParams& p, int64_t b) { return p.row_scaled ? int(row_of(p, b)) : 0; }

  GQ_HD static void clear(const SmallRowwiseParams& p, Smem& s, int tid) {
    if (tid < groups(p)) s.part[tid] = 0;
  }

  // Every load is issued before the first amax needs one.
  GQ_HD static void fetch(const SmallRowwiseParams& p, int cta, int tid, Held& h) {
    const Vec16* x = static_cast<const Vec16*>(p.x);
#pragma unroll
    for (int k = 0; k < kBlocks; ++k) {
      const int64_t b = block(p, cta, tid, k);
      if (b >= blocks(p)) break;
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
#if defined(__CUDA_ARCH__)
        h.words[k][w] = __ldg(x + b * kWords + w);
#else
        h.words[k][w] = x[b * kWords + w];
#endif
      }
    }
#pragma unroll
    for (int k = 0; k < kBlocks; ++k) {
      h.amax[k] = 0;
      if (block(p, cta, tid, k) >= blocks(p)) continue;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) h.amax[k] = umax(h.amax[k], stored_chunk_amax<In>(&h.words[k][c * int(sizeof(S))]));
    }
  }

  // Every thread of the CTA calls it (the tensor's amax is a block reduction).
  GQ_HD static void reduce(const SmallRowwiseParams& p, Smem& s, int cta, int tid, const Held& h) {
    if (p.row_scaled) {
      for (int k = 0; k < kBlocks && block(p, cta, tid, k) < blocks(p); ++k) atomic_umax(&s.part[group(p, block(p, cta, tid, k))], h.amax[k]);
    } else {
      uint32_t m = 0;
#pragma unroll
      for (int k = 0; k < kBlocks; ++k) m = umax(m, h.amax[k]);  // 0 past the end
      block_umax(&s.part[0], m);
    }
  }

  // peer(r): CTA r's shared memory.
  template <class Peer>
  GQ_HD static void gather(const SmallRowwiseParams& p, Smem& s, int cta, int tid, const Peer& peer) {
    if (tid >= groups(p)) return;
    uint32_t m = 0;
    for (int r = 0; r < p.ctas; ++r) m = umax(m, peer(r)->part[tid]);
    s.global[tid] = nv_global(u2f(m));
    if (cta == 0) p.amax[tid] = u2f(m);
  }

  // global: NVFP4's global scale factors per group (Smem::global).
  GQ_HD static void encode(const SmallRowwiseParams& p, const NvGlobal* global, int cta, int tid, const Held& h) {
#pragma unroll
    for (int k = 0; k < kBlocks; ++k) {
      const int64_t b = block(p, cta, tid, k);
      if (b >= blocks(p)) break;
      float v[16];
      if constexpr (R == kNV) {
        const NvGlobal& g = global[group(p, b)];
        const uint8_t scale = nv_block_scale(u2f(h.amax[k]), g.mult);
        const float factor = nv_encode_factor(scale, g.s_dec);
        uint8_t code[16];
        unpack_chunk<In>(h.words[k], v);
#pragma unroll
        for (int i = 0; i < 16; ++i) code[i] = e2m1_nearest(v[i] * factor);
        *reinterpret_cast<Vec8*>(p.data + 8 * b) = pack_e2m1(code);
        p.scales[b] = scale;
      } else {
        const uint8_t biased = e8m0_from_amax(u2f(h.amax[k]), p.fp8);
        const float multiplier = mx_encode_multiplier(biased);
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          uint8_t q[16];
          unpack_chunk<In>(&h.words[k][c * int(sizeof(S))], v);
          fp8_encode16(v, multiplier, p.fp8, q, h.amax[k]);
          reinterpret_cast<Vec16*>(p.data)[kChunks * b + c] = pack16(q);
        }
        const int64_t row = row_of(p, b);
        p.scales[(b - row * (p.K / kBlock)) * p.M + row] = biased;  // outer-dim-major
      }
    }
  }
};

#if defined(__CUDACC__)
template <class In, int R>
__global__ void __launch_bounds__(kSmallThreads) small_rowwise_kernel(const SmallRowwiseParams p) {
  using Program = SmallRowwise<In, R>;
  const int tid = int(threadIdx.x);
  typename Program::Held held;
  // A dependent launch (launch_small_rowwise_t): wait for x's producer, then let the GEMM that
  // reads the codes start fetching its weight while these few CTAs quantize.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if constexpr (!Program::kGlobal) {
    Program::fetch(p, int(blockIdx.x), tid, held);
    Program::encode(p, nullptr, int(blockIdx.x), tid, held);
  } else {
    __shared__ typename Program::Smem s;
    const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    const int cta = int(cluster.block_rank());
    Program::clear(p, s, tid);
    Program::fetch(p, cta, tid, held);
    __syncthreads();
    Program::reduce(p, s, cta, tid, held);
    cluster.sync();
    Program::gather(p, s, cta, tid, [&](int rank) { return cluster.map_shared_rank(&s, rank); });
    cluster.sync();
    Program::encode(p, s.global, cta, tid, held);
  }
}

// NVFP4 as one cluster of p.ctas CTAs; MXFP8, which exchanges nothing, as plain CTAs. Either is
// a programmatic dependent launch: it starts while x's producer finishes (its kernel waits for it).
template <class In, int R>
void launch_small_rowwise_t(const SmallRowwiseParams& p, void* stream) {
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = dependent_launch() ? 1 : 0;
  attrs[1].id = cudaLaunchAttributeClusterDimension;
  attrs[1].val.clusterDim.x = unsigned(p.ctas);
  attrs[1].val.clusterDim.y = attrs[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(p.ctas));
  config.blockDim = dim3(kSmallThreads);
  config.stream = static_cast<cudaStream_t>(stream);
  config.attrs = attrs;
  config.numAttrs = SmallRowwise<In, R>::kGlobal ? 2 : 1;
  cudaLaunchKernelEx(&config, small_rowwise_kernel<In, R>, p);
  check_launch("small rowwise quantize");
}
#endif

}  // namespace gq
