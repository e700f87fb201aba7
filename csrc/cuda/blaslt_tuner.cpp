// The cuBLASLt algorithm choice behind graphquant's GEMMs (blaslt.h).
//
// cuBLASLt's heuristic ranks its kernels by a model of the device, which does not know the power
// limit that sustained FP8 GEMMs run into, so its first choice for a shape is not always the
// fastest of its own candidates. Timing them once per shape finds the faster one. Kernels without
// split-K give each output element the same sum in the same order, so they agree bit for bit; a
// candidate is kept only if its output's digest equals the heuristic's first's, so results never
// depend on the timings.
#include "blaslt.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>

namespace gq::blaslt {
namespace {

constexpr int kCandidates = 16;
constexpr uint64_t kMaxWorkspaceBytes = uint64_t(32) << 20;  // what cuBLAS takes on Hopper
// Below this many flops a GEMM takes the heuristic's first: timing so short a GEMM would cost more
// than it could save.
constexpr double kTunedFlops = 2.0 * double(int64_t(1) << 33);
// Shapes timed per process (a training step has a few dozen): past this (dynamic shapes), new
// shapes take the heuristic's first, so the time spent timing stays bounded.
constexpr size_t kMaxTuned = 64;
// Before timing, the first runs for kHeatMs: sustained FP8 GEMMs hold the GPU below its boost
// clock (the power limit), a training step runs at that clock, and the candidates rank differently
// there than at boost. Then kRounds round-robin windows of ~kWindowMs a candidate.
constexpr float kHeatMs = 150, kWindowMs = 5;
constexpr int kRounds = 3;

// GRAPHQUANT_GEMM_TUNING=0 turns the timing off: every shape takes the heuristic's first (the same
// bits), without the heat and round robin that timing costs a new shape once (serving many
// distinct shapes).
bool timing_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("GRAPHQUANT_GEMM_TUNING");
    return value == nullptr || std::string(value) != "0";
  }();
  return enabled;
}

// What a call needs to run the chosen algorithm (copied out of the cache on every call).
struct Chosen {
  cublasLtMatmulAlgo_t algo;
  size_t workspace_bytes;
};

struct Entry {
  Chosen chosen;
  Choice choice;  // for the choices table only
};

std::mutex mutex;
std::map<std::vector<int64_t>, Entry> cache;
size_t tuned_count = 0;

using Preference = Owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

template <typename V>
V config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr, V fallback) {
  V value{};
  size_t written = 0;
  return cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written) == CUBLAS_STATUS_SUCCESS
             ? value
             : fallback;
}

// Split-K sums each element in parts and adds the parts: a different order, other bits.
bool one_pass(const cublasLtMatmulAlgo_t& algo) {
  return config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 0) == 1 &&
         config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, 1) == CUBLASLT_REDUCTION_SCHEME_NONE;
}

std::vector<cublasLtMatmulHeuristicResult_t> candidates(cublasLtHandle_t handle, const Problem& p) {
  Preference preference;
  TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference.raw));
  const auto pref = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
    TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.raw, attr, &value, sizeof(value)));
  };
  const uint32_t align_out = alignment(p.out);
  pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, kMaxWorkspaceBytes);
  pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(p.b));  // cuBLAS's A is our b
  pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(p.a));
  pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_out);
  pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_out);
  std::vector<cublasLtMatmulHeuristicResult_t> found(kCandidates);
  int count = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.b_layout, p.a_layout, p.out_layout,
                                                               p.out_layout, preference.raw, kCandidates, found.data(),
                                                               &count);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS && count > 0, "graphquant: cuBLASLt has no algorithm (",
              at::cuda::blas::_cublasGetErrorEnum(status), ") for ", p.describe());
  found.resize(count);
  return found;
}

cublasStatus_t launch(cublasLtHandle_t handle, const Problem& p, const cublasLtMatmulAlgo_t& algo, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  void* const out = p.out.data_ptr();
  return cublasLtMatmul(handle, p.desc, p.alpha, p.b.const_data_ptr(), p.b_layout, p.a.const_data_ptr(), p.a_layout,
                        p.beta, out, p.out_layout, out, p.out_layout, &algo, workspace, workspace_bytes, stream);
}

Choice described(const Problem& p, const cublasLtMatmulAlgo_t& algo, int64_t found, int64_t agreeing, int64_t chosen,
                 double first_us, double chosen_us) {
  return {p.describe(), found, agreeing, chosen, first_us, chosen_us,
          int64_t(config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, 0)),
          int64_t(config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, 0)),
          int64_t(config<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 0))};
}

