// Tile-program instantiations for f32 inputs: every (rowwise, columnwise) format pair.
#include "tile.cuh"

namespace gq {
GQ_INSTANTIATE_ROW(InF32, kNone)
GQ_INSTANTIATE_ROW(InF32, kPerTensor)
GQ_INSTANTIATE_ROW(InF32, kBlock)
GQ_INSTANTIATE_ROW(InF32, kRowScaled)
GQ_INSTANTIATE_ROW(InF32, kMX)
GQ_INSTANTIATE_ROW(InF32, kNV)
}  // namespace gq
