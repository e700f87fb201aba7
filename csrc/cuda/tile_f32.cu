// Tile-program instantiations for f32 inputs: every (rowwise, columnwise) format pair, and
// the ordered grouped launch's.
#include "tile.cuh"

namespace gq {
GQ_INSTANTIATE_ROW(InF32, kNone)
GQ_INSTANTIATE_ROW(InF32, kPerTensor)
GQ_INSTANTIATE_ROW(InF32, kBlock)
GQ_INSTANTIATE_ROW(InF32, kRowScaled)
GQ_INSTANTIATE_ROW(InF32, kMX)
GQ_INSTANTIATE_ROW(InF32, kNV)
GQ_INSTANTIATE_ORDERED(InF32)
}  // namespace gq
