// Device kernels and launchers for the small programs (finalize, dbias, dequantize, the small
// rowwise quantize) and the dispatch from runtime (dtype, rowwise format, columnwise format) to
// the register tile program where it takes the launch, else to the tile instantiations, which
// live in tile_<dtype>.cu so that they compile in parallel (only declared here).
#include "dequantize.cuh"
#include "finish.cuh"
#include "launch.cuh"
#include "params.h"
#include "register_tile.cuh"
#include "small_rowwise.cuh"

namespace gq {

template <class In, int R, int C>
void launch_tile_t(const TileParams& p, void* stream);  // tile.cuh, instantiated in tile_<dtype>.cu

namespace {

constexpr int kBlockThreads = 256;

unsigned blocks_for(int64_t n) { return unsigned((n + kBlockThreads - 1) / kBlockThreads); }

__global__ void finalize_kernel(const FinalizeParams p) {
  finalize_one(p, int64_t(blockIdx.x) * blockDim.x + threadIdx.x);
}

template <class In>
__global__ void dbias_kernel(const DbiasParams p) {
  dbias_one<In>(p, int64_t(blockIdx.x) * blockDim.x + threadIdx.x);
}

template <class Out>
__global__ void dequantize_kernel(const DequantParams p) {
  dequantize_chunk<Out>(p, int64_t(blockIdx.x) * blockDim.x + threadIdx.x);
}

using TileLauncher = void (*)(const TileParams&, void*);

template <class In, int R>
constexpr TileLauncher kRowLaunchers[kNumFormats] = {
    &launch_tile_t<In, R, kNone>, &launch_tile_t<In, R, kPerTensor>, &launch_tile_t<In, R, kBlock>,
    &launch_tile_t<In, R, kRowScaled>, &launch_tile_t<In, R, kMX>, &launch_tile_t<In, R, kNV>};

template <class In>
TileLauncher tile_launcher(int row_format, int col_format) {
  switch (row_format) {
    case kNone: return kRowLaunchers<In, kNone>[col_format];
    case kPerTensor: return kRowLaunchers<In, kPerTensor>[col_format];
    case kBlock: return kRowLaunchers<In, kBlock>[col_format];
    case kRowScaled: return kRowLaunchers<In, kRowScaled>[col_format];
    case kMX: return kRowLaunchers<In, kMX>[col_format];
    default: return kRowLaunchers<In, kNV>[col_format];
  }
}

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace

void launch_tile(int dtype, int row_format, int col_format, const TileParams& p, void* stream) {
  if (launch_register_tile(dtype, row_format, col_format, p, stream)) return;
  const TileLauncher launch = dtype == kBF16  ? tile_launcher<InBF16>(row_format, col_format)
                              : dtype == kF16 ? tile_launcher<InF16>(row_format, col_format)
                                              : tile_launcher<InF32>(row_format, col_format);
  launch(p, stream);
}

void launch_finalize(const FinalizeParams& p, void* stream) {
  if (p.n <= 0) return;
  finalize_kernel<<<blocks_for(p.n), kBlockThreads, 0, as_stream(stream)>>>(p);
  check_launch("finalize");
}

void launch_dbias(const DbiasParams& p, void* stream) {
  if (p.K <= 0) return;
  const unsigned blocks = blocks_for(p.K);
  if (p.dtype == kBF16) dbias_kernel<InBF16><<<blocks, kBlockThreads, 0, as_stream(stream)>>>(p);
  else if (p.dtype == kF16) dbias_kernel<InF16><<<blocks, kBlockThreads, 0, as_stream(stream)>>>(p);
  else dbias_kernel<InF32><<<blocks, kBlockThreads, 0, as_stream(stream)>>>(p);
  check_launch("dbias");
}

void launch_dequantize(const DequantParams& p, void* stream) {
  const int64_t chunks = p.rows * ((p.cols + 15) / 16);
  if (chunks <= 0) return;
  const unsigned blocks = blocks_for(chunks);
  if (p.out_dtype == kBF16) dequantize_kernel<InBF16><<<blocks, kBlockThreads, 0, as_stream(stream)>>>(p);
  else if (p.out_dtype == kF16) dequantize_kernel<InF16><<<blocks, kBlockThreads, 0, as_stream(stream)>>>(p);
  else dequantize_kernel<InF32><<<blocks, kBlockThreads, 0, as_stream(stream)>>>(p);
  check_launch("dequantize");
}

void launch_small_rowwise(int dtype, int format, const SmallRowwiseParams& p, void* stream) {
  const bool nv = format == kNV;
  if (dtype == kBF16) nv ? launch_small_rowwise_t<InBF16, kNV>(p, stream) : launch_small_rowwise_t<InBF16, kMX>(p, stream);
  else if (dtype == kF16) nv ? launch_small_rowwise_t<InF16, kNV>(p, stream) : launch_small_rowwise_t<InF16, kMX>(p, stream);
  else nv ? launch_small_rowwise_t<InF32, kNV>(p, stream) : launch_small_rowwise_t<InF32, kMX>(p, stream);
}

}  // namespace gq
