// cuBLASLt plumbing shared by graphquant's GEMMs (bf16_gemm.cpp, fp8_gemm.cpp): descriptors owned
// by their scope, typed attribute setters, pointer alignment, and `matmul`, which runs a described
// GEMM with the fastest of cuBLASLt's candidate algorithms that write the same bits as the
// heuristic's first choice (blaslt_tuner.cpp), so that the choice, made from timings, never
// changes a result.
//
// CUDA only: the CPU emulation of the kernels (tests/emulation) does not build these files.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/Exceptions.h>
#include <cublasLt.h>

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

namespace gq::blaslt {

// A cuBLASLt descriptor, destroyed with its scope.
template <typename T, cublasStatus_t (*Destroy)(T)>
struct Owned {
  T raw = nullptr;
  Owned() = default;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() {
    if (raw) Destroy(raw);
  }
};
using MatmulDesc = Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using Layout = Owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;

template <typename V>
void set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, V value) {
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}
template <typename V>
void set(cublasLtMatrixLayout_t d, cublasLtMatrixLayoutAttribute_t attr, V value) {
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutSetAttribute(d, attr, &value, sizeof(value)));
}

// The largest power of two (up to 256) dividing t's address: unless told, cuBLASLt assumes 256
// and may pick kernels that an offset view does not fit.
uint32_t alignment(const at::Tensor& t);

// One GEMM as cuBLASLt sees it: D = alpha * op(A) op(B) + beta * D, beta zero (C is D).
struct Problem {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  const void* a_data = nullptr;
  const void* b_data = nullptr;
  const void* alpha = nullptr;  // host or device, as desc's pointer mode says
  const void* beta = nullptr;
  at::Tensor out;  // D: written, and digested to compare algorithms bit for bit
  uint32_t align_a = 256, align_b = 256;
  // Everything the heuristic reads besides the alignments and the device (matmul adds those):
  // the choice is cached under it.
  std::vector<int64_t> key;
  double flops = 0;
  std::function<std::string()> describe;  // the GEMM in words, for errors and the choices table
};

// Runs p with the algorithm chosen for its key: on first sight (outside CUDA graph capture) each
// of cuBLASLt's candidates runs once and is kept if its output's digest equals the first's, and the
// kept ones are timed; the fastest is cached. Small GEMMs take the heuristic's first.
void matmul(const Problem& p);

// The choices made so far: (GEMM, candidates, bit-identical candidates, index chosen, us of the
// heuristic's first, us of the chosen, chosen tile id, stages id, cluster shape id).
using Choice = std::tuple<std::string, int64_t, int64_t, int64_t, double, double, int64_t, int64_t, int64_t>;
std::vector<Choice> choices();

// A digest of t's bytes and their positions (one int64 on t's device), by which matmul tells
// whether two algorithms wrote the same output without keeping a second copy of it.
at::Tensor bits_digest(const at::Tensor& t);

}  // namespace gq::blaslt
