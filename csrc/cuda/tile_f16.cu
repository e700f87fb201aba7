// Tile-program instantiations for f16 inputs: every (rowwise, columnwise) format pair.
#include "tile.cuh"

namespace gq {
GQ_INSTANTIATE_ROW(InF16, kNone)
GQ_INSTANTIATE_ROW(InF16, kPerTensor)
GQ_INSTANTIATE_ROW(InF16, kBlock)
GQ_INSTANTIATE_ROW(InF16, kRowScaled)
GQ_INSTANTIATE_ROW(InF16, kMX)
GQ_INSTANTIATE_ROW(InF16, kNV)
}  // namespace gq
