// graphquant._C.bf16_gemm: out[i] = alpha * (a[i] @ b[i]^T) (+ bias) through cuBLASLt, with bf16
// operands, fp32 accumulation, and alpha read from the device and the optional bias (one vector
// along out's last dim, the same for every batch) added by the epilogue in fp32, so the result is
// rounded once to out_dtype, after alpha and the bias. The emulated low-precision GEMM
// (graphquant/kernels/emulation.py) applies its per-tensor factors this way instead of in extra passes
// over an fp32 product, and without waiting for the device (it can be captured in a CUDA graph).
// The algorithm is blaslt::matmul's choice (blaslt.h).
//
// CUDA only: the CPU emulation of the kernels (tests/emulation) does not build this file.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <sstream>

#include "blaslt.h"

namespace gq {
namespace {

using blaslt::Layout;
using blaslt::MatmulDesc;
using blaslt::set;

// Whether each (rows, cols) matrix of x (batch, rows, cols) is stored row by row.
bool row_major(const at::Tensor& x) { return x.stride(2) == 1 && x.stride(1) >= std::max<int64_t>(x.size(2), 1); }
bool col_major(const at::Tensor& x) { return x.stride(1) == 1 && x.stride(2) >= std::max<int64_t>(x.size(1), 1); }

// x (batch, rows, cols) as cuBLAS's column-major matrices: cols x rows where x is row-major (the
// GEMM then transposes it), rows x cols where it is column-major.
void describe(Layout& layout, const at::Tensor& x, cudaDataType_t type) {
  const bool rm = row_major(x);
  const int64_t rows = x.size(1), cols = x.size(2);
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&layout.raw, type, rm ? cols : rows, rm ? rows : cols,
                                                  rm ? x.stride(1) : x.stride(2)));
  set(layout.raw, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, int32_t(x.size(0)));
  set(layout.raw, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, int64_t(x.stride(0)));
}

// The bias as cuBLASLt's epilogue reads it: bias of d_dtype (the type of its D, which the BIAS
// epilogue of bf16 kernels takes for the bias vector unless told otherwise), converted from bf16
// or fp16 where out is fp32 or fp16 (exactly: both are subsets of fp32).
at::Tensor checked_bias(const at::Tensor& bias, const at::Tensor& a, int64_t n, at::ScalarType out_dtype,
                        at::ScalarType d_dtype) {
  TORCH_CHECK(bias.device() == a.device(), "graphquant.bf16_gemm: the bias must be on the operands' device (", a.device(),
              "), got ", bias.device());
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n, "graphquant.bf16_gemm: the bias must be 1-D of length n = b.shape[1] = ",
              n, " (out's last dim), got shape ", bias.sizes());
  TORCH_CHECK(bias.scalar_type() == at::kBFloat16 || bias.scalar_type() == out_dtype, "graphquant.bf16_gemm: a bias of ",
              bias.scalar_type(), " with out_dtype ", out_dtype, "; accepted are bfloat16 and out_dtype (", out_dtype, ")");
  TORCH_CHECK(bias.is_contiguous(), "graphquant.bf16_gemm: the bias must be contiguous, got stride ", bias.strides());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(bias.data_ptr()) % 16 == 0,
              "graphquant.bf16_gemm: the bias must start at a 16-byte-aligned address, got one ",
              reinterpret_cast<uintptr_t>(bias.data_ptr()) % 16, " bytes past it (a fresh tensor or .clone() is aligned)");
  return bias.scalar_type() == d_dtype ? bias : bias.to(d_dtype);
}

// The caller's out (a slice of a larger product, so that it needs no copy), checked, or a new one.
at::Tensor output(const std::optional<at::Tensor>& out, const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype,
                  at::ScalarType d_dtype) {
  if (!out.has_value()) return at::empty({a.size(0), a.size(1), b.size(1)}, a.options().dtype(d_dtype));
  TORCH_CHECK(out->scalar_type() == d_dtype && d_dtype == out_dtype, "graphquant.bf16_gemm: out must be of out_dtype (",
              out_dtype, "), and bfloat16 or float32 (float16 results are rounded from a float32 product), got ",
              out->scalar_type());
  TORCH_CHECK(out->device() == a.device() && out->dim() == 3 && out->size(0) == a.size(0) && out->size(1) == a.size(1) &&
                  out->size(2) == b.size(1) && row_major(*out),
              "graphquant.bf16_gemm: out must be (batch, m, n) = (", a.size(0), ", ", a.size(1), ", ", b.size(1),
              ") on ", a.device(), " with each matrix stored row by row, got shape ", out->sizes(), " strides ",
              out->strides(), " on ", out->device());
  return *out;
}