// Times the candidates that write the first's bits; returns the fastest, with out written by it.
// std::nullopt where the first's output is all zeros: any kernel agrees with zeros, so the check
// would say nothing; the next call with this key tries again.
std::optional<Entry> tune(cublasLtHandle_t handle, const Problem& p,
                          const std::vector<cublasLtMatmulHeuristicResult_t>& found, cudaStream_t stream) {
  size_t workspace_bytes = 0;
  for (const auto& f : found) workspace_bytes = std::max(workspace_bytes, f.workspaceSize);
  const at::Tensor workspace = at::empty({int64_t(workspace_bytes)}, p.out.options().dtype(at::kByte));
  const auto run = [&](size_t i) {
    return launch(handle, p, found[i].algo, workspace.data_ptr(), workspace_bytes, stream) == CUBLAS_STATUS_SUCCESS;
  };

  TORCH_CUDABLAS_CHECK(launch(handle, p, found[0].algo, workspace.data_ptr(), workspace_bytes, stream));
  if (p.out.count_nonzero().item<int64_t>() == 0) return std::nullopt;
  std::vector<at::Tensor> digests = {bits_digest(p.out)};
  std::vector<size_t> ran = {0};
  for (size_t i = 1; i < found.size(); ++i) {
    if (one_pass(found[i].algo) && run(i)) {
      digests.push_back(bits_digest(p.out));
      ran.push_back(i);
    }
  }
  const at::Tensor digest = at::cat(digests).cpu();
  std::vector<size_t> agreeing;
  for (size_t j = 0; j < ran.size(); ++j) {
    if (digest[j].item<int64_t>() == digest[0].item<int64_t>()) agreeing.push_back(ran[j]);
  }

  // The first once, timed, to size the heat and the windows; then the heat; then round robin, so
  // that every candidate meets the same clocks. The last run is an agreeing one.
  const auto rerun = [&](size_t i) { TORCH_CHECK(run(i), "graphquant: cuBLASLt failed to rerun an algorithm"); };
  std::vector<cudaEvent_t> events(2 + 2 * kRounds * agreeing.size());
  for (auto& e : events) C10_CUDA_CHECK(cudaEventCreate(&e));
  const auto elapsed_ms = [&](size_t pair) {
    float t = 0;
    C10_CUDA_CHECK(cudaEventElapsedTime(&t, events[2 * pair], events[2 * pair + 1]));
    return t;
  };
  C10_CUDA_CHECK(cudaEventRecord(events[0], stream));
  rerun(0);
  C10_CUDA_CHECK(cudaEventRecord(events[1], stream));
  C10_CUDA_CHECK(cudaEventSynchronize(events[1]));
  const float once_ms = std::max(elapsed_ms(0), 1e-3f);
  for (int i = 0; i < int(kHeatMs / once_ms); ++i) rerun(0);
  const int repeats = std::max(1, int(kWindowMs / once_ms));
  for (int r = 0; r < kRounds; ++r) {
    for (size_t j = 0; j < agreeing.size(); ++j) {
      const size_t pair = 1 + r * agreeing.size() + j;
      C10_CUDA_CHECK(cudaEventRecord(events[2 * pair], stream));
      for (int k = 0; k < repeats; ++k) rerun(agreeing[j]);
      C10_CUDA_CHECK(cudaEventRecord(events[2 * pair + 1], stream));
    }
  }
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<std::vector<float>> ms(agreeing.size());
  for (int r = 0; r < kRounds; ++r) {
    for (size_t j = 0; j < agreeing.size(); ++j) ms[j].push_back(elapsed_ms(1 + r * agreeing.size() + j) / repeats);
  }
  for (auto& e : events) C10_CUDA_CHECK(cudaEventDestroy(e));
  std::vector<double> median(agreeing.size());
  for (size_t j = 0; j < agreeing.size(); ++j) {
    std::sort(ms[j].begin(), ms[j].end());
    median[j] = ms[j][kRounds / 2];
  }
  const size_t best = std::min_element(median.begin(), median.end()) - median.begin();
  const auto& algo = found[agreeing[best]].algo;
  return Entry{{algo, found[agreeing[best]].workspaceSize},
               described(p, algo, int64_t(found.size()), int64_t(agreeing.size()), int64_t(agreeing[best]),
                         1000 * median[0], 1000 * median[best])};
}

}  // namespace

uint32_t alignment(const at::Tensor& t) {
  const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
  uint32_t a = 1;
  while (a < 256 && address % (2 * a) == 0) a *= 2;
  return a;
}

void matmul(const Problem& p) {
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  std::vector<int64_t> key = p.key;
  key.insert(key.end(), {int64_t(p.out.get_device()), alignment(p.a), alignment(p.b), alignment(p.out)});
  std::optional<Chosen> chosen;
  bool may_time = false;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = cache.find(key); it != cache.end()) chosen = it->second.chosen;
    may_time = tuned_count < kMaxTuned;
  }
  if (!chosen) {
    const auto found = candidates(handle, p);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const bool outside_graph = capture == cudaStreamCaptureStatusNone;  // no timing inside a CUDA graph
    const bool timing = outside_graph && may_time && timing_enabled() && found.size() > 1 && p.flops >= kTunedFlops;
    const std::optional<Entry> tuned = timing ? tune(handle, p, found, stream) : std::nullopt;
    const Entry entry = tuned ? *tuned
                              : Entry{{found[0].algo, found[0].workspaceSize},
                                      described(p, found[0].algo, int64_t(found.size()), 1, 0, 0, 0)};
    if (outside_graph && timing == tuned.has_value()) {  // not where tune() declined (all-zero output)
      std::lock_guard<std::mutex> lock(mutex);
      tuned_count += tuned.has_value();
      cache.emplace(std::move(key), entry);
    }
    if (tuned) return;  // tune() left out written by the chosen algorithm
    chosen = entry.chosen;
  }
  const at::Tensor workspace = at::empty({int64_t(chosen->workspace_bytes)}, p.out.options().dtype(at::kByte));
  TORCH_CUDABLAS_CHECK(launch(handle, p, chosen->algo, workspace.data_ptr(), chosen->workspace_bytes, stream));
}

std::vector<Choice> choices() {
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<Choice> table;
  for (const auto& [key, entry] : cache) table.push_back(entry.choice);
  return table;
}

}  // namespace gq::blaslt
