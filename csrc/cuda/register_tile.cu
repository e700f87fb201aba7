// The register tile program's instantiations (2-byte inputs, each direction's format or none)
// and the test of whether it takes a launch.
#include <climits>
#include <cstdlib>
#include <string>

#include "launch.cuh"
#include "register_tile.cuh"

namespace gq {

namespace {

using Launcher = void (*)(const TileParams&, void*);

// The formats the program encodes (a direction may be none), in the order of the tables below;
// -1: not one of them.
int slot_of(int format) {
  return format == kPerTensor ? 0 : format == kBlock ? 1 : format == kMX ? 2 : format == kNV ? 3 : format == kNone ? 4 : -1;
}

template <class In, int R, int C>
constexpr Launcher launcher_of() {
  if constexpr (R == kNone && C == kNone) return nullptr;  // nothing to encode: never launched
  else return &register_tile::launch<In, R, C>;
}

template <class In, int R>
constexpr Launcher kLaunchers[5] = {launcher_of<In, R, kPerTensor>(), launcher_of<In, R, kBlock>(), launcher_of<In, R, kMX>(),
                                    launcher_of<In, R, kNV>(), launcher_of<In, R, kNone>()};

template <class In>
Launcher launcher(int row_slot, int col_slot) {
  switch (row_slot) {
    case 0: return kLaunchers<In, kPerTensor>[col_slot];
    case 1: return kLaunchers<In, kBlock>[col_slot];
    case 2: return kLaunchers<In, kMX>[col_slot];
    case 3: return kLaunchers<In, kNV>[col_slot];
    default: return kLaunchers<In, kNone>[col_slot];
  }
}

// GRAPHQUANT_REGISTER_TILE=0 sends every launch to the generic tile program (the same bits): to
// compare the two (benchmarks/quantize.py), or to rule this program out.
bool enabled() {
  static const bool on = [] {
    const char* value = std::getenv("GRAPHQUANT_REGISTER_TILE");
    return value == nullptr || std::string(value) != "0";
  }();
  return on;
}

}  // namespace

bool launch_register_tile(int dtype, int row_format, int col_format, const TileParams& p, void* stream) {
  const int r = slot_of(row_format), c = slot_of(col_format);
  const bool whole_tiles = p.M > 0 && p.K > 0 && p.M % register_tile::kTile == 0 && p.K % register_tile::kTile == 0 &&
                           (p.M / register_tile::kTile) * (p.K / register_tile::kTile) <= INT32_MAX;
  // None of what only the generic program does: dequantized sources, transforms of 16x16 blocks, groups, dbias,
  // per-row or per-column amaxes, unaligned rows, pre-passes, directions without an output, and
  // random bits whose index passes 2^32 (which would take a second stream).
  const bool stochastic = (row_format == kNV && p.row.sr) || (col_format == kNV && p.col.sr);
  const bool transform_here = col_format == kNV && !p.col.two_d && p.acc.col_global == nullptr;  // a 1x16 chunk in two lanes
  const bool options = p.main && !p.dq_source && (!p.col_rht || transform_here) && p.vec_load && p.group_start == nullptr &&
                       p.dbias_partial == nullptr && p.acc.rows == nullptr && p.acc.cols == nullptr &&
                       !(row_format == kNV && p.row.row_scaled) && !(stochastic && uint64_t(p.M) * uint64_t(p.K) > (1ull << 32)) &&
                       (row_format == kNone || p.row.data != nullptr) && (col_format == kNone || p.col.data != nullptr);
  const bool formats = r >= 0 && c >= 0 && !(row_format == kNone && col_format == kNone);
  if (!enabled() || !formats || (dtype != kBF16 && dtype != kF16) || !whole_tiles || !options) return false;
  const Launcher launch = dtype == kBF16 ? launcher<InBF16>(r, c) : launcher<InF16>(r, c);
  launch(p, stream);
  check_launch("quantize");
  return true;
}

}  // namespace gq
