// Whether the register tile program takes a launch; its kernels are instantiated in
// register_tile_<dtype>[_dequantized].cu, so that they compile in parallel (only declared here).
#include <climits>
#include <cstdlib>
#include <string>

#include "launch.cuh"
#include "register_tile.cuh"

namespace gq {

namespace register_tile {
extern template Launcher launcher<InBF16, false>(int, int);
extern template Launcher launcher<InF16, false>(int, int);
extern template Launcher launcher<InBF16, true>(int, int);
extern template Launcher launcher<InF16, true>(int, int);
}  // namespace register_tile

namespace {

using register_tile::slot_of;

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
  // None of what only the generic program does: transforms of 16x16 blocks, groups and runs of rows
  // but for formats scaled a group (or its rows or columns) at a time from x itself, dbias, per-row
  // or per-column amaxes, unaligned rows, pre-passes (but a dequantized source's column amax
  // without a transform), directions without an output (a dequantized source's rowwise one
  // included), and random bits whose index passes 2^32 (which would take a second stream).
  const bool stochastic = (row_format == kNV && p.row.sr) || (col_format == kNV && p.col.sr);
  const bool transform_here = col_format == kNV && !p.col.two_d && p.acc.col_global == nullptr;  // a 1x16 chunk in two lanes
  const bool dq_amax = p.dq_source && col_format == kNone;  // kAmaxPass: no rows stored
  const bool pass = dq_amax ? !p.main && !p.col_rht && !(row_format == kNV && p.row.sr) && p.acc.col_global != nullptr &&
                                  p.acc.row_global == nullptr
                            : p.main;
  using register_tile::group_scaled;
  const bool grouped = p.group_start != nullptr || p.runs != nullptr || p.rows != nullptr;
  const bool options = pass && (!p.col_rht || transform_here) && p.vec_load &&
                       (!grouped || (!p.dq_source && group_scaled(row_format) && group_scaled(col_format))) &&
                       p.dbias_partial == nullptr && p.acc.rows == nullptr && p.acc.cols == nullptr &&
                       !(stochastic && uint64_t(p.M) * uint64_t(p.K) > (1ull << 32)) &&
                       (row_format == kNone || p.row.data != nullptr || dq_amax) && (col_format == kNone || p.col.data != nullptr);
  // FP8 blocks here are 128 long (or 128x128), their column side stored transposed, as row-scaled FP8's.
  const bool blocks = (row_format != kBlock || p.row.block_chunks == 8) &&
                      (col_format != kBlock || (p.col.block_chunks == 8 && p.col.transposed)) &&
                      (col_format != kRowScaled || p.col.transposed);
  const bool formats = r >= 0 && c >= 0 && blocks;  // none and none: no kernel (launcher gives null)
  if (!enabled() || !formats || (dtype != kBF16 && dtype != kF16) || !whole_tiles || !options) return false;
  const bool dq = p.dq_source;
  const register_tile::Launcher launch = dtype == kBF16 ? (dq ? register_tile::launcher<InBF16, true>(r, c) : register_tile::launcher<InBF16, false>(r, c))
                                                        : (dq ? register_tile::launcher<InF16, true>(r, c) : register_tile::launcher<InF16, false>(r, c));
  if (launch == nullptr) return false;
  launch(p, stream);
  check_launch("quantize");
  return true;
}

}  // namespace gq
