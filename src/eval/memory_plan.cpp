// The memory plan of an evaluation (layer_runner.h): every large allocation of the runners,
// counted from the shapes before any is made, against the host's available memory (the smaller of
// MemAvailable and what the cgroup still allows) and the GPU's free memory.
#include <algorithm>
#include <cstdio>
#include <mutex>
#include <thread>

#include "engine/expert_cpu.h"
#include "eval/layer_runner.h"
#include "moefq/buffer_layout.h"
#include "moefq/errors.h"
#include "moefq/host_memory.h"

namespace moefq {
namespace {

std::mutex& query_mutex() {
  static std::mutex m;
  return m;
}
std::function<std::pair<double, double>()>& device_query() {
  static std::function<std::pair<double, double>()> q;
  return q;
}

// One expert's three [I, H] / [H, I] matrices in f (weights.h's bytes per parameter).
double expert_bytes(int64_t H, int64_t I, StoredWeightFormat f) {
  return stored_weight_bytes(f, 3.0 * double(H) * double(I));
}

// The stored format of the weights the engines hold (synthetic: e4m3).
StoredWeightFormat held_format(WeightFormat f) {
  return f == WeightFormat::kBf16 ? StoredWeightFormat::kBf16 : StoredWeightFormat::kE4m3;
}

}  // namespace

void set_device_memory_query(std::function<std::pair<double, double>()> query) {
  std::lock_guard<std::mutex> lock(query_mutex());
  device_query() = std::move(query);
}

std::pair<double, double> query_device_memory() {
  std::lock_guard<std::mutex> lock(query_mutex());
  return device_query() ? device_query()() : std::pair<double, double>(0, 0);
}

void total_memory_plan(MemoryPlan& p, bool device) {
  p.host_bytes = p.device_bytes = 0;
  for (const MemoryItem& m : p.items) {
    p.host_bytes += m.host_bytes;
    p.device_bytes += m.device_bytes;
  }
  p.host_available = double(available_host_memory().value_or(0));
  if (device) p.device_available = query_device_memory().first;
}

namespace {

bool host_fits(const MemoryPlan& p) { return p.host_available <= 0 || p.host_bytes <= kUsableFraction * p.host_available; }
bool device_fits(const MemoryPlan& p) {
  return p.device_available <= 0 || p.device_bytes <= kUsableFraction * p.device_available;
}

}  // namespace

bool memory_fits(const MemoryPlan& p) { return host_fits(p) && device_fits(p); }

void require_memory_fits(const MemoryPlan& plan, const std::string& what, const std::string& advice) {
  const auto gib = [](double b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f GiB", b / double(1ull << 30));
    return std::string(buf);
  };
  MOEFQ_CHECK(host_fits(plan), what, " needs ", gib(plan.host_bytes), " of host memory, ", gib(plan.host_available),
              " available: ", advice, "\n", plan.describe());
  MOEFQ_CHECK(device_fits(plan), what, " needs ", gib(plan.device_bytes), " of GPU memory, ",
              gib(plan.device_available), " available: ", advice, "\n", plan.describe());
}

std::string MemoryPlan::describe() const {
  const auto gib = [](double b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%9.2f", b / double(1ull << 30));
    return std::string(buf);
  };
  std::string out = "memory plan (GiB)                          host     device\n";
  for (const MemoryItem& m : items) {
    char name[48];
    std::snprintf(name, sizeof name, "  %-38s", m.what.c_str());
    out += name + gib(m.host_bytes) + "  " + gib(m.device_bytes) + "\n";
  }
  out += "  total" + std::string(33, ' ') + gib(host_bytes) + "  " + gib(device_bytes) + "\n";
  out += "  available" + std::string(29, ' ') + gib(host_available) + "  " + gib(device_available);
  if (streaming) out += "\n  (the next layer's weights are prepared while a layer is evaluated)";
  return out;
}

MemoryPlan plan_run_memory(const RunnerSetup& s, EvalDevice device) {
  const MoeConfig& c = s.config;
  const int64_t R = s.ranks, T = s.tokens, H = c.hidden, I = c.intermediate, E = c.num_experts, K = c.top_k;
  const double rows = double(s.num_tokens()), eval_rows = double(s.eval_batches) * double(R * T);
  // The layer as the engines hold it (an MXFP4 checkpoint: decoded to bf16, 2 bytes a parameter,
  // on the host as it is read and on the GPU); the stored bytes are read a tensor at a time.
  const WeightFormat wf = s.weight_format;
  const bool mxfp4 = !s.checkpoint_dir.empty() && s.stored_format == StoredWeightFormat::kMxfp4;
  const StoredWeightFormat held = held_format(wf);
  const double weights = double(E) * expert_bytes(H, I, held) +
                         double(R) * (c.num_shared > 0 ? expert_bytes(H, I * c.num_shared, held) : 0.0);
  const double router = double(R) * double(E) * double(H + 1) * 4.0;
  BufferShape shape;
  shape.num_ranks = R;
  shape.num_experts = E;
  shape.max_tokens = T;
  shape.top_k = K;
  shape.hidden = H;
  shape.intermediate = I;
  shape.staging = s.staging;  // bf16 staged regions are twice the e4m3 ones (less their scales)
  const double buffers = double(R) * double(BufferLayout(shape).total_bytes());
  const double acts = rows * double(H) * 2.0;
  // The batches' outputs, the shared expert's, the reference and one recipe's output.
  const double outputs = (rows + 3.0 * eval_rows) * double(H) * 2.0;
  const double sums = eval_rows * double(sizeof(MetricSums)) + double(H) * 16.0;
  const double xq = double(R * T * H) * 2.0;
  const bool cuda = device == EvalDevice::kCuda;
  MemoryPlan p;
  const auto add = [&](const std::string& what, double bytes, bool on_device) {
    p.items.push_back({what, on_device ? 0.0 : bytes, on_device ? bytes : 0.0});
  };
  add(std::string("expert weights (") + (mxfp4 ? "mxfp4 as bf16" : weight_format_name(wf)) + ", 1 layer)", weights,
      cuda);
  // A checkpoint layer passes through the host on its way to the GPU.
  if (cuda && !s.checkpoint_dir.empty()) add("checkpoint layer read on the host", weights, false);
  // MXFP4: one tensor's packed values and scales at a time, before their decode (the largest
  // projection: the shared expert's when there is one).
  if (mxfp4)
    add("mxfp4 tensor being decoded", stored_weight_bytes(StoredWeightFormat::kMxfp4,
                                                         double(H) * double(I * std::max<int64_t>(1, c.num_shared))),
        false);
  add("router weights", router, false);
  add("engine buffers (" + std::to_string(R) + " ranks)", buffers, cuda);
  add("activations", acts, cuda);
  add("outputs, reference, metric sums", outputs + sums, cuda);
  add("dispatch QDQ output", xq, cuda);
  // Calibration statistics: the two quantizers' histograms (the CPU runner's per rank too) and
  // nvfp4's row samples (on the host: the rows and their sorted block pairs).
  if (s.calibration_stats || s.nvfp4_sample_elements > 0) {
    const double hist = s.calibration_stats ? 2.0 * double(AbsHistogram::kBins) * 8.0 : 0.0;
    double sample = 0;
    if (s.nvfp4_sample_elements > 0)
      for (int which = 0; which < 2; ++which)
        sample += double(nvfp4_sample_rows(s, which).num_slots) * double(H) * 2.0;
    p.items.push_back({"calibration statistics", hist * double(cuda ? 1 : R + 1) + sample * 3.0,
                       cuda ? hist + sample : 0.0});
  }
  if (!cuda) {
    const int threads = resolve_threads(s.num_threads);
    const double scratch = double(threads) * (128.0 * double(std::max(H, I)) + 64.0 * double(std::max(H, I) + std::max(2 * I, H))) * 4.0;
    add("CPU GEMM scratch", scratch, false);
  }
  total_memory_plan(p, cuda);
  // Streaming (the GPU runner): a second layer's weights generated on a side stream (or read from
  // the checkpoint on the host) while the current one is evaluated, where that fits too. The host
  // runner has no cores to spare for it.
  const double budget = cuda ? kUsableFraction * p.device_available : kUsableFraction * p.host_available;
  const double need = (cuda ? p.device_bytes : p.host_bytes) + weights;
  const bool from_host = !s.checkpoint_dir.empty();
  const double host_budget = kUsableFraction * p.host_available;
  if (cuda && budget > 0 && need <= budget && (!from_host || p.host_bytes + weights <= host_budget)) {
    p.streaming = true;
    add("next layer's weights (streaming)", weights, !from_host);
    (from_host ? p.host_bytes : p.device_bytes) += weights;
  }
  return p;
}

}  // namespace moefq
