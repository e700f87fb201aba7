// graphquant._C's kernel entry points: allocate the outputs, run the passes a quantize needs
// (amax pre-pass, scale finalize, the fused tile pass, the dbias reduction; or a small input's
// rowwise NVFP4 or MXFP8 alone, in one launch) on the current stream, and hand the tensors back to
// graphquant/kernels/native.py, which wraps them into Representations. Nothing here waits for
// the device.
//
// Built with the CUDA kernels, or with GRAPHQUANT_EMULATE against a CPU build of the same
// programs (tests/emulation), where the launchers run the kernels thread by thread.
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "params.h"
#include "row_strip.h"

#ifndef GRAPHQUANT_EMULATE
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace gq {
namespace {

// One direction's encoding, built once per graphquant.quantizers.KernelEncoding from keyword
// arguments of the same names (graphquant/kernels/native.py), and checked for what the tile
// program encodes: its blocks nest in a 128x128 tile.
struct Encoding {
  int format = kNone;
  int fp8 = 0;  // Fp8Kind (E2M1's 0 is unused)
  int64_t block_rows = 0, block_cols = 0;
  int two_d = 0, block_chunks = 8;
  bool transposed = false, delayed = false, pow2 = false, rht = false, sign_mask = false, sr = false, row_scaled = false;
  float epsilon = 0;
};

template <size_t N>
int code_of(const std::pair<const char*, int> (&names)[N], const std::string& name, const char* field) {
  std::string known;
  for (const auto& entry : names) {
    if (name == entry.first) return entry.second;
    known += std::string(known.empty() ? "" : ", ") + "'" + entry.first + "'";
  }
  TORCH_CHECK(false, "graphquant.Encoding: ", field, " must be one of ", known, ", got '", name, "'");
}

Encoding make_encoding(const std::string& scaling, const std::string& element, std::pair<int64_t, int64_t> block, bool transposed,
                       bool delayed_scaling, double amax_epsilon, bool pow2_scales, bool hadamard, bool random_sign_mask,
                       bool stochastic_rounding, bool row_scaled) {
  static const std::pair<const char*, int> kScalings[] = {
      {"tensor", kPerTensor}, {"row", kRowScaled}, {"block", kBlock}, {"mxfp8", kMX}, {"nvfp4", kNV}};
  static const std::pair<const char*, int> kElements[] = {{"e4m3", 0}, {"e5m2", 1}, {"e2m1", 0}};
  Encoding e;
  e.format = code_of(kScalings, scaling, "scaling");
  e.fp8 = code_of(kElements, element, "element");
  TORCH_CHECK((element == "e2m1") == (e.format == kNV), "graphquant.Encoding: nvfp4 scaling encodes e2m1, the others FP8, got ",
              scaling, " of ", element);
  e.block_rows = block.first;
  e.block_cols = block.second;
  const int64_t length = std::max(block.first, block.second);
  const bool square = block.first == block.second, line = std::min(block.first, block.second) == 1;
  const bool nests = e.format == kBlock ? (square ? length == 128 : line && length % 16 == 0 && 128 % length == 0)
                     : e.format == kMX  ? line && length == 32
                     : e.format == kNV  ? (square || line) && length == 16
                                        : true;
  TORCH_CHECK(nests, "graphquant.Encoding: the tile program has no ", scaling, " blocks of ", block.first, "x", block.second);
  e.two_d = (e.format == kBlock || e.format == kNV) && square;
  if (e.format == kBlock && !square) e.block_chunks = int(length / 16);
  e.transposed = transposed;
  e.delayed = delayed_scaling;
  e.epsilon = float(amax_epsilon);
  e.pow2 = pow2_scales;
  e.rht = hadamard;
  e.sign_mask = random_sign_mask;
  e.sr = stochastic_rounding;
  e.row_scaled = row_scaled;
  return e;
}

// One side of a launch: its encoding's options and the tile program's encoder.
struct Config {
  int format = kNone;
  bool delayed = false, rht = false, sign_mask = false;
  Encoder enc;
};

// The side's encoder, with this call's stochastic-rounding key; checks that the encoding is one
// this side makes: blocks along its dim (rows, or columns on the column side), and data stored
// transposed on the column side only (by every format but MXFP8 there, and FP8 blocks either way).
Config config(const Encoding* e, int64_t key, bool column_side) {
  Config c;
  if (e == nullptr) return c;
  const char* side = column_side ? "columnwise" : "rowwise";
  const bool blocked = e->format == kBlock || e->format == kMX || e->format == kNV;
  TORCH_CHECK(!blocked || e->two_d || (column_side ? e->block_cols : e->block_rows) == 1, "graphquant.quantize: ", side,
              " blocks run along the ", column_side ? "columns" : "rows", ", got ", e->block_rows, "x", e->block_cols);
  const bool either = e->format == kBlock, transposes = column_side && e->format != kMX;
  TORCH_CHECK(e->transposed == transposes || (column_side && either), "graphquant.quantize: the ", side, " side ",
              transposes ? "stores this format transposed" : "keeps this format untransposed", ", got transposed=", e->transposed);
  TORCH_CHECK(!e->rht || column_side, "graphquant.quantize: the Hadamard transform is on the columnwise side only");
  TORCH_CHECK(!e->row_scaled || !column_side, "graphquant.quantize: row_scaled is the rowwise side's (a global amax per row)");
  c.format = e->format;
  c.delayed = e->delayed;
  c.rht = e->rht;
  c.sign_mask = e->sign_mask;
  c.enc.fp8 = e->fp8;
  c.enc.epsilon = e->epsilon;
  c.enc.pow2 = e->pow2;
  c.enc.two_d = e->two_d;
  c.enc.block_chunks = e->block_chunks;
  c.enc.transposed = e->transposed;
  c.enc.sr = e->sr;
  c.enc.row_scaled = e->row_scaled;
  c.enc.key = uint32_t(key);
  return c;
}

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    case at::kFloat: return kF32;
    default: TORCH_CHECK(false, "graphquant kernels take bfloat16, float16 or float32, got ", t);
  }
}

