// graphquant._C: the native extension's Python face.
//
// The host side always builds; CUDA kernels (csrc/cuda) register their entry points here when the
// extension is compiled with GRAPHQUANT_WITH_CUDA. graphquant.kernels.native reads `cuda_built` to decide
// whether the native path exists at all.
#include <torch/extension.h>

#ifdef GRAPHQUANT_WITH_CUDA
void register_cuda_kernels(pybind11::module_& m);
void register_bf16_gemm(pybind11::module_& m);
void register_fp8_gemm(pybind11::module_& m);
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "graphquant native kernels";
#ifdef GRAPHQUANT_WITH_CUDA
  m.attr("cuda_built") = true;
  register_cuda_kernels(m);
  register_bf16_gemm(m);
  register_fp8_gemm(m);
#else
  m.attr("cuda_built") = false;
#endif
}
