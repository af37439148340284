// MoeLayer: one fake-quantized MoE layer (FakeQuantMoe, on the CPU engine or the CUDA engine) with
// the weights `moefq eval` uses for the same model, layer and seed, R simulated
// expert-parallel ranks and the shared expert unfused (the model adds it to the routed output,
// computed on the unquantized x, in fp32 with one bf16 rounding, as the eval does). The caller's
// tokens [N, H] are cut into R consecutive parts, one per rank.

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "bindings.h"
#include "eval/layer_runner.h"
#include "moefq/calibration_file.h"
#include "moefq/checkpoint.h"
#include "moefq/errors.h"
#include "moefq/fake_quant_moe.h"
#include "moefq/router.h"
#ifdef MOEFQ_HAS_CUDA
#include "moefq/cuda.h"
#endif

namespace moefq::py {
namespace {

namespace pb = pybind11;
namespace fs = std::filesystem;

struct LayerOptions {
  std::string preset, config_path, checkpoint;
  int64_t layer = 0, ranks = 1, max_tokens = 256;
  std::string device = "cpu";
  uint64_t seed = 1;
  std::string synthetic = "model";
  int num_threads = 0;
  std::string combine_weighting = "before";
  std::string staging;  // empty: default_staging (the checkpoint's weight format, else the model's)
};

// The largest max_tokens a layer takes: below it the buffer sizes (integers) cannot overflow.
constexpr int64_t kMaxLayerTokens = (int64_t{1} << 31) - 1;

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / double(1ull << 30));
  return buf;
}

// Refuses a layer whose engine would not fit in memory, before anything is allocated, with the
// sizes (the eval's memory plan for one layer and no batches).
void check_layer_memory(const RunnerSetup& s, bool cuda) {
  const std::string sizes = "ranks=" + std::to_string(s.ranks) + " x max_tokens=" + std::to_string(s.tokens) +
                            " of " + s.config.name;
  // Its combine rows alone, [top_k + 1][max_tokens][hidden] bf16 per rank.
  const double rows = double(s.ranks) * double(s.config.top_k + 1) * double(s.tokens) * double(s.config.hidden) * 2;
  MOEFQ_CHECK(s.tokens <= kMaxLayerTokens, "MoeLayer: max_tokens must be at most ", kMaxLayerTokens, "; ", sizes,
              " would need more than ", gib(rows), " for the combine rows alone");
  const MemoryPlan plan = plan_run_memory(s, cuda ? EvalDevice::kCuda : EvalDevice::kCpu);
  MOEFQ_CHECK(plan.host_available <= 0 || plan.host_bytes <= kUsableFraction * plan.host_available, "MoeLayer: ",
              sizes, " needs ", gib(plan.host_bytes), " of host memory, ", gib(plan.host_available),
              " available; use a smaller max_tokens or fewer ranks\n", plan.describe());
  MOEFQ_CHECK(!cuda || plan.device_available <= 0 || plan.device_bytes <= kUsableFraction * plan.device_available,
              "MoeLayer: ", sizes, " needs ", gib(plan.device_bytes), " of GPU memory, ", gib(plan.device_available),
              " available; use a smaller max_tokens or fewer ranks\n", plan.describe());
}

// "dispatch" or "combine" (the quantizer index 0 or 1), else bad input naming `who`.
int quantizer_index(const std::string& which, const char* who) {
  if (which == "dispatch") return 0;
  if (which == "combine") return 1;
  MOEFQ_FAIL(ErrorKind::kBadInput, who, ": which must be 'dispatch' or 'combine', got '", which, "'");
}

MoeConfig resolve_config(const LayerOptions& o, std::string* source) {
  const int given = int(!o.preset.empty()) + int(!o.config_path.empty()) + int(!o.checkpoint.empty());
  MOEFQ_CHECK(given <= 1, "MoeLayer: give at most one of preset, config and checkpoint");
  if (!o.checkpoint.empty()) {
    const fs::path cj = fs::path(o.checkpoint) / "config.json";
    MOEFQ_CHECK(fs::is_regular_file(cj), "MoeLayer: checkpoint ", o.checkpoint, ": no config.json in the directory");
    *source = "checkpoint " + o.checkpoint;
    return load_hf_config(cj.string());
  }
  if (!o.config_path.empty()) {
    MOEFQ_CHECK(fs::is_regular_file(o.config_path), "MoeLayer: config ", o.config_path, ": no such file");
    *source = "config " + o.config_path;
    return load_hf_config(o.config_path);
  }
  const std::string name = o.preset.empty() ? "tiny" : o.preset;
  *source = "preset " + name;
  return moefq::preset(name);
}

