// blaslt::bits_digest: a position-dependent digest of a tensor's bytes, so that the cuBLASLt
// algorithm choice (blaslt_tuner.cpp) can tell whether two algorithms wrote the same output
// without keeping a second copy of it. Two different outputs share a digest with probability
// about 2^-64.
#include <ATen/cuda/CUDAContext.h>

#include "blaslt.h"
#include "launch.cuh"

namespace gq::blaslt {
namespace {

constexpr int kThreads = 256;

// splitmix64's finalizer: every input bit moves every output bit.
__device__ uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Sum (mod 2^64) of mix(position, 16-bit word) over the words.
__global__ void digest_kernel(const uint16_t* words, int64_t n, unsigned long long* digest) {
  uint64_t sum = 0;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    sum += mix((uint64_t(i) << 16) | words[i]);
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) atomicAdd(digest, (unsigned long long)sum);
}

}  // namespace

at::Tensor bits_digest(const at::Tensor& any) {
  const at::Tensor t = any.contiguous();
  TORCH_CHECK(t.is_cuda() && t.nbytes() % 2 == 0, "graphquant bits_digest: a CUDA tensor of whole 16-bit words");
  at::Tensor digest = at::zeros({1}, t.options().dtype(at::kLong));
  const int64_t n = int64_t(t.nbytes() / 2);
  if (n == 0) return digest;
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int blocks = int(std::min<int64_t>(wanted, int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 8));
  digest_kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint16_t*>(t.const_data_ptr()), n, reinterpret_cast<unsigned long long*>(digest.data_ptr<int64_t>()));
  check_launch("bits digest");
  return digest;
}

}  // namespace gq::blaslt
