// Tile-program instantiations for bf16 inputs: every (rowwise, columnwise) format pair, and
// the ordered grouped launch's.
#include "tile.cuh"

namespace gq {
GQ_INSTANTIATE_ROW(InBF16, kNone)
GQ_INSTANTIATE_ROW(InBF16, kPerTensor)
GQ_INSTANTIATE_ROW(InBF16, kBlock)
GQ_INSTANTIATE_ROW(InBF16, kRowScaled)
GQ_INSTANTIATE_ROW(InBF16, kMX)
GQ_INSTANTIATE_ROW(InBF16, kNV)
GQ_INSTANTIATE_ORDERED(InBF16)
}  // namespace gq