class MoeLayer {
 public:
  explicit MoeLayer(const LayerOptions& o) : cuda_(o.device == "cuda"), layer_(o.layer) {
    MOEFQ_CHECK(o.device == "cpu" || o.device == "cuda", "MoeLayer: device must be 'cpu' or 'cuda', got '", o.device,
                "'");
    RunnerSetup s;
    s.config = resolve_config(o, &source_);
    s.config.validate();
    MOEFQ_CHECK(o.layer >= 0, "MoeLayer: layer must be >= 0, got ", o.layer);
    MOEFQ_CHECK(o.ranks >= 1 && s.config.num_experts % o.ranks == 0, "MoeLayer: ranks ", o.ranks,
                " must divide the ", s.config.num_experts, " routed experts of ", s.config.name);
    MOEFQ_CHECK(o.max_tokens >= 1, "MoeLayer: max_tokens must be >= 1, got ", o.max_tokens);
    const auto kind = parse_synthetic_kind(o.synthetic);
    MOEFQ_CHECK(kind.has_value(), "MoeLayer: synthetic must be 'model' or 'gaussian', got '", o.synthetic, "'");
    MOEFQ_CHECK(o.num_threads >= 0, "MoeLayer: threads must be >= 0");
    const std::optional<Staging> staging =
        o.staging.empty() ? std::nullopt : std::optional(staging_from_name(o.staging, "MoeLayer: staging"));
    const auto weighting = parse_combine_weighting(o.combine_weighting);
    MOEFQ_CHECK(weighting.has_value(), "MoeLayer: combine_weighting must be 'before' or 'after', got '",
                o.combine_weighting, "'");
    s.ranks = o.ranks;
    s.tokens = o.max_tokens;
    s.seed = o.seed;
    s.synthetic = *kind;
    s.checkpoint_dir = o.checkpoint;
    s.num_threads = o.num_threads;
    if (!o.checkpoint.empty()) {
      s.stored_format = checkpoint_stored_format(o.checkpoint, o.layer, s.config);
      s.weight_format = loaded_weight_format(s.stored_format);
    }
    // As the eval resolves it: a checkpoint's own format, except MXFP4 (decoded to bf16 at load),
    // whose staging follows the architecture.
    const bool own_format = !o.checkpoint.empty() && s.stored_format != StoredWeightFormat::kMxfp4;
    s.staging = staging.value_or(default_staging(s.config, own_format ? std::optional(s.weight_format) : std::nullopt));
    check_layer_memory(s, cuda_);
    cfg_ = s.config;
    ranks_ = o.ranks;
    max_tokens_ = o.max_tokens;
    threads_ = o.num_threads;
    std::vector<LayerWeights> w;
    for (int64_t r = 0; r < ranks_; ++r) w.push_back(rank_weights(s, o.layer, r));
    gate_ = w[0].gate;
    bias_ = w[0].gate_bias;
    EngineOptions eo;
    eo.fuse_shared = false;  // the dispatch quantizer needs the shared expert run on its own
    eo.num_threads = o.num_threads;
    eo.combine_weighting = *weighting;
    weighting_ = *weighting;
    eo.staging = s.staging;
    staging_ = s.staging;
    if (!cuda_) {
      fq_ = FakeQuantMoe::make(LayerDevice::kCpu, cfg_, ranks_, max_tokens_, std::move(w), eo, o.layer);
      return;
    }
#ifdef MOEFQ_HAS_CUDA
    MOEFQ_CHECK(cuda::device_count() > 0, "MoeLayer: device 'cuda' but no GPU is visible");
    device_id_ = cuda::current_device();
    cuda::register_cuda_backends();
    fq_ = FakeQuantMoe::make(LayerDevice::kCuda, cfg_, ranks_, max_tokens_, std::move(w), eo, o.layer);
    router_ = std::make_unique<cuda::DeviceRouter>(cfg_, gate_, bias_);
    done_ = std::make_unique<cuda::StreamMark>();
#else
    throw std::runtime_error("MoeLayer: device 'cuda' needs a moefq built with CUDA (rebuild with nvcc)");
#endif
  }

  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;
  ~MoeLayer() = default;

