// qdq and combine on the caller's tensors: qdq_ref / combine_qdq_ref on the CPU, the QDQ and
// combine kernels on the caller's CUDA stream (no synchronisation, no allocation: capturable in a
// CUDA graph; a device amax comes in as a tensor). The GIL is released around the work.
#include <cstring>

#include "bindings.h"
#include "moefq/combine_qdq.h"
#include "moefq/errors.h"
#ifdef MOEFQ_HAS_CUDA
#include "moefq/cuda.h"
#endif

namespace moefq::py {
namespace {

namespace pb = pybind11;

#ifdef MOEFQ_HAS_CUDA
// The device amax: a 1-element float32 tensor on x's device.
const float* device_amax(const std::optional<Tensor>& amax, const Tensor& x, const char* who) {
  MOEFQ_CHECK(amax.has_value(), who, ": a CUDA tensor needs its amax as a 1-element float32 tensor on ",
              x.device_name());
  amax->expect_elem({Elem::kF32}, "float32");
  MOEFQ_CHECK(amax->numel() == 1, amax->what(), " has shape ", amax->shape_str(), "; expected one element");
  amax->expect_same_device(x);
  return amax->ptr<float>();
}
#endif

// qdq(x, y, format, amax, amax_tensor, dynamic, stream) -> the amax used (CPU, formats with a
// global amax) or None. CPU: amax None = dynamic (max |x| over the tensor). CUDA: amax_tensor holds
// the amax; with dynamic it is overwritten with max |x| first.
pb::object qdq(const pb::capsule& xc, const pb::capsule& yc, const std::string& format, std::optional<float> amax,
               const pb::object& amax_c, bool dynamic, uintptr_t stream) {
  const Format f = parse_format_arg(format, "qdq: format");
  Tensor x(xc, "qdq: x"), y(yc, "qdq: out");
  x.expect_elem({Elem::kBF16, Elem::kF32}, "bfloat16 or float32 (or uint16 holding bf16 bits)");
  y.expect_like(x);
  MOEFQ_CHECK(y.data() == x.data() || !x.overlaps(y), "qdq: out overlaps x without being x");
  const auto [rows, cols] = x.as_matrix();
  const DType dt = x.elem() == Elem::kBF16 ? DType::kBF16 : DType::kF32;
  const bool global = format_has_global_amax(f);
  if (amax) check_amax(*amax, "qdq");
  std::optional<Tensor> amax_t = optional_tensor(amax_c, "qdq: amax");
  require_cuda_build(x);
  if (!x.cuda()) {
    MOEFQ_CHECK(!amax_t, "qdq: a CPU tensor takes its amax as a number");
    float a = 0.0f;
    {
      pb::gil_scoped_release release;
      if (global) a = amax ? *amax : (dt == DType::kBF16 ? amax_ref(x.ptr<bf16>(), x.numel()) : amax_ref(x.ptr<float>(), x.numel()));
      if (dt == DType::kBF16)
        qdq_ref(f, x.ptr<bf16>(), y.ptr<bf16>(), rows, cols, a);
      else
        qdq_ref(f, x.ptr<float>(), y.ptr<float>(), rows, cols, a);
    }
    return global ? pb::object(pb::float_(a)) : pb::object(pb::none());
  }
#ifdef MOEFQ_HAS_CUDA
  MOEFQ_CHECK(!amax, "qdq: a CUDA tensor takes its amax as a 1-element float32 tensor on its device");
  float* d_amax = global ? const_cast<float*>(device_amax(amax_t, x, "qdq")) : nullptr;
  {
    pb::gil_scoped_release release;
    DeviceGuard device(x.device_id());
    cuda::qdq_device(f, dt, x.data(), y.data(), rows, cols, d_amax, global && dynamic, as_stream(stream));
  }
#else
  (void)dynamic;
  (void)stream;
#endif
  return pb::none();
}

// combine(rows, y, format, amax, amax_tensor, shared, topk_idx, topk_weights, stream): the combine
// quantizer. rows [K, T, H] bf16, y [T, H] bf16, shared [T, H] bf16 or None, topk_idx [T, K] int32
// or None (CPU: every slot active; CUDA: required), topk_weights [T, K] float32 or None (None: the
// rows are already weighted; given: combine_weighting after). format None: the plain re-sum.
void combine(const pb::capsule& rows_c, const pb::capsule& y_c, std::optional<std::string> format,
             std::optional<float> amax, const pb::object& amax_c, const pb::object& shared_c,
             const pb::object& topk_c, const pb::object& weights_c, uintptr_t stream) {
  constexpr const char* kWho = "combine_qdq_resum";
  const std::optional<Format> f = format ? std::optional<Format>(parse_format_arg(*format, "combine_qdq_resum: format"))
                                         : std::nullopt;
  Tensor rows(rows_c, "combine_qdq_resum: rows"), y(y_c, "combine_qdq_resum: out");
  const std::optional<Tensor> shared = optional_tensor(shared_c, "combine_qdq_resum: shared");
  const std::optional<Tensor> topk = optional_tensor(topk_c, "combine_qdq_resum: topk_idx");
  const std::optional<Tensor> weights = optional_tensor(weights_c, "combine_qdq_resum: topk_weights");
  std::optional<Tensor> amax_t = optional_tensor(amax_c, "combine_qdq_resum: amax");
  rows.expect_elem({Elem::kBF16}, "bfloat16 (or uint16 holding bf16 bits)");
  rows.expect_ndim(3);
  const int64_t K = rows.dim(0), T = rows.dim(1), H = rows.dim(2);
  MOEFQ_CHECK(K >= 1 && K <= 32, kWho, ": rows has shape ", rows.shape_str(), "; its first dimension (the slots K) ",
              "must be 1..32");
  y.expect_elem({Elem::kBF16}, "bfloat16 (or uint16 holding bf16 bits)");
  y.expect_shape({T, H});
  y.expect_same_device(rows);
  MOEFQ_CHECK(!y.overlaps(rows), kWho, ": out overlaps rows");
  if (shared) {
    shared->expect_elem({Elem::kBF16}, "bfloat16 (or uint16 holding bf16 bits)");
    shared->expect_shape({T, H});
    shared->expect_same_device(rows);
    MOEFQ_CHECK(!y.overlaps(*shared), kWho, ": out overlaps shared");
  }
  if (topk) {
    topk->expect_elem({Elem::kI32}, "int32 (negative: an inactive slot)");
    topk->expect_shape({T, K});
    topk->expect_same_device(rows);
  }
  if (weights) {
    weights->expect_elem({Elem::kF32}, "float32");
    weights->expect_shape({T, K});
    weights->expect_same_device(rows);
  }
  const bool global = f && format_has_global_amax(*f);
  MOEFQ_CHECK(!global || amax || amax_t, kWho, ": ", format_name(*f), " needs an amax (its global scale); ",
              "give the calibrated value");
  if (amax) check_amax(*amax, kWho);
  require_cuda_build(rows);
  if (!rows.cuda()) {
    MOEFQ_CHECK(!amax_t, kWho, ": a CPU tensor takes its amax as a number");
    HostCombineRows r;
    r.rows = rows.ptr<bf16>();
    r.slot_stride = T * H;
    r.top_k = K;
    r.num_tokens = T;
    r.hidden = H;
    r.topk_idx = topk ? topk->ptr<int32_t>() : nullptr;
    r.shared = shared ? shared->ptr<bf16>() : nullptr;
    r.topk_weights = weights ? weights->ptr<float>() : nullptr;
    pb::gil_scoped_release release;
    combine_qdq_ref(r, f, global ? *amax : 0.0f, y.ptr<bf16>());
    return;
  }
#ifdef MOEFQ_HAS_CUDA
  MOEFQ_CHECK(topk.has_value(), kWho, ": a CUDA call needs topk_idx (the moefq package makes an all-active one)");
  MOEFQ_CHECK(!amax, kWho, ": a CUDA tensor takes its amax as a 1-element float32 tensor on its device");
  const float* d_amax = global ? device_amax(amax_t, rows, kWho) : nullptr;
  cuda::DeviceCombineRows r;
  r.rows = rows.ptr<bf16>();
  r.top_k = K;
  r.num_tokens = T;
  r.hidden = H;
  r.shared = shared ? shared->ptr<bf16>() : nullptr;
  r.topk_idx = topk->ptr<int32_t>();
  r.topk_weights = weights ? weights->ptr<float>() : nullptr;
  pb::gil_scoped_release release;
  DeviceGuard device(rows.device_id());
  cuda::combine_qdq_resum(r, f, d_amax, y.ptr<bf16>(), as_stream(stream));
#else
  (void)stream;
#endif
}

}  // namespace

void init_ops(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("qdq", &qdq, py::arg("x"), py::arg("out"), py::arg("format"), py::arg("amax"), py::arg("amax_tensor"),
        py::arg("dynamic"), py::arg("stream"));
  m.def("combine", &combine, py::arg("rows"), py::arg("out"), py::arg("format"), py::arg("amax"),
        py::arg("amax_tensor"), py::arg("shared"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("stream"));
  // The bytes one row of `cols` elements takes on the wire, scales included (None: bf16), as
  // `moefq eval` reports them (moefq compare's wire bytes per token).
  m.def(
      "wire_bytes_per_row",
      [](const std::optional<std::string>& format, int64_t cols) {
        MOEFQ_CHECK(cols >= 0, "wire_bytes_per_row: cols must be >= 0, got ", cols);
        return wire_bytes_per_row(format ? std::optional<Format>(parse_format_arg(*format, "wire_bytes_per_row: format"))
                                         : std::nullopt,
                                  cols);
      },
      py::arg("format"), py::arg("cols"));
}

}  // namespace moefq::py
