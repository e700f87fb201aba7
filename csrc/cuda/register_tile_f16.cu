// Register tile program instantiations for f16 inputs: every (rowwise, columnwise) format pair.
#include "register_tile.cuh"

namespace gq::register_tile {
template Launcher launcher<InF16, false>(int, int);
}  // namespace gq::register_tile