  const MoeConfig& config() const { return cfg_; }
  std::string source() const { return source_; }
  int64_t ranks() const { return ranks_; }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t layer() const { return layer_; }
  std::string device() const { return cuda_ ? "cuda:" + std::to_string(device_id_) : "cpu"; }
  int device_id() const { return device_id_; }
  bool has_shared() const { return cfg_.num_shared > 0; }
  std::string combine_weighting() const { return combine_weighting_name(weighting_); }
  std::string staging() const { return staging_name(staging_); }

  std::vector<std::string> quantizer_names() const {
    return {MoeQuantizers::dispatch_name(layer_), MoeQuantizers::combine_name(layer_)};
  }
  // A snapshot of rank `rank`'s quantizer (which: 0 dispatch, 1 combine).
  Quantizer quantizer(int which, int64_t rank) const {
    MOEFQ_CHECK(rank >= 0 && rank < ranks_, "quantizer: rank ", rank, " is not in [0, ", ranks_, ")");
    const auto held = lock();
    return which == 0 ? quantizers().dispatch(rank) : quantizers().combine(rank);
  }
  void configure(const std::map<std::string, QuantizerConfig>& configs) {
    const auto held = lock();
    fq_->configure(configs);
  }
  void start_calibration() {
    const auto held = lock();
    fq_->start_calibration();
  }
  void finish_calibration() {
    const auto held = lock();
    fq_->finish_calibration();
  }
  void abort_calibration() {
    const auto held = lock();
    fq_->abort_calibration();
  }
  std::vector<float> rank_amax(int which) const {
    MOEFQ_CHECK(which == 0 || which == 1, "MoeLayer.rank_amax: which must be 0 (dispatch) or 1 (combine), got ", which);
    const auto held = lock();
    return fq_->rank_amax(which);
  }
  void set_calibrated_amax(float dispatch_amax, float combine_amax) {
    check_amax(dispatch_amax, "set_calibrated_amax");
    check_amax(combine_amax, "set_calibrated_amax");
    const auto held = lock();
    fq_->set_calibrated_amax(dispatch_amax, combine_amax);
  }
  void save(const std::string& path) const {
    const auto held = lock();
    save_calibration(path, quantizers().calibration_state());
  }
  void load(const std::string& path) {
    const auto held = lock();
    fq_->load_calibration_file(path);
  }
  bool layout_checked(int64_t rank) const {
    MOEFQ_CHECK(rank >= 0 && rank < ranks_, "layout_checked: rank ", rank, " is not in [0, ", ranks_, ")");
    const auto held = lock();
    return fq_->layout_checked(rank);
  }

