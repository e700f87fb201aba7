// graphquant._C: the native extension's Python face.
//
// setup.py builds it only where CUDA can build, so it always carries the CUDA kernels (csrc/cuda),
// which register their entry points here. `cuda_built` tells graphquant.kernels.native the module
// is the real thing (the CPU emulation in tests/emulation says the same and adds `emulated`), and
// `cuda_archs` the compute capabilities (major * 10 + minor) setup.py built the kernels for: each
// an arch-specific target (sm_90a, sm_100a) that runs on its own capability alone.
#include <torch/extension.h>

void register_cuda_kernels(pybind11::module_& m);
void register_bf16_gemm(pybind11::module_& m);
void register_fp8_gemm(pybind11::module_& m);
void register_mixed_gemm(pybind11::module_& m);
void register_block_gemm(pybind11::module_& m);
void register_grouped_gemm(pybind11::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "graphquant native kernels";
  m.attr("cuda_built") = true;
  m.attr("cuda_archs") = pybind11::make_tuple(GRAPHQUANT_CUDA_ARCHS);
  register_cuda_kernels(m);
  register_bf16_gemm(m);
  register_fp8_gemm(m);
  register_mixed_gemm(m);
  register_block_gemm(m);
  register_grouped_gemm(m);
}
