// Register tile program instantiations for bf16 inputs whose column side reads the dequantized
// rowwise values: every pair with both sides.
#include "register_tile.cuh"

namespace gq::register_tile {
template Launcher launcher<InBF16, true>(int, int);
}  // namespace gq::register_tile
