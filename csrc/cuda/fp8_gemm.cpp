// graphquant._C.fp8_gemm: out (m, n) = scale_a * scale_b * (a @ b^T) (+ bias) for FP8 a (m, k) and
// b (n, k) stored with the reduction dim contiguous (Hopper's TN layout), the scales read from the
// device (per tensor, or per row of a and of b: cuBLASLt's outer-vector scaling), fp32 accumulation
// (the tensor cores' own with fast_accum, else promoted to fp32 registers every few steps) and one
// rounding to out_dtype. Per tensor, the GEMM torch._scaled_mm runs for tensorwise scales, with the
// algorithm chosen by blaslt::matmul (blaslt.h) instead of the heuristic's first: the same bits,
// faster where cuBLASLt has a faster kernel for the shape. Per row, cuBLASLt's GEMM where
// torch._scaled_mm runs CUTLASS's, slower from 1000 rows on the H200 (neither splits K under
// per-row scales: graphquant.kernels.scaled_mm.per_row_scaled_after).
//
// CUDA only: the CPU emulation of the kernels (tests/emulation) does not build this file.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <optional>
#include <sstream>

#include "blaslt.h"

namespace gq {
namespace {

using blaslt::set;

cudaDataType_t fp8_type(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat8_e4m3fn ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}

const char* fp8_name(const at::Tensor& t) { return t.scalar_type() == at::kFloat8_e4m3fn ? "e4m3" : "e5m2"; }

bool fp8(const at::Tensor& t) { return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2; }

// An operand (rows, k) with k contiguous and a leading stride of whole 16-byte groups, as
// cuBLASLt's FP8 kernels read it.
void check_operand(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(1) == 1 && t.stride(0) >= t.size(1) && t.stride(0) % 16 == 0,
              "graphquant.fp8_gemm: ", name, " must be stored with its last (reduction) dim contiguous and a row stride ",
              "that is a multiple of 16 elements, got shape ", t.sizes(), " strides ", t.strides());
}

at::Tensor fp8_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                    at::ScalarType out_dtype, bool fast_accum, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1),
              "graphquant.fp8_gemm takes a (m, k) and b (n, k), got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(fp8(a) && fp8(b) && !(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2),
              "graphquant.fp8_gemm multiplies float8_e4m3fn by float8_e4m3fn or float8_e5m2 (either side), got ",
              a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.is_cuda() && b.device() == a.device() && scale_a.device() == a.device() && scale_b.device() == a.device(),
              "graphquant.fp8_gemm: a, b and the scales must be on one CUDA device");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
              "graphquant.fp8_gemm writes bfloat16, float16 or float32, not ", out_dtype);
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  const bool per_row = scale_a.numel() != 1 || scale_b.numel() != 1;
  TORCH_CHECK(scale_a.scalar_type() == at::kFloat && scale_b.scalar_type() == at::kFloat && scale_a.is_contiguous() &&
                  scale_b.is_contiguous() &&
                  (per_row ? scale_a.numel() == m && scale_b.numel() == n : scale_a.numel() == 1 && scale_b.numel() == 1),
              "graphquant.fp8_gemm takes contiguous float32 scales, one value each (per tensor) or ", m, " for a and ",
              n, " for b (per row), got ", scale_a.scalar_type(), " of ", scale_a.numel(), " and ", scale_b.scalar_type(),
              " of ", scale_b.numel());
  if (bias.has_value()) {
    TORCH_CHECK(out_dtype != at::kFloat && bias->scalar_type() == out_dtype && bias->dim() == 1 && bias->size(0) == n &&
                    bias->is_contiguous() && bias->device() == a.device(),
                "graphquant.fp8_gemm: the epilogue adds a contiguous bias of out_dtype, bfloat16 or float16, and shape (",
                n, ",) on ", a.device(), "; got ", bias->scalar_type(), " of shape ", bias->sizes(), " on ", bias->device(),
                " with out_dtype ", out_dtype);
  }
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  if (k == 0) return bias.has_value() ? out.copy_(bias->expand_as(out)) : out.zero_();
  check_operand(a, "a");
  check_operand(b, "b");

  // Row-major out (m, n) is column-major out^T (n x m) = B (n x k) @ A^T (k x m): cuBLAS's A is
  // our b (transposed: its k x n column-major storage read as n x k), its B our a.
  const cudaDataType_t d_type = out_dtype == at::kFloat ? CUDA_R_32F : out_dtype == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
  blaslt::MatmulDesc desc;
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescCreate(&desc.raw, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set(desc.raw, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set(desc.raw, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  set(desc.raw, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scale_b.const_data_ptr());
  set(desc.raw, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scale_a.const_data_ptr());
  set(desc.raw, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(fast_accum));
  if (per_row) {  // cuBLAS's A (our b) scaled along its n rows, its B (our a) along its m columns
    set(desc.raw, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F));
    set(desc.raw, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F));
  }
  if (bias.has_value()) {  // bias[j] to every out[i, j]: along the rows of cuBLAS's D (out^T)
    set(desc.raw, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set(desc.raw, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias->const_data_ptr());
    set(desc.raw, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t(d_type));
  }
  blaslt::Layout a_layout, b_layout, d_layout;
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&b_layout.raw, fp8_type(b), k, n, b.stride(0)));
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&a_layout.raw, fp8_type(a), k, m, a.stride(0)));
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&d_layout.raw, d_type, n, m, n));

  const float alpha = 1.0f, beta = 0.0f;
  blaslt::Problem p(desc.raw, a, a_layout.raw, b, b_layout.raw, out, d_layout.raw, &alpha, &beta);
  p.key = {1 /* fp8_gemm */, m, n, k, a.stride(0), b.stride(0), int64_t(fp8_type(a)), int64_t(fp8_type(b)),
           int64_t(d_type), fast_accum, bias.has_value() ? int64_t(blaslt::alignment(*bias)) : 0, per_row};
  p.flops = 2.0 * double(m) * double(n) * double(k);
  p.describe = [&] {
    std::ostringstream s;
    s << "fp8_gemm " << fp8_name(a) << " (" << m << " x " << k << ") @ " << fp8_name(b) << " (" << n << " x " << k
      << ")^T -> " << c10::toString(out_dtype) << (per_row ? ", per-row scales" : "") << (fast_accum ? ", fast accumulation" : "")
      << (bias.has_value() ? ", bias" : "");
    return s.str();
  };
  blaslt::matmul(p);
  return out;
}

}  // namespace
}  // namespace gq

void register_fp8_gemm(pybind11::module_& m) {
  m.def("fp8_gemm", &gq::fp8_gemm,
        "out (m, n) = scale_a * scale_b * (a @ b^T) + bias: FP8 a (m, k) and b (n, k) with k contiguous (e4m3 x "
        "e4m3, or e5m2 on one side), float32 device scales scale_a and scale_b (one value each, or m and n: per "
        "row), fp32 accumulation (fast_accum: "
        "the tensor cores' own), bias (optional: n values of out_dtype, bfloat16 or float16) in the epilogue, "
        "one rounding to out_dtype (bfloat16, float16 or float32); the fastest cuBLASLt algorithm that writes "
        "the heuristic's first's bits",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("scale_a"), pybind11::arg("scale_b"),
        pybind11::arg("out_dtype"), pybind11::arg("fast_accum"), pybind11::arg("bias") = pybind11::none());
  m.def(
      "gemm_algorithms",
      [] { return gq::blaslt::choices(); },
      "the cuBLASLt algorithm chosen for each GEMM shape seen so far: (GEMM, candidates, candidates writing the "
      "heuristic's first's bits, index chosen, us of the heuristic's first, us of the chosen (0 where not timed), "
      "tile id, stages id, cluster shape id)");
}
