// Host-side launch helpers shared by the kernel translation units.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace gq {

// A failed launch (resources, arguments) raises instead of leaving the outputs unwritten.
inline void check_launch(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) throw std::runtime_error(std::string("graphquant ") + what + " kernel: " + cudaGetErrorString(error));
}

// GRAPHQUANT_DEPENDENT_LAUNCH=0 (read once a process, as triton_launch reads it) makes every launch
// wait for the kernel before it: to measure what the dependent launches gain.
inline bool dependent_launch() {
  static const bool on = [] {
    const char* value = std::getenv("GRAPHQUANT_DEPENDENT_LAUNCH");
    return value == nullptr || std::string(value) != "0";
  }();
  return on;
}

}  // namespace gq
