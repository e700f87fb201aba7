// The CUDA kernels of csrc/cuda compiled for the CPU: each CTA's phases run thread by thread
// (a barrier between phases is then implicit), so the CPU tests check the kernels' indexing,
// layouts and numerics bit for bit without a GPU. Built by tests/emulation/__init__.py.
#include <torch/extension.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dequantize.cuh"
#include "finish.cuh"
#include "small_rowwise.cuh"
#include "tile.cuh"

namespace gq {

// The launchers called since the last take_launches(), by name: the CPU tests count a call's launches.
std::vector<std::string> launched;

namespace {

struct HostRunner {
  template <class F>
  void operator()(F&& f) const {
    for (int tid = 0; tid < kThreads; ++tid) f(tid);
  }
};

// Persistent programs on a few CTAs, so that each runs several tiles through both of its buffers;
// the others a CTA a tile, as launched (the gathered program where the launch reads through a gather).
template <class In, int R, int C>
void emulate_tile(const TileParams& p) {
  tile_program<In, R, C>(p, [&](auto program) {
    using Program = decltype(program);
    auto smem = std::make_unique<typename Program::Smem>();
    const int64_t ctas = Program::kPersistent ? 3 : cdiv(p.K, kTile) * cdiv(p.M, kTile);
    for (int64_t cta = 0; cta < ctas; ++cta) Program::run_tiles(HostRunner{}, p, cta, ctas, *smem);
  });
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

// The cluster's CTAs side by side, each phase for all their threads before the next (a barrier
// between phases, the cluster's included), each thread's registers kept between phases.
template <class In, int R>
void emulate_small_rowwise(const SmallRowwiseParams& p) {
  using Program = SmallRowwise<In, R>;
  std::vector<typename Program::Smem> smem(p.ctas);
  std::vector<typename Program::Held> held(size_t(p.ctas) * kSmallThreads);
  auto each = [&](auto&& phase) {
    for (int cta = 0; cta < p.ctas; ++cta) {
      for (int tid = 0; tid < kSmallThreads; ++tid) phase(cta, tid, held[size_t(cta) * kSmallThreads + tid]);
    }
  };
  if constexpr (Program::kGlobal) each([&](int cta, int tid, auto&) { Program::clear(p, smem[cta], tid); });
  each([&](int cta, int tid, auto& h) { Program::fetch(p, cta, tid, h); });
  if constexpr (Program::kGlobal) {
    each([&](int cta, int tid, auto& h) { Program::reduce(p, smem[cta], cta, tid, h); });
    each([&](int cta, int tid, auto&) { Program::gather(p, smem[cta], cta, tid, [&](int rank) { return &smem[rank]; }); });
  }
  each([&](int cta, int tid, auto& h) { Program::encode(p, Program::kGlobal ? smem[cta].global : nullptr, cta, tid, h); });
}

}  // namespace

void launch_tile(int dtype, int row_format, int col_format, const TileParams& p, void*) {
  launched.push_back("tile");
  if (dtype == kBF16) emulate<InBF16>(row_format, col_format, p);
  else if (dtype == kF16) emulate<InF16>(row_format, col_format, p);
  else emulate<InF32>(row_format, col_format, p);
}

void launch_finalize(const FinalizeParams& p, void*) {
  launched.push_back("finalize");
  for (int64_t i = 0; i < p.n; ++i) finalize_one(p, i);
}

void launch_dbias(const DbiasParams& p, void*) {
  launched.push_back("dbias");
  for (int64_t c = 0; c < p.K; ++c) {
    if (p.dtype == kBF16) dbias_one<InBF16>(p, c);
    else if (p.dtype == kF16) dbias_one<InF16>(p, c);
    else dbias_one<InF32>(p, c);
  }
}

void launch_small_rowwise(int dtype, int format, const SmallRowwiseParams& p, void*) {
  launched.push_back("small_rowwise");
  const bool nv = format == kNV;
  if (dtype == kBF16) nv ? emulate_small_rowwise<InBF16, kNV>(p) : emulate_small_rowwise<InBF16, kMX>(p);
  else if (dtype == kF16) nv ? emulate_small_rowwise<InF16, kNV>(p) : emulate_small_rowwise<InF16, kMX>(p);
  else nv ? emulate_small_rowwise<InF32, kNV>(p) : emulate_small_rowwise<InF32, kMX>(p);
}

void launch_dequantize(const DequantParams& p, void*) {
  launched.push_back("dequantize");
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
  m.def("take_launches", [] { return std::exchange(gq::launched, {}); }, "The launchers called since the last call, by name");
  register_cuda_kernels(m);
}
