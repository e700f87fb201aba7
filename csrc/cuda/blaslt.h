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

// One GEMM, row-major out (m, n) = alpha * (a @ b^T) (beta zero), with its cuBLASLt descriptor and
// layouts. cuBLAS, column-major, computes it as out^T = b @ a^T: its A is our b, its B our a, and
// matmul passes them so.
struct Problem {
  Problem(cublasLtMatmulDesc_t desc, const at::Tensor& a, cublasLtMatrixLayout_t a_layout, const at::Tensor& b,
          cublasLtMatrixLayout_t b_layout, const at::Tensor& out, cublasLtMatrixLayout_t out_layout, const void* alpha,
          const void* beta)
      : desc(desc), a_layout(a_layout), b_layout(b_layout), out_layout(out_layout), a(a), b(b), out(out), alpha(alpha),
        beta(beta) {}

  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a_layout, b_layout, out_layout;
  at::Tensor a, b;
  at::Tensor out;     // written, and digested to compare algorithms bit for bit
  const void* alpha;  // host or device, as desc's pointer mode says
  const void* beta;
  // Everything the heuristic reads besides the pointers' alignments and the device (matmul adds
  // those): the choice is cached under it.
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
