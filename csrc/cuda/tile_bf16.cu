// Tile-program instantiations for bf16 inputs: every (rowwise, columnwise) format pair.
#include "tile.cuh"

namespace gq {
GQ_INSTANTIATE_ROW(InBF16, kNone)
GQ_INSTANTIATE_ROW(InBF16, kPerTensor)
GQ_INSTANTIATE_ROW(InBF16, kBlock)
GQ_INSTANTIATE_ROW(InBF16, kRowScaled)
GQ_INSTANTIATE_ROW(InBF16, kMX)
GQ_INSTANTIATE_ROW(InBF16, kNV)
}  // namespace gq
