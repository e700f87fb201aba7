// The one-launch rowwise quantize of row-scaled FP8 (row_strip.cu), declared for register.cpp.
#pragma once

#include "params.h"

namespace gq {

// A row a warp holds in its registers: 16 16-byte words a lane, rows of up to 4096 2-byte elements.
constexpr int kMaxWords = 16;
constexpr int kMaxColumns = 32 * kMaxWords * 8;

// Row-scaled FP8's rowwise side of x in one launch (p.row: its encoder, the codes written to its
// data and each row's decode scale, 1 / scale, to its scales as float; p.runs and p.group_start
// as the tile programs read them), with p.acc.cols also the per-group column amaxes, max-reduced
// into them. Says whether it took the call (a 2-byte x, K a multiple of 8 up to kMaxColumns,
// 16-byte aligned rows); the tile programs take the others.
bool launch_row_strip(int dtype, const TileParams& p, void* stream);

}  // namespace gq