at::Tensor bf16_gemm(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& alpha, at::ScalarType out_dtype,
                     const std::optional<at::Tensor>& bias_in, const std::optional<at::Tensor>& out_in) {
  TORCH_CHECK(a_in.dim() == 3 && b_in.dim() == 3 && a_in.size(0) == b_in.size(0) && a_in.size(2) == b_in.size(2),
              "graphquant.bf16_gemm takes a (batch, m, k) and b (batch, n, k), got ", a_in.sizes(), " and ", b_in.sizes());
  TORCH_CHECK(a_in.scalar_type() == at::kBFloat16 && b_in.scalar_type() == at::kBFloat16,
              "graphquant.bf16_gemm takes bfloat16 operands, got ", a_in.scalar_type(), " and ", b_in.scalar_type());
  TORCH_CHECK(a_in.is_cuda() && b_in.device() == a_in.device() && alpha.device() == a_in.device(),
              "graphquant.bf16_gemm: a, b and alpha must be on one CUDA device");
  TORCH_CHECK(alpha.scalar_type() == at::kFloat && alpha.numel() == 1, "graphquant.bf16_gemm: alpha must be one float32 value");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
              "graphquant.bf16_gemm writes bfloat16, float16 or float32, not ", out_dtype);
  const c10::cuda::CUDAGuard guard(a_in.device());
  // cuBLASLt writes bf16 or fp32 from bf16 operands; its epilogue computes alpha * acc (+ bias) in
  // fp32 either way, so an fp16 result is that fp32 value rounded once to fp16.
  const at::ScalarType d_dtype = out_dtype == at::kHalf ? at::kFloat : out_dtype;
  const at::Tensor bias = bias_in.has_value() ? checked_bias(*bias_in, a_in, b_in.size(1), out_dtype, d_dtype) : at::Tensor();
  const at::Tensor a = row_major(a_in) || col_major(a_in) ? a_in : a_in.contiguous();
  const at::Tensor b = row_major(b_in) || col_major(b_in) ? b_in : b_in.contiguous();
  at::Tensor out = output(out_in, a, b, out_dtype, d_dtype);
  if (out.numel() == 0 || a.size(2) == 0) {  // alpha * (an empty sum) + bias
    if (bias.defined()) return out.copy_(bias.expand_as(out)).to(out_dtype);
    return out.zero_().to(out_dtype);
  }

  // Row-major out (m, n) is column-major out^T (n x m) = B (n x k) @ A^T (k x m): cuBLAS's A is
  // our b, its B our a.
  const cudaDataType_t d_type = d_dtype == at::kFloat ? CUDA_R_32F : CUDA_R_16BF;
  MatmulDesc desc;
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescCreate(&desc.raw, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set(desc.raw, CUBLASLT_MATMUL_DESC_TRANSA, row_major(b) ? CUBLAS_OP_T : CUBLAS_OP_N);
  set(desc.raw, CUBLASLT_MATMUL_DESC_TRANSB, row_major(a) ? CUBLAS_OP_N : CUBLAS_OP_T);
  set(desc.raw, CUBLASLT_MATMUL_DESC_POINTER_MODE, CUBLASLT_POINTER_MODE_DEVICE);
  if (bias.defined()) {
    // The BIAS epilogue adds a vector as long as cuBLAS's D has rows, to each of its columns: D is
    // out^T (n x m), so bias[j] goes to out[i, j] for every row i. Its batch stride is 0, so every
    // batch gets the same bias. The heuristic reads the bias pointer for its alignment, so it is
    // set before the query.
    set(desc.raw, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set(desc.raw, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias.const_data_ptr());
    set(desc.raw, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t(d_type));
    set(desc.raw, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, int64_t(0));
  }
  Layout b_layout, a_layout, d_layout;
  describe(b_layout, b, CUDA_R_16BF);
  describe(a_layout, a, CUDA_R_16BF);
  describe(d_layout, out, d_type);

  // With device pointers beta is read from the device too: zero, so out is not read.
  const at::Tensor beta = at::zeros({1}, a.options().dtype(at::kFloat));
  blaslt::Problem p(desc.raw, a, a_layout.raw, b, b_layout.raw, out, d_layout.raw, alpha.const_data_ptr(),
                    beta.const_data_ptr());
  p.key = {0 /* bf16_gemm */, a.size(0), a.size(1), b.size(1), a.size(2), a.stride(0), a.stride(1), a.stride(2),
           b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1), int64_t(d_type), bias.defined() ? int64_t(blaslt::alignment(bias)) : 0};
  p.flops = 2.0 * double(a.size(0)) * double(a.size(1)) * double(b.size(1)) * double(a.size(2));
  p.describe = [&] {
    std::ostringstream s;
    s << "bf16_gemm " << a.size(0) << " x (" << a.size(1) << " x " << a.size(2) << ") @ (" << b.size(1) << " x "
      << b.size(2) << ")^T -> " << (d_dtype == at::kFloat ? "fp32" : "bf16") << (bias.defined() ? ", bias" : "");
    return s.str();
  };
  blaslt::matmul(p);
  return out.to(out_dtype);
}

}  // namespace
}  // namespace gq

void register_bf16_gemm(pybind11::module_& m) {
  m.def("bf16_gemm", &gq::bf16_gemm,
        "out[i] = alpha * (a[i] @ b[i]^T) + bias: bf16 a (batch, m, k) and b (batch, n, k), alpha a float32 "
        "device scalar and bias (optional: None, or n values of bfloat16 or out_dtype, contiguous, 16-byte "
        "aligned, on a's device; the same for every batch) applied in cuBLASLt's epilogue, fp32 "
        "accumulation and epilogue, one rounding to out_dtype (bfloat16, float16 or float32); written into out "
        "(optional: (batch, m, n) of out_dtype, bfloat16 or float32, row-major matrices) if given",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("alpha"), pybind11::arg("out_dtype"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("out") = pybind11::none());
}
