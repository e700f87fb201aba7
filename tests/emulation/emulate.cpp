// The CUDA kernels of csrc/cuda compiled for the CPU: each CTA's phases run thread by thread
// (a barrier between phases is then implicit), so the CPU tests check the kernels' indexing,
// layouts and numerics bit for bit without a GPU. Built by tests/emulation/__init__.py.
#include <torch/extension.h>

#include <memory>

#include "dequantize.cuh"
#include "finish.cuh"
#include "tile.cuh"

namespace gq {
namespace {

struct HostRunner {
  template <class F>
  void operator()(F&& f) const {
    for (int tid = 0; tid < kThreads; ++tid) f(tid);
  }
};

// Persistent programs on a few CTAs, so that each runs several tiles through both of its buffers;
// the others a CTA a tile, as launched.
template <class In, int R, int C>
void emulate_tile(const TileParams& p) {
  using Program = TileProgram<In, R, C>;
  auto smem = std::make_unique<typename Program::Smem>();
  const int64_t ctas = Program::kPersistent ? 3 : cdiv(p.K, kTile) * cdiv(p.M, kTile);
  for (int64_t cta = 0; cta < ctas; ++cta) Program::run_tiles(HostRunner{}, p, cta, ctas, *smem);
}

template <class In, int R>
void emulate_row(int col_format, const TileParams& p) {
  switch (col_format) {
    case kNone: return emulate_tile<In, R, kNone>(p);
    case kPerTensor: return emulate_tile<In, R, kPerTensor>(p);
    case kBlock: return emulate_tile<In, R, kBlock>(p);
    case kRowScaled: return emulate_tile<In, R, kRowScaled>(p);
    case kMX: return emulate_tile<In, R, kMX>(p);
    default: return emulate_tile<In, R, kNV>(p);
  }
}

template <class In>
void emulate(int row_format, int col_format, const TileParams& p) {
  switch (row_format) {
    case kNone: return emulate_row<In, kNone>(col_format, p);
    case kPerTensor: return emulate_row<In, kPerTensor>(col_format, p);
    case kBlock: return emulate_row<In, kBlock>(col_format, p);
    case kRowScaled: return emulate_row<In, kRowScaled>(col_format, p);
    case kMX: return emulate_row<In, kMX>(col_format, p);
    default: return emulate_row<In, kNV>(col_format, p);
  }
}

}  // namespace

void launch_tile(int dtype, int row_format, int col_format, const TileParams& p, void*) {
  if (dtype == kBF16) emulate<InBF16>(row_format, col_format, p);
  else if (dtype == kF16) emulate<InF16>(row_format, col_format, p);
  else emulate<InF32>(row_format, col_format, p);
}

void launch_finalize(const FinalizeParams& p, void*) {
  for (int64_t i = 0; i < p.n; ++i) finalize_one(p, i);
}

void launch_dbias(const DbiasParams& p, void*) {
  for (int64_t c = 0; c < p.K; ++c) {
    if (p.dtype == kBF16) dbias_one<InBF16>(p, c);
    else if (p.dtype == kF16) dbias_one<InF16>(p, c);
    else dbias_one<InF32>(p, c);
  }
}

void launch_dequantize(const DequantParams& p, void*) {
  const int64_t chunks = p.rows * ((p.cols + 15) / 16);
  for (int64_t i = 0; i < chunks; ++i) {
    if (p.out_dtype == kBF16) dequantize_chunk<InBF16>(p, i);
    else if (p.out_dtype == kF16) dequantize_chunk<InF16>(p, i);
    else dequantize_chunk<InF32>(p, i);
  }
}

}  // namespace gq

void register_cuda_kernels(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("cuda_built") = true;
  m.attr("emulated") = true;
  register_cuda_kernels(m);
}