at::ScalarType fp8_dtype(int fp8) { return fp8 == 0 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2; }

void* stream_of(const at::Tensor& x) {
#ifdef GRAPHQUANT_EMULATE
  (void)x;
  return nullptr;
#else
  return c10::cuda::getCurrentCUDAStream(x.device().index()).stream();  // = at::cuda::getCurrentCUDAStream
#endif
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

uint32_t* bits(const at::Tensor& t) { return reinterpret_cast<uint32_t*>(t.data_ptr()); }

// Slices of one zero-initialised fp32 buffer that the passes max-reduce into (one fill launch).
struct AmaxArena {
  std::vector<std::pair<at::Tensor*, int64_t>> wanted;
  void want(at::Tensor* slot, int64_t n) { wanted.emplace_back(slot, n); }
  void allocate(const at::TensorOptions& options) {
    int64_t total = 0;
    for (auto& w : wanted) total += w.second;
    if (total == 0) return;
    at::Tensor buffer = at::zeros({total}, options.dtype(at::kFloat));
    int64_t offset = 0;
    for (auto& w : wanted) {
      *w.first = buffer.narrow(0, offset, w.second);
      offset += w.second;
    }
  }
};

struct ScaledOutputs {
  at::Tensor scale, scale_inv;
};

ScaledOutputs finalize(const at::Tensor& amax, const Encoder& e, void* stream) {
  ScaledOutputs out{at::empty_like(amax), at::empty_like(amax)};
  FinalizeParams f;
  f.amax = bits(amax);
  f.scale = out.scale.data_ptr<float>();
  f.scale_inv = out.scale_inv.data_ptr<float>();
  f.n = amax.numel();
  f.fp8 = e.fp8;
  f.epsilon = e.epsilon;
  f.pow2 = e.pow2;
  launch_finalize(f, stream);
  return out;
}

// Whether a small input's rowwise NVFP4 or MXFP8 alone goes to the one-launch program
// (small_rowwise.cuh); the benchmarks and tests turn it off to run the tile programs' launches
// instead (the same bits).
bool small_rowwise_on = true;

// The small rowwise program's CTAs for x's rowwise side, 0 where it does not take x: NVFP4 in 1x16
// blocks rounded to nearest (an activation's), or MXFP8.
int small_rowwise_ctas_for(const at::Tensor& x, const Config& row) {
  const bool nv = row.format == kNV && !row.enc.two_d && !row.enc.sr;
  if (!small_rowwise_on || !(nv || row.format == kMX) || reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) return 0;
  const bool row_scaled = nv && row.enc.row_scaled;
  return small_rowwise_ctas(x.size(0), x.size(1), x.element_size(), nv ? 16 : 32, small_rowwise_bytes(row.format, row_scaled), row_scaled);
}

// quantize's outputs, made by the one launch of the small rowwise program: data, scale and (NVFP4)
// amax of the rowwise side.
std::vector<at::Tensor> small_rowwise(const at::Tensor& x, const Config& row, int ctas, int dtype, void* stream) {
  const int64_t M = x.size(0), K = x.size(1);
  const bool nv = row.format == kNV;
  const auto options = x.options();
  at::Tensor data = nv ? at::empty({M, K / 2}, options.dtype(at::kByte)) : at::empty({M, K}, options.dtype(fp8_dtype(row.enc.fp8)));
  // MXFP8's scales outer-dim-major, (K / 32, M) in memory, as the tile programs lay them
  at::Tensor scale = nv ? at::empty({M, K / 16}, options.dtype(at::kFloat8_e4m3fn)) : at::empty({K / 32, M}, options.dtype(at::kByte)).t();
  at::Tensor amax;
  if (nv) amax = row.enc.row_scaled ? at::empty({M}, options.dtype(at::kFloat)) : at::empty({}, options.dtype(at::kFloat));
  SmallRowwiseParams p;
  p.x = x.data_ptr();
  p.M = M;
  p.K = K;
  p.fp8 = row.enc.fp8;
  p.row_scaled = row.enc.row_scaled;
  p.ctas = ctas;
  p.data = static_cast<uint8_t*>(data.data_ptr());
  p.scales = static_cast<uint8_t*>(scale.data_ptr());
  p.amax = nv ? amax.data_ptr<float>() : nullptr;
  launch_small_rowwise(dtype, row.format, p, stream);
  return {data, scale, amax, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
}

// One direction's outputs: data, scale, amax (undefined where absent).
struct Outputs {
  at::Tensor data, scale, amax;
};

// The per-group (or per-row/column) amax a direction needs before its cast, and where it lives.
struct Needs {
  at::Tensor pre;      // filled by a pre-pass
  at::Tensor during;   // filled by the main pass (delayed scaling reports this tensor's amax)
};

std::vector<at::Tensor> quantize(const at::Tensor& input, const Encoding* row_encoding, const Encoding* col_encoding,
                                 int64_t row_key, int64_t col_key, bool dq_source, bool row_output,
                                 const c10::optional<at::Tensor>& row_scale, const c10::optional<at::Tensor>& col_scale,
                                 const c10::optional<at::Tensor>& group_bounds, bool want_dbias,
                                 const c10::optional<at::Tensor>& rng, int64_t rng_offset,
                                 const c10::optional<at::Tensor>& runs, const c10::optional<at::Tensor>& col_amax,
                                 bool col_output, const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(input.dim() == 2, "graphquant.quantize takes a 2-D tensor");
#ifndef GRAPHQUANT_EMULATE
  const c10::cuda::CUDAGuard guard(input.device());
#endif
  const at::Tensor x = input.contiguous();
  // A padded layout's rows to quantize, 128 a tile: each tile a run of x's rows, then zero rows.
  if (runs.has_value()) {
    TORCH_CHECK(runs->scalar_type() == at::kInt && runs->dim() == 2 && runs->size(1) == 2 && runs->is_contiguous() &&
                    runs->device() == x.device(),
                "graphquant.quantize: runs must be a contiguous (tiles, 2) int32 tensor on the input's device, got ",
                runs->scalar_type(), " of shape ", runs->sizes(), " on ", runs->device());
  }
  // ... or each row read through a gather of its own: x's row, -1 a zero row.
  if (rows.has_value()) {
    TORCH_CHECK(!runs.has_value() && rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->size(0) % 128 == 0 &&
                    rows->is_contiguous() && rows->device() == x.device(),
                "graphquant.quantize: rows must be a contiguous 1-D int64 tensor of whole 128-row tiles on the input's device, ",
                "given without runs; got ", rows->scalar_type(), " of shape ", rows->sizes(), " on ", rows->device());
  }
  const int64_t M = runs.has_value() ? runs->size(0) * 128 : rows.has_value() ? rows->size(0) : x.size(0), K = x.size(1);
  TORCH_CHECK(cdiv(M, 128) < 65536, "graphquant.quantize: at most 65535 * 128 rows, got ", M);
  const int dtype = dtype_code(x.scalar_type());
  const auto opts = x.options();
  void* stream = stream_of(x);
  Config row = config(row_encoding, row_key, false), col = config(col_encoding, col_key, true);
  TORCH_CHECK(row.delayed == row_scale.has_value() && col.delayed == col_scale.has_value(),
              "graphquant.quantize: a delayed-scaling side takes the slot's scale (row_scale, col_scale), and only such a side");
  const bool col_given = col_amax.has_value();
  TORCH_CHECK(!dq_source || (col_output && !col_given),
              "graphquant.quantize: a column side made from the dequantized rowwise values takes its amaxes from them, in this call");
  TORCH_CHECK(col_output || (col.format != kNone && !col.delayed),
              "graphquant.quantize: col_output=False takes only the amaxes of a column side that scales from them");
  col.enc.key_stream = 1;
  if (rng.has_value()) {  // stochastic rounding's [seed, step], read by the kernels where it lies
    TORCH_CHECK(rng->scalar_type() == at::kLong && rng->numel() == 2 && rng->is_contiguous() && rng->device() == x.device(),
                "graphquant.quantize: rng must be a contiguous int64 [seed, step] on the input's device, got ",
                rng->scalar_type(), " of ", rng->numel(), " elements on ", rng->device());
    row.enc.rng = col.enc.rng = rng->data_ptr<int64_t>();
    row.enc.rng_offset = col.enc.rng_offset = rng_offset;
  }

  // The rowwise side alone, nothing else asked of the pass: a small x may take the one-launch program.
  const bool rowwise_alone = row_output && col.format == kNone && !col_given && !dq_source && !runs.has_value() && !rows.has_value() &&
                             !group_bounds.has_value() && !want_dbias;
  if (const int ctas = rowwise_alone ? small_rowwise_ctas_for(x, row) : 0; ctas > 0) return small_rowwise(x, row, ctas, dtype, stream);

  TileParams p;
  p.x = x.data_ptr();
  p.runs = runs.has_value() ? runs->data_ptr<int32_t>() : nullptr;
  p.rows = rows.has_value() ? rows->data_ptr<int64_t>() : nullptr;
  p.M = M;
  p.K = K;
  p.vec_load = (K * int64_t(x.element_size())) % 16 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  p.dq_source = dq_source;
  p.col_rht = col.format == kNV && col.rht;
  p.col_sign_mask = col.sign_mask;

  // Each group's first row, then M: made in the graph beside the layout, so no launches here.
  const bool grouped = group_bounds.has_value();
  if (grouped) {
    TORCH_CHECK(group_bounds->scalar_type() == at::kLong && group_bounds->dim() == 1 && group_bounds->numel() > 1 &&
                    group_bounds->is_contiguous() && group_bounds->device() == x.device(),
                "graphquant.grouped_quantize: group_bounds must be a contiguous 1-D int64 tensor of the groups' first rows and ",
                "then the rows (groups + 1 elements) on the input's device, got ", group_bounds->scalar_type(), " of shape ",
                group_bounds->sizes(), " on ", group_bounds->device());
    p.group_start = group_bounds->data_ptr<int64_t>();
    p.G = int(group_bounds->numel() - 1);
  }
  const int64_t G = p.G;
  // A delayed-scaling side quantizes each group with its own slot's scale.
  for (const auto* scale : {&row_scale, &col_scale}) {
    TORCH_CHECK(!scale->has_value() || ((*scale)->scalar_type() == at::kFloat && (*scale)->numel() == G && (*scale)->is_contiguous() &&
                                        (*scale)->device() == x.device()),
                "graphquant.quantize: a delayed-scaling side takes one contiguous float32 scale a group (", G,
                ") on the input's device, got ", (*scale)->scalar_type(), " of shape ", (*scale)->sizes(), " on ", (*scale)->device());
  }
  // Per-tensor scales and amaxes are 0-dim, or one per group.
  auto per_tensor = [&](const at::Tensor& t) { return grouped ? t : t.reshape({}); };

  Outputs out_r, out_c;
  Needs need_r, need_c;
  Accumulators pre_row, pre_col, during;
  // Scratch the launches read: held until every launch is queued, so the allocator cannot hand
  // its memory to a later output of this call.
  std::vector<at::Tensor> keep_alive;
  AmaxArena arena;
  const bool row_delayed = row.delayed, col_delayed = col.delayed;
  if (row.format == kPerTensor) arena.want(row_delayed ? &need_r.during : &need_r.pre, G);
  if (row.format == kRowScaled) arena.want(&need_r.pre, M);
  if (row.format == kNV) arena.want(&need_r.pre, row.enc.row_scaled ? M : G);
  if (col.format == kPerTensor) arena.want(col_delayed ? &need_c.during : &need_c.pre, G);
  if (col.format == kRowScaled) arena.want(&need_c.pre, G * K);
  if (col.format == kNV) arena.want(&need_c.pre, G);
  arena.allocate(opts);
  // The column side's amaxes, as an earlier call's pre-pass took them of this x: not taken again.
  if (col_given) {
    TORCH_CHECK(need_c.pre.defined() && col_amax->scalar_type() == at::kFloat && col_amax->numel() == need_c.pre.numel() &&
                    col_amax->device() == x.device(),
                "graphquant.quantize: col_amax must be the ", need_c.pre.defined() ? need_c.pre.numel() : 0,
                " float32 amaxes this column side scales from, on the input's device, got ", col_amax->scalar_type(), " of ",
                col_amax->numel(), " on ", col_amax->device());
    need_c.pre.copy_(col_amax->reshape({-1}));
  } else if ((col.format == kPerTensor && !col.delayed) || col.format == kNV) {
    pre_col.col_global = bits(need_c.pre);
  } else if (col.format == kRowScaled) {
    pre_col.cols = bits(need_c.pre);
  }

  // Outputs and amax accumulators of each direction.
  if (row.format != kNone && row_output) {
    const bool nv = row.format == kNV;
    out_r.data = at::empty({M, nv ? K / 2 : K}, opts.dtype(nv ? at::kByte : fp8_dtype(row.enc.fp8)));
    row.enc.data = static_cast<uint8_t*>(out_r.data.data_ptr());
  }
  switch (row.format) {
    case kPerTensor:
      if (row_delayed) {
        row.enc.scale = row_scale->data_ptr<float>();
        out_r.scale = at::reciprocal(*row_scale);
        row.enc.scale_inv = out_r.scale.data_ptr<float>();
        during.row_global = bits(need_r.during);
        out_r.amax = per_tensor(need_r.during);
      } else {
        pre_row.row_global = bits(need_r.pre);
        out_r.amax = per_tensor(need_r.pre);
      }
      break;
    case kBlock:
      // 1x128 scales lie outer-dim-major, (K / 128, M) in memory (the spec's layout, and the
      // reference's): a tile's 128 row scales are then one contiguous run, not 128 scattered words.
      out_r.scale = row.enc.two_d ? at::empty({cdiv(M, 128), cdiv(K, 128)}, opts.dtype(at::kFloat))
                                  : at::empty({cdiv(K, 16 * row.enc.block_chunks), M}, opts.dtype(at::kFloat)).t();
      break;
    case kRowScaled:
      pre_row.rows = bits(need_r.pre);
      break;
    case kMX:  // outer-dim-major, (K / 32, M) in memory, as 1x128's: four runs a tile, not 128 scattered pieces
      out_r.scale = at::empty({K / 32, M}, opts.dtype(at::kByte)).t();
      break;
    case kNV:
      out_r.scale = at::empty({M, K / 16}, opts.dtype(at::kFloat8_e4m3fn));
      if (row.enc.row_scaled) pre_row.rows = bits(need_r.pre); else pre_row.row_global = bits(need_r.pre);
      row.enc.amax = bits(need_r.pre);
      out_r.amax = row.enc.row_scaled ? need_r.pre : per_tensor(need_r.pre);
      break;
    default:
      break;
  }
  if (out_r.scale.defined() && row.format != kPerTensor) row.enc.scales = out_r.scale.data_ptr();

  // Without col_output, the column side only takes its amaxes (in the pre-pass) and returns them.
  const int col_format = col_output ? col.format : kNone;
  if (col_format != kNone) {
    const bool nv = col.format == kNV;
    const std::vector<int64_t> shape = col.enc.transposed ? std::vector<int64_t>{K, nv ? M / 2 : M} : std::vector<int64_t>{M, K};
    out_c.data = at::empty(shape, opts.dtype(nv ? at::kByte : fp8_dtype(col.enc.fp8)));
    col.enc.data = static_cast<uint8_t*>(out_c.data.data_ptr());
  }
  switch (col_format) {
    case kPerTensor:
      if (col_delayed) {
        col.enc.scale = col_scale->data_ptr<float>();
        out_c.scale = at::reciprocal(*col_scale);
        col.enc.scale_inv = out_c.scale.data_ptr<float>();
        during.col_global = bits(need_c.during);
        out_c.amax = per_tensor(need_c.during);
      } else {
        out_c.amax = per_tensor(need_c.pre);
      }
      break;
    case kBlock:
      if (col.enc.two_d) {
        out_c.scale = at::empty({cdiv(K, 128), cdiv(M, 128)}, opts.dtype(at::kFloat));
      } else {  // (M / L, K) in memory: as x's layout keeps it, or outer-dim-major under the transposed data
        out_c.scale = at::empty({cdiv(M, 16 * col.enc.block_chunks), K}, opts.dtype(at::kFloat));
        if (col.enc.transposed) out_c.scale = out_c.scale.t();
      }
      col.enc.scales = out_c.scale.data_ptr();
      break;
    case kMX:
      out_c.scale = at::empty({M / 32, K}, opts.dtype(at::kByte));
      col.enc.scales = out_c.scale.data_ptr();
      break;
    case kNV:
      out_c.scale = at::empty({K, M / 16}, opts.dtype(at::kFloat8_e4m3fn));
      col.enc.scales = out_c.scale.data_ptr();
      col.enc.amax = bits(need_c.pre);
      out_c.amax = per_tensor(need_c.pre);
      break;
    default:
      break;
  }

  // Row-scaled FP8's rowwise side, with at most the amaxes its column side scales from: one launch
  // that takes each row's amax while it holds the row (row_strip.cu), in place of a pre-pass, the
  // scales' launch and a main pass that reads x again.
#ifndef GRAPHQUANT_EMULATE
  if (row.format == kRowScaled && row_output && !dq_source && !want_dbias && !col_given &&
      (col.format == kNone || (col.format == kRowScaled && !col_output))) {
    const at::Tensor scale_inv = at::empty({M}, opts.dtype(at::kFloat));
    TileParams q = p;
    q.row = row.enc;
    q.row.scales = scale_inv.data_ptr();
    q.acc.cols = pre_col.cols;
    if (launch_row_strip(dtype, q, stream)) {
      return {out_r.data, scale_inv.view({M, 1}), out_r.amax, out_c.data, out_c.scale, out_c.amax, at::Tensor(), col_output ? at::Tensor() : need_c.pre};
    }
  }
#endif

  // Scales from pre-pass amaxes, once those exist.
  auto finalize_row = [&] {
    if (row.format == kPerTensor && !row_delayed) {
      ScaledOutputs s = finalize(need_r.pre, row.enc, stream);
      row.enc.scale = s.scale.data_ptr<float>();
      row.enc.scale_inv = s.scale_inv.data_ptr<float>();
      out_r.scale = per_tensor(s.scale_inv);
      keep_alive.push_back(s.scale);
    } else if (row.format == kRowScaled) {
      ScaledOutputs s = finalize(need_r.pre, row.enc, stream);
      row.enc.scale = s.scale.data_ptr<float>();
      row.enc.scale_inv = s.scale_inv.data_ptr<float>();
      out_r.scale = s.scale_inv.view({M, 1});
      keep_alive.push_back(s.scale);
    }
  };
  auto finalize_col = [&] {
    if ((col_format == kPerTensor && !col_delayed) || col_format == kRowScaled) {
      ScaledOutputs s = finalize(need_c.pre, col.enc, stream);
      col.enc.scale = s.scale.data_ptr<float>();
      col.enc.scale_inv = s.scale_inv.data_ptr<float>();
      out_c.scale = col.format == kRowScaled ? (grouped ? s.scale_inv.view({G, K, 1}) : s.scale_inv.view({K, 1}))
                                             : per_tensor(s.scale_inv);
      keep_alive.push_back(s.scale);
    }
  };
  auto any = [](const Accumulators& a) { return a.row_global || a.rows || a.col_global || a.cols; };

  // Pre-passes: the amaxes of x for both sides at once; for a dequantized source, the column
  // side's amaxes come from a second pass that runs the rowwise encoder without writing.
  if (!dq_source) {
    if (any(pre_row) || any(pre_col)) {
      TileParams q = p;
      q.main = 0;
      q.acc = {pre_row.row_global, pre_row.rows, pre_col.col_global, pre_col.cols};
      launch_tile(dtype, kNone, kNone, q, stream);
    }
    finalize_row();
    finalize_col();
  } else {
    if (any(pre_row)) {
      TileParams q = p;
      q.main = 0;
      q.acc = pre_row;
      launch_tile(dtype, kNone, kNone, q, stream);
    }
    finalize_row();
    if (any(pre_col)) {
      TileParams q = p;
      q.main = 0;
      q.row = row.enc;
      q.acc = pre_col;
      launch_tile(dtype, row.format, kNone, q, stream);
    }
    finalize_col();
  }

  at::Tensor partial, dbias;
  TileParams q = p;
  q.main = 1;
  q.row = row.enc;
  q.col = col.enc;
  q.acc = during;
  if (want_dbias) {
    partial = at::empty({cdiv(M, 128), K}, opts.dtype(at::kFloat));
    q.dbias_partial = partial.data_ptr<float>();
  }
  if (row.format != kNone || col_format != kNone || want_dbias) launch_tile(dtype, row.format, col_format, q, stream);
  if (want_dbias) {
    dbias = at::empty({K}, opts);
    DbiasParams d;
    d.partial = partial.data_ptr<float>();
    d.out = dbias.data_ptr();
    d.tiles = cdiv(M, 128);
    d.K = K;
    d.dtype = dtype;
    launch_dbias(d, stream);
  }
  return {out_r.data, out_r.scale, out_r.amax, out_c.data, out_c.scale, out_c.amax, dbias, col_output ? at::Tensor() : need_c.pre};
}

at::Tensor dequantize(const at::Tensor& data, const at::Tensor& scales, const c10::optional<at::Tensor>& amax,
                      int64_t kind, int64_t fp8, int64_t block_rows, int64_t block_cols,
                      int64_t scale_row_stride, int64_t scale_col_stride, int64_t out_dtype) {
#ifndef GRAPHQUANT_EMULATE
  const c10::cuda::CUDAGuard guard(data.device());
#endif
  // FP8 and MXFP8 scales are read through their strides (1x128 ones lie outer-dim-major), NVFP4's whole.
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && (kind != kDequantNV || scales.is_contiguous()),
              "graphquant.dequantize: bad layout");
  static const at::ScalarType kOut[] = {at::kBFloat16, at::kHalf, at::kFloat};
  DequantParams p;
  p.kind = int(kind);
  p.fp8 = int(fp8);
  p.data = static_cast<const uint8_t*>(data.data_ptr());
  p.scales = scales.data_ptr();
  p.rows = data.size(0);
  p.cols = kind == kDequantNV ? data.size(1) * 2 : data.size(1);
  p.block_rows = block_rows;
  p.block_cols = block_cols;
  p.scale_row_stride = scale_row_stride;
  p.scale_col_stride = scale_col_stride;
  at::Tensor amax_f;
  if (amax.has_value()) {
    amax_f = amax->to(at::kFloat).contiguous();
    p.amax = bits(amax_f);
    p.nv_row_amax = amax_f.dim() == 1;
  }
  at::Tensor out = at::empty({p.rows, p.cols}, data.options().dtype(kOut[out_dtype]));
  p.out = out.data_ptr();
  p.out_dtype = int(out_dtype);
  launch_dequantize(p, stream_of(data));
  return out;
}

}  // namespace
}  // namespace gq

