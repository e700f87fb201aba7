// graphquant._C.bf16_gemm: out[i] = alpha * (a[i] @ b[i]^T) through cuBLASLt, with bf16 operands,
// fp32 accumulation and alpha read from the device by the epilogue, so the product is rounded
// once, after alpha. The emulated low-precision GEMM (graphquant/emulation.py) applies its
// per-tensor factors this way instead of in extra passes over an fp32 product, and without
// waiting for the device (it can be captured in a CUDA graph).
//
// CUDA only: the CPU emulation of the kernels (tests/emulation) does not build this file.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <algorithm>

namespace gq {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // what cuBLAS takes on Hopper

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
using Preference = Owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

template <typename V>
void set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, V value) {
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}
template <typename V>
void set(cublasLtMatrixLayout_t d, cublasLtMatrixLayoutAttribute_t attr, V value) {
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutSetAttribute(d, attr, &value, sizeof(value)));
}
template <typename V>
void set(cublasLtMatmulPreference_t d, cublasLtMatmulPreferenceAttributes_t attr, V value) {
  TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d, attr, &value, sizeof(value)));
}

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

// The largest power of two (up to 256) dividing t's address: unless told, cuBLASLt assumes 256
// and may pick kernels that an offset view does not fit.
uint32_t alignment(const at::Tensor& t) {
  const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
  uint32_t a = 1;
  while (a < 256 && address % (2 * a) == 0) a *= 2;
  return a;
}

at::Tensor bf16_gemm(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& alpha, at::ScalarType out_dtype) {
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
  const at::Tensor a = row_major(a_in) || col_major(a_in) ? a_in : a_in.contiguous();
  const at::Tensor b = row_major(b_in) || col_major(b_in) ? b_in : b_in.contiguous();
  // cuBLASLt writes bf16 or fp32 from bf16 operands; its epilogue computes alpha * acc in fp32
  // either way, so an fp16 result is that fp32 value rounded once to fp16.
  const at::ScalarType d_dtype = out_dtype == at::kHalf ? at::kFloat : out_dtype;
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(1)}, a.options().dtype(d_dtype));
  if (out.numel() == 0 || a.size(2) == 0) return out.zero_().to(out_dtype);

  // Row-major out (m, n) is column-major out^T (n x m) = B (n x k) @ A^T (k x m): cuBLAS's A is
  // our b, its B our a.
  const cudaDataType_t d_type = d_dtype == at::kFloat ? CUDA_R_32F : CUDA_R_16BF;
  MatmulDesc desc;
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescCreate(&desc.raw, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set(desc.raw, CUBLASLT_MATMUL_DESC_TRANSA, row_major(b) ? CUBLAS_OP_T : CUBLAS_OP_N);
  set(desc.raw, CUBLASLT_MATMUL_DESC_TRANSB, row_major(a) ? CUBLAS_OP_N : CUBLAS_OP_T);
  set(desc.raw, CUBLASLT_MATMUL_DESC_POINTER_MODE, CUBLASLT_POINTER_MODE_DEVICE);
  Layout b_layout, a_layout, d_layout;
  describe(b_layout, b, CUDA_R_16BF);
  describe(a_layout, a, CUDA_R_16BF);
  describe(d_layout, out, d_type);

  Preference preference;
  TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference.raw));
  set(preference.raw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(kWorkspaceBytes));
  set(preference.raw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(b));
  set(preference.raw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(a));
  set(preference.raw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(out));
  set(preference.raw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(out));
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, desc.raw, b_layout.raw, a_layout.raw, d_layout.raw,
                                                               d_layout.raw, preference.raw, 1, &heuristic, &found);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS && found > 0, "graphquant.bf16_gemm: cuBLASLt has no algorithm (",
              at::cuda::blas::_cublasGetErrorEnum(status), ") for a ", a.sizes(), " strides ", a.strides(), " and b ",
              b.sizes(), " strides ", b.strides(), " to ", d_dtype);

  // With device pointers, beta is read from the device too; zero, so out is not read.
  const at::Tensor beta = at::zeros({1}, alpha.options());
  const at::Tensor workspace = at::empty({int64_t(kWorkspaceBytes)}, a.options().dtype(at::kByte));
  TORCH_CUDABLAS_CHECK(cublasLtMatmul(handle, desc.raw, alpha.data_ptr(), b.data_ptr(), b_layout.raw, a.data_ptr(),
                                      a_layout.raw, beta.data_ptr(), out.data_ptr(), d_layout.raw, out.data_ptr(),
                                      d_layout.raw, &heuristic.algo, workspace.data_ptr(), kWorkspaceBytes,
                                      at::cuda::getCurrentCUDAStream()));
  return out.to(out_dtype);
}

}  // namespace
}  // namespace gq

void register_blaslt_gemm(pybind11::module_& m) {
  m.def("bf16_gemm", &gq::bf16_gemm,
        "out[i] = alpha * (a[i] @ b[i]^T): bf16 a (batch, m, k) and b (batch, n, k), alpha a float32 device "
        "scalar applied in cuBLASLt's epilogue, fp32 accumulation, one rounding to out_dtype",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("alpha"), pybind11::arg("out_dtype"));
}