  // y = the layer's output for x routed by (topk_idx, topk_weights). shared_scratch: [N, H] bf16 on
  // the layer's GPU for the shared expert's output (CUDA with a shared expert), else None.
  void forward(const pb::capsule& xc, const pb::capsule& idxc, const pb::capsule& wc, const pb::capsule& yc,
               const pb::object& scratch_c, bool include_shared, uintptr_t stream) {
    const int64_t H = cfg_.hidden, K = cfg_.top_k;
    Tensor x(xc, "MoeLayer.forward: x"), idx(idxc, "MoeLayer.forward: topk_idx"), w(wc, "MoeLayer.forward: topk_weights"),
        y(yc, "MoeLayer.forward: out");
    const int64_t n = check_tokens(x);
    idx.expect_elem({Elem::kI32}, "int32");
    idx.expect_shape({n, K});
    w.expect_elem({Elem::kF32}, "float32");
    w.expect_shape({n, K});
    y.expect_like(x);
    for (const Tensor* t : {&idx, &w, &y}) t->expect_same_device(x);
    // The layer reads x (the shared expert, after the routed output is written) and the routing
    // while it writes out: in place is not possible.
    const std::pair<const Tensor*, const char*> inputs[] = {{&x, "x"}, {&idx, "topk_idx"}, {&w, "topk_weights"}};
    for (const auto& [t, name] : inputs)
      MOEFQ_CHECK(!y.overlaps(*t), "MoeLayer.forward: out overlaps ", name,
                  "; pass a separate out tensor (the layer cannot run in place)");
    const std::optional<Tensor> scratch = optional_tensor(scratch_c, "MoeLayer.forward: shared scratch");
    const bool add_shared = include_shared && has_shared();
    if (!cuda_) {
      pb::gil_scoped_release release;
      // The engine checks the ids, then reads them again: it works on a copy, so that another
      // thread writing the caller's arrays meanwhile cannot change ids that were already checked.
      const std::vector<int32_t> ids(idx.ptr<int32_t>(), idx.ptr<int32_t>() + idx.numel());
      const std::vector<float> weights(w.ptr<float>(), w.ptr<float>() + w.numel());
      std::vector<RankBatch> batches = split(x, ids.data(), weights.data(), y, n);
      const std::lock_guard<std::mutex> held(mu_);  // one call at a time on the layer's workspace
      if (!add_shared) return fq_->forward(batches);
      std::vector<bf16> s(size_t(n * H));  // the shared expert's output, rank r's tokens where x has them
      fq_->forward_with_shared(batches, shared_outputs(batches, x, s.data()));
      return;
    }
#ifdef MOEFQ_HAS_CUDA
    if (add_shared) {
      MOEFQ_CHECK(scratch.has_value(), "MoeLayer.forward: the shared expert needs a scratch tensor on the GPU");
      scratch->expect_like(x);
    }
    pb::gil_scoped_release release;
    const std::lock_guard<std::mutex> held(mu_);  // one call at a time on the layer's workspace
    DeviceGuard device(device_id_);
    const cuda::Stream s = as_stream(stream);
    std::vector<RankBatch> batches = split(x, idx.ptr<int32_t>(), w.ptr<float>(), y, n);
    // The workspace is reused by every call: a call on another stream than the last one waits for
    // that one's work on the GPU (eager calls; a captured graph is ordered by its replays).
    const bool eager = !cuda::stream_capturing(s);
    if (eager && last_stream_.has_value() && *last_stream_ != s) done_->wait(s);
    if (add_shared)
      fq_->forward_with_shared(batches, shared_outputs(batches, x, scratch->ptr<bf16>()), s);
    else
      fq_->forward(batches, s);
    if (eager) {
      done_->record(s);
      last_stream_ = s;
    }
#else
    (void)stream;
#endif
  }

  // The layer's router: topk_idx [N, K] int32, topk_weights [N, K] float32 for x [N, H] (on CUDA
  // with a workspace of route_workspace_bytes(N) bytes on the GPU).
  void route(const pb::capsule& xc, const pb::capsule& idxc, const pb::capsule& wc, const pb::object& ws_c,
             uintptr_t stream) {
    const int64_t K = cfg_.top_k;
    Tensor x(xc, "MoeLayer.route: x"), idx(idxc, "MoeLayer.route: topk_idx"), w(wc, "MoeLayer.route: topk_weights");
    const int64_t n = check_tokens(x, false);
    idx.expect_elem({Elem::kI32}, "int32");
    idx.expect_shape({n, K});
    w.expect_elem({Elem::kF32}, "float32");
    w.expect_shape({n, K});
    idx.expect_same_device(x);
    w.expect_same_device(x);
    const std::optional<Tensor> ws = optional_tensor(ws_c, "MoeLayer.route: workspace");
    if (!cuda_) {
      pb::gil_scoped_release release;
      const Routing r = moefq::route(cfg_, x.ptr<bf16>(), n, gate_, bias_, {}, threads_);
      if (n == 0) return;
      std::memcpy(idx.data(), r.topk_idx.data(), r.topk_idx.size() * sizeof(int32_t));
      std::memcpy(w.data(), r.topk_weights.data(), r.topk_weights.size() * sizeof(float));
      return;
    }
#ifdef MOEFQ_HAS_CUDA
    MOEFQ_CHECK(ws.has_value() && ws->bytes() >= route_workspace_bytes(n), "MoeLayer.route: the workspace needs ",
                route_workspace_bytes(n), " bytes");
    ws->expect_same_device(x);
    pb::gil_scoped_release release;
    DeviceGuard device(device_id_);
    router_->route(x.ptr<bf16>(), n, ws->data(), idx.ptr<int32_t>(), w.ptr<float>(), as_stream(stream));
#else
    (void)stream;
#endif
  }

