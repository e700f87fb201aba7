// The rowwise NVFP4 quantize of a small input (a decode step's activation: a few rows) in one
// launch. Every block scale depends on the global amax (the tensor's, or each row's), which the
// tile programs take in a pre-pass of their own, after a launch that zeroes its accumulator: three
// launches, each boundary costing more than encoding so few bytes. Here one thread block cluster
// holds all of x in its registers; its CTAs max-reduce their parts' amaxes, exchange them through
// distributed shared memory across the cluster's barrier (hardware, not a spin on global memory),
// and encode what they hold. One cluster rather than CTAs that each take the whole tensor's amax
// again: those would each read all of x through one SM's share of the L2 bandwidth.
//
// Thread mapping: x's 16-element chunks (NVFP4's 1x16 blocks) in row-major order; thread g of the
// cluster's T holds chunks g, g + T, ..., so a warp's loads and its codes' and scales' stores are
// contiguous runs.
//
// Phases, in order (the CPU emulation runs each for every thread of every CTA before the next):
//   clear    the CTA's partial amaxes;
//   fetch    the thread's chunks into registers, and each chunk's amax;
//   reduce   those amaxes into the CTA's partials (the tensor's, or each row's);
//            cluster barrier
//   gather   each global amax from every CTA's partials (the first CTA writes them out);
//            cluster barrier (no CTA leaves while another reads its partials)
//   encode   the block scales and E2M1 codes of the thread's chunks, as TileProgram::nv_encode
//            rounds to nearest.
#pragma once

#include "common.cuh"
#include "params.h"
#if defined(__CUDACC__)
#include <cooperative_groups.h>

#include "launch.cuh"
#endif

namespace gq {

template <class In>
struct SmallRowwise {
  using S = typename In::S;
  static constexpr int kWords = int(sizeof(S));                         // 16-byte words of a chunk
  static constexpr int kChunks = kSmallBytesPerThread / (16 * kWords);  // a thread's, at most

  struct Smem {
    uint32_t part[kSmallRows];    // this CTA's amax of each group (the tensor, or each row), fp32 bits
    NvGlobal global[kSmallRows];  // each group's global scale factors, from the cluster's amax
  };

  // A thread's chunks as loaded, and their amaxes.
  struct Held {
    Vec16 words[kChunks][kWords];
    uint32_t amax[kChunks];
  };

  GQ_HD static int64_t chunk(const SmallRowwiseParams& p, int cta, int tid, int k) {
    return (int64_t(k) * p.ctas + cta) * kSmallThreads + tid;
  }
  GQ_HD static int64_t chunks(const SmallRowwiseParams& p) { return p.M * p.K / 16; }
  GQ_HD static int groups(const SmallRowwiseParams& p) { return p.row_scaled ? int(p.M) : 1; }
  // In 32 bits (a 64-bit division is a long routine on the GPU): the program takes fewer than 2^32 chunks.
  GQ_HD static int group(const SmallRowwiseParams& p, int64_t c) { return p.row_scaled ? int(uint32_t(c) / uint32_t(p.K / 16)) : 0; }

  GQ_HD static void clear(const SmallRowwiseParams& p, Smem& s, int tid) {
    if (tid < groups(p)) s.part[tid] = 0;
  }

  // Every load is issued before the first amax needs one.
  GQ_HD static void fetch(const SmallRowwiseParams& p, int cta, int tid, Held& h) {
    const Vec16* x = static_cast<const Vec16*>(p.x);
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int64_t c = chunk(p, cta, tid, k);
      if (c >= chunks(p)) break;
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
#if defined(__CUDA_ARCH__)
        h.words[k][w] = __ldg(x + c * kWords + w);
#else
        h.words[k][w] = x[c * kWords + w];
#endif
      }
    }
#pragma unroll
    for (int k = 0; k < kChunks; ++k) h.amax[k] = chunk(p, cta, tid, k) < chunks(p) ? stored_chunk_amax<In>(h.words[k]) : 0;
  }

  // Every thread of the CTA calls it (the tensor's amax is a block reduction).
  GQ_HD static void reduce(const SmallRowwiseParams& p, Smem& s, int cta, int tid, const Held& h) {
    if (p.row_scaled) {
      for (int k = 0; k < kChunks && chunk(p, cta, tid, k) < chunks(p); ++k) atomic_umax(&s.part[group(p, chunk(p, cta, tid, k))], h.amax[k]);
    } else {
      uint32_t m = 0;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) m = umax(m, h.amax[k]);  // 0 past the end
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

  GQ_HD static void encode(const SmallRowwiseParams& p, const Smem& s, int cta, int tid, const Held& h) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int64_t c = chunk(p, cta, tid, k);
      if (c >= chunks(p)) break;
      const NvGlobal& g = s.global[group(p, c)];
      const uint8_t scale = nv_block_scale(u2f(h.amax[k]), g.mult);
      const float factor = nv_encode_factor(scale, g.s_dec);
      float v[16];
      uint8_t code[16];
      unpack_chunk<In>(h.words[k], v);
#pragma unroll
      for (int i = 0; i < 16; ++i) code[i] = e2m1_nearest(v[i] * factor);
      *reinterpret_cast<Vec8*>(p.data + 8 * c) = pack_e2m1(code);
      p.scales[c] = scale;
    }
  }
};

#if defined(__CUDACC__)
template <class In>
__global__ void __launch_bounds__(kSmallThreads) small_rowwise_kernel(const SmallRowwiseParams p) {
  using Program = SmallRowwise<In>;
  __shared__ typename Program::Smem s;
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int cta = int(cluster.block_rank()), tid = int(threadIdx.x);
  typename Program::Held held;
  Program::clear(p, s, tid);
  Program::fetch(p, cta, tid, held);
  __syncthreads();
  Program::reduce(p, s, cta, tid, held);
  cluster.sync();
  Program::gather(p, s, cta, tid, [&](int rank) { return cluster.map_shared_rank(&s, rank); });
  cluster.sync();
  Program::encode(p, s, cta, tid, held);
}

template <class In>
void launch_small_rowwise_t(const SmallRowwiseParams& p, void* stream) {
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = unsigned(p.ctas);
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(p.ctas));
  config.blockDim = dim3(kSmallThreads);
  config.stream = static_cast<cudaStream_t>(stream);
  config.attrs = &cluster;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, small_rowwise_kernel<In>, p);
  check_launch("small rowwise quantize");
}
#endif

}  // namespace gq
