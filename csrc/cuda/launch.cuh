// Host-side launch helpers shared by the kernel translation units.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace gq {

// A failed launch (resources, arguments) raises instead of leaving the outputs unwritten.
inline void check_launch(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) throw std::runtime_error(std::string("graphquant ") + what + " kernel: " + cudaGetErrorString(error));
}

}  // namespace gq