void register_cuda_kernels(pybind11::module_& m) {
  using gq::Encoding;
  pybind11::class_<Encoding>(m, "Encoding", "One direction's encoding, by the field names of graphquant.quantizers.KernelEncoding")
      .def(pybind11::init(&gq::make_encoding), pybind11::kw_only(), pybind11::arg("scaling"), pybind11::arg("element"),
           pybind11::arg("block"), pybind11::arg("transposed"), pybind11::arg("delayed_scaling"), pybind11::arg("amax_epsilon"),
           pybind11::arg("pow2_scales"), pybind11::arg("hadamard"), pybind11::arg("random_sign_mask"),
           pybind11::arg("stochastic_rounding"), pybind11::arg("row_scaled"))
      .def_readonly("format", &Encoding::format)
      .def_readonly("fp8", &Encoding::fp8)
      .def_readonly("block_rows", &Encoding::block_rows)
      .def_readonly("block_cols", &Encoding::block_cols)
      .def_readonly("two_d", &Encoding::two_d)
      .def_readonly("block_chunks", &Encoding::block_chunks)
      .def_readonly("transposed", &Encoding::transposed)
      .def_readonly("delayed", &Encoding::delayed)
      .def_readonly("epsilon", &Encoding::epsilon)
      .def_readonly("pow2", &Encoding::pow2)
      .def_readonly("rht", &Encoding::rht)
      .def_readonly("sign_mask", &Encoding::sign_mask)
      .def_readonly("sr", &Encoding::sr)
      .def_readonly("row_scaled", &Encoding::row_scaled);
  m.def("quantize", &gq::quantize, "Quantize a 2-D tensor: rowwise and/or columnwise, fused (see graphquant/kernels/native.py)",
        pybind11::arg("x"), pybind11::arg("row_encoding").none(true), pybind11::arg("col_encoding").none(true),
        pybind11::arg("row_key"), pybind11::arg("col_key"), pybind11::arg("dq_source"),
        pybind11::arg("row_output"), pybind11::arg("row_scale"), pybind11::arg("col_scale"),
        pybind11::arg("group_bounds"), pybind11::arg("dbias"), pybind11::arg("rng") = pybind11::none(),
        pybind11::arg("rng_offset") = 0, pybind11::arg("runs") = pybind11::none(), pybind11::arg("col_amax") = pybind11::none(),
        pybind11::arg("col_output") = true, pybind11::arg("rows") = pybind11::none());
  m.def(
      "set_small_rowwise",
      [](bool on) { return std::exchange(gq::small_rowwise_on, on); },
      "Whether a small input's rowwise NVFP4 or MXFP8 takes one launch (csrc/cuda/small_rowwise.cuh) rather than "
      "the tile programs' (the same bits); returns the previous setting",
      pybind11::arg("on"));
  m.def("dequantize", &gq::dequantize, "Dequantize one stored representation (see graphquant/kernels/native.py)");
}
