// Register tile program instantiations for bf16 inputs: every (rowwise, columnwise) format pair.
#include "register_tile.cuh"

namespace gq::register_tile {
template Launcher launcher<InBF16, false>(int, int);
}  // namespace gq::register_tile