  size_t route_workspace_bytes(int64_t n) const {
#ifdef MOEFQ_HAS_CUDA
    if (cuda_) return router_->workspace_bytes(n);
#endif
    (void)n;
    return 0;
  }

  // Raises a layout mismatch a captured graph recorded on the GPU (synchronising the stream).
  void synchronize(uintptr_t stream) {
#ifdef MOEFQ_HAS_CUDA
    if (cuda_) {
      pb::gil_scoped_release release;
      const std::lock_guard<std::mutex> held(mu_);
      DeviceGuard device(device_id_);
      fq_->synchronize(as_stream(stream));
    }
#endif
    (void)stream;
  }

 private:
  const MoeQuantizers& quantizers() const { return fq_->quantizers(); }
  // The layer's lock, taken with the GIL released: a thread that holds it may be waiting for the
  // GIL, so no thread may wait for it while holding the GIL. The caller holds the GIL again on return.
  std::unique_lock<std::mutex> lock() const {
    pb::gil_scoped_release release;
    return std::unique_lock<std::mutex>(mu_);
  }
  // x: [N, H] bf16 on the layer's device, N <= ranks * max_tokens.
  int64_t check_tokens(const Tensor& x, bool limit = true) const {
    x.expect_elem({Elem::kBF16}, "bfloat16 (or uint16 holding bf16 bits)");
    x.expect_shape({-1, cfg_.hidden});
    require_cuda_build(x);
    MOEFQ_CHECK(x.cuda() == cuda_ && (!cuda_ || x.device_id() == device_id_), x.what(), " is on ", x.device_name(),
                " but the layer is on ", device());
    const int64_t n = x.dim(0);
    MOEFQ_CHECK(!limit || n <= ranks_ * max_tokens_, x.what(), " has ", n, " tokens; the layer takes at most ranks x ",
                "max_tokens = ", ranks_ * max_tokens_, " per call");
    return n;
  }
  // Rank r's part: tokens [r * per, min(n, (r + 1) * per)), per = ceil(n / R).
  std::vector<RankBatch> split(const Tensor& x, const int32_t* idx, const float* w, const Tensor& y, int64_t n) const {
    const int64_t H = cfg_.hidden, K = cfg_.top_k, per = (n + ranks_ - 1) / ranks_;
    std::vector<RankBatch> b(static_cast<size_t>(ranks_));
    for (int64_t r = 0; r < ranks_; ++r) {
      const int64_t first = std::min(n, r * per), count = std::min(n, first + per) - first;
      b[size_t(r)] = {x.ptr<bf16>() + first * H, count, idx + first * K, w + first * K, y.ptr<bf16>() + first * H};
    }
    return b;
  }
  // Rank r's part of the shared expert's output: where its tokens are in x, in sh ([N, H] bf16).
  std::vector<bf16*> shared_outputs(const std::vector<RankBatch>& batches, const Tensor& x, bf16* sh) const {
    std::vector<bf16*> out;
    for (const RankBatch& b : batches) out.push_back(sh + (b.x - x.ptr<bf16>()));
    return out;
  }
#ifdef MOEFQ_HAS_CUDA
  std::unique_ptr<cuda::DeviceRouter> router_;
  // The end of the last eager forward's work and its stream (under mu_).
  std::unique_ptr<cuda::StreamMark> done_;
  std::optional<cuda::Stream> last_stream_;
#endif
  bool cuda_ = false;
  int device_id_ = 0;
  int64_t layer_ = 0, ranks_ = 1, max_tokens_ = 0;
  int threads_ = 0;
  CombineWeighting weighting_ = CombineWeighting::kBefore;
  Staging staging_ = Staging::kE4m3;
  MoeConfig cfg_;
  std::string source_;
  std::vector<float> gate_, bias_;
  std::unique_ptr<FakeQuantMoe> fq_;  // on the CPU or the layer's GPU
  // Serializes the calls that use or change the engine's workspace and the quantizers: a layer
  // owns one workspace, so concurrent forwards would mix their tokens.
  mutable std::mutex mu_;
};

pb::dict config_dict(const MoeConfig& c) {
  pb::dict d;
  d["name"] = c.name;
  d["hidden"] = c.hidden;
  d["intermediate"] = c.intermediate;
  d["num_experts"] = c.num_experts;
  d["top_k"] = c.top_k;
  d["num_shared"] = c.num_shared;
  d["n_group"] = c.n_group;
  d["topk_group"] = c.topk_group;
  d["routed_scaling"] = c.routed_scaling;
  d["scoring"] = scoring_name(c.scoring);
  d["norm_topk_prob"] = c.norm_topk_prob;
  d["noaux_tc"] = c.noaux_tc;
  d["swiglu_clamp"] = c.swiglu_clamp ? pb::object(pb::float_(*c.swiglu_clamp)) : pb::object(pb::none());
  return d;
}

}  // namespace

void init_layer(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("preset_names", &preset_names);
  py::class_<MoeLayer>(m, "MoeLayer")
      .def(py::init([](const std::string& preset, const std::string& config, const std::string& checkpoint,
                       int64_t layer, int64_t ranks, int64_t max_tokens, const std::string& device, int64_t seed,
                       const std::string& synthetic, int threads, const std::string& combine_weighting,
                       const std::string& staging) {
             MOEFQ_CHECK(seed >= 0, "MoeLayer: seed must be >= 0, got ", seed);
             LayerOptions o{preset, config, checkpoint, layer, ranks, max_tokens, device, uint64_t(seed), synthetic,
                            threads, combine_weighting, staging};
             py::gil_scoped_release release;  // weights are generated or loaded meanwhile
             return std::make_unique<MoeLayer>(o);
           }),
           py::arg("preset"), py::arg("config"), py::arg("checkpoint"), py::arg("layer"), py::arg("ranks"),
           py::arg("max_tokens"), py::arg("device"), py::arg("seed"), py::arg("synthetic"), py::arg("threads"),
           py::arg("combine_weighting"), py::arg("staging"))
      .def_property_readonly("combine_weighting", &MoeLayer::combine_weighting)
      .def_property_readonly("staging", &MoeLayer::staging)
      .def_property_readonly("config", [](const MoeLayer& l) { return config_dict(l.config()); })
      .def_property_readonly("source", &MoeLayer::source)
      .def_property_readonly("ranks", &MoeLayer::ranks)
      .def_property_readonly("max_tokens", &MoeLayer::max_tokens)
      .def_property_readonly("layer", &MoeLayer::layer)
      .def_property_readonly("device", &MoeLayer::device)
      .def_property_readonly("device_id", &MoeLayer::device_id)
      .def_property_readonly("has_shared", &MoeLayer::has_shared)
      .def_property_readonly("quantizer_names", &MoeLayer::quantizer_names)
      .def("quantizer", &MoeLayer::quantizer, py::arg("which"), py::arg("rank"))
      .def("configure", &MoeLayer::configure, py::arg("configs"))
      .def("start_calibration", &MoeLayer::start_calibration)
      .def("finish_calibration", &MoeLayer::finish_calibration)
      .def("abort_calibration", &MoeLayer::abort_calibration,
           "Leaves a calibration that did not finish: both quantizers as start_calibration found them.")
      .def("rank_amax", &MoeLayer::rank_amax, py::arg("which"))
      .def(
          "rank_amax",
          [](const MoeLayer& l, const std::string& which) {
            return l.rank_amax(quantizer_index(which, "MoeLayer.rank_amax"));
          },
          py::arg("which"))
      .def("set_calibrated_amax", &MoeLayer::set_calibrated_amax, py::arg("dispatch_amax"), py::arg("combine_amax"))
      .def("save_calibration", &MoeLayer::save, py::arg("path"))
      .def("load_calibration", &MoeLayer::load, py::arg("path"))
      .def("layout_checked", &MoeLayer::layout_checked, py::arg("rank"))
      .def("forward", &MoeLayer::forward, py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("out"),
           py::arg("shared_scratch"), py::arg("include_shared"), py::arg("stream"))
      .def("route", &MoeLayer::route, py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"),
           py::arg("workspace"), py::arg("stream"))
      .def("route_workspace_bytes", &MoeLayer::route_workspace_bytes, py::arg("num_tokens"))
      .def("synchronize", &MoeLayer::synchronize, py::arg("stream"));
}

}  // namespace moefq::py
