#include "tensor.h"

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "moefq/errors.h"

namespace moefq::py {
namespace {

Elem classify(DLDataType t) {
  if (t.lanes != 1) return Elem::kOther;
  if ((t.code == kDLBfloat || t.code == kDLUInt) && t.bits == 16) return Elem::kBF16;
  if (t.code == kDLFloat && t.bits == 32) return Elem::kF32;
  if (t.code == kDLInt && t.bits == 32) return Elem::kI32;
  if (t.code == kDLInt && t.bits == 64) return Elem::kI64;
  return Elem::kOther;
}

std::string describe(DLDataType t) {
  const char* base = "type";
  switch (t.code) {
    case kDLInt: base = "int"; break;
    case kDLUInt: base = "uint"; break;
    case kDLFloat: base = "float"; break;
    case kDLBfloat: base = "bfloat"; break;
    case kDLComplex: base = "complex"; break;
    case kDLBool: return "bool";
    default: break;
  }
  std::string s = base + std::to_string(int(t.bits));
  if (t.code == kDLUInt && t.bits == 16) s += " (bf16 bits)";
  if (t.lanes != 1) s += " x" + std::to_string(int(t.lanes));
  return s;
}

}  // namespace

Tensor::Tensor(const pybind11::capsule& capsule, std::string what) : what_(std::move(what)) {
  PyObject* cap = capsule.ptr();
  MOEFQ_CHECK(PyCapsule_IsValid(cap, kDltensorCapsule), what_,
              ": expected a DLPack capsule (\"dltensor\") that was not consumed yet");
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, kDltensorCapsule));
  MOEFQ_CHECK(m != nullptr, what_, ": empty DLPack capsule");
  // The checks read the tensor before anything changes hands: a refused tensor stays with its
  // capsule, whose own destructor releases it the producer's way when Python drops it.
  take(m->dl_tensor);
  // The protocol: the consumer renames the capsule and becomes the owner (the capsule's own
  // destructor then leaves the tensor alone).
  if (PyCapsule_SetName(cap, kUsedDltensorCapsule) != 0) {
    PyErr_Clear();
    MOEFQ_FAIL(ErrorKind::kInternal, what_, ": could not take over the DLPack capsule");
  }
  managed_.reset(m);
}

void Tensor::take(const DLTensor& t) {
  const int32_t dev = t.device.device_type;
  MOEFQ_CHECK(dev == kDLCPU || dev == kDLCUDAHost || dev == kDLCUDA || dev == kDLCUDAManaged, what_,
              ": DLPack device type ", dev, " is not supported (moefq takes CPU and CUDA tensors)");
  cuda_ = dev == kDLCUDA || dev == kDLCUDAManaged;
  device_id_ = cuda_ ? t.device.device_id : 0;
  dtype_ = t.dtype;
  elem_ = classify(t.dtype);
  MOEFQ_CHECK(t.ndim >= 0, what_, ": negative rank");
  MOEFQ_CHECK(t.ndim == 0 || t.shape != nullptr, what_, ": DLPack tensor of rank ", t.ndim, " without a shape");
  shape_.assign(t.shape, t.shape + t.ndim);
  // The element count and the byte size, checked here once for every entry point: a product that
  // overflows would make every size computed from it wrong. A zero extent makes the tensor empty
  // whatever the others are.
  numel_ = 1;
  for (int64_t d : shape_) MOEFQ_CHECK(d >= 0, what_, ": negative extent in shape ", shape_str());
  const bool empty = std::find(shape_.begin(), shape_.end(), int64_t{0}) != shape_.end();
  const uint64_t elem_bytes = (uint64_t(dtype_.bits) * std::max<uint64_t>(dtype_.lanes, 1) + 7) / 8;
  uint64_t bytes = elem_bytes;
  for (int64_t d : shape_) {
    if (empty) break;
    MOEFQ_CHECK(!__builtin_mul_overflow(numel_, d, &numel_) && !__builtin_mul_overflow(bytes, uint64_t(d), &bytes) &&
                    bytes <= uint64_t(std::numeric_limits<int64_t>::max()),
                what_, ": shape ", shape_str(), " of ", describe(dtype_),
                " overflows: its element count or byte size does not fit in 64 bits");
  }
  if (empty) numel_ = 0;
  if (t.strides && numel_ > 0) {
    int64_t expected = 1;
    for (int32_t i = t.ndim - 1; i >= 0; --i) {
      MOEFQ_CHECK(shape_[size_t(i)] == 1 || t.strides[i] == expected, what_, " ", shape_str(),
                  " is not contiguous (row-major); pass a contiguous tensor (e.g. x.contiguous())");
      expected *= shape_[size_t(i)];
    }
  }
  data_ = static_cast<char*>(t.data) + t.byte_offset;
}

std::string Tensor::device_name() const { return cuda_ ? "cuda:" + std::to_string(device_id_) : "cpu"; }
std::string Tensor::dtype_name() const { return describe(dtype_); }
size_t Tensor::bytes() const { return size_t(numel_) * ((size_t(dtype_.bits) + 7) / 8); }

std::pair<int64_t, int64_t> Tensor::as_matrix() const {
  if (shape_.empty()) return {1, 1};
  const int64_t cols = shape_.back();
  return {cols == 0 ? 0 : numel_ / cols, cols};
}

std::string Tensor::shape_str() const { return moefq::shape_str(shape_); }

void Tensor::expect_elem(std::initializer_list<Elem> allowed, const char* expected) const {
  for (Elem e : allowed)
    if (e == elem_) return;
  MOEFQ_FAIL(ErrorKind::kBadInput, what_, " has dtype ", dtype_name(), "; expected ", expected);
}

void Tensor::expect_ndim(int64_t ndim) const {
  MOEFQ_CHECK(this->ndim() == ndim, what_, " has shape ", shape_str(), "; expected ", ndim, " dimensions");
}

void Tensor::expect_shape(std::initializer_list<int64_t> shape) const {
  bool ok = int64_t(shape.size()) == ndim();
  size_t i = 0;
  for (int64_t d : shape) {
    ok = ok && (d < 0 || d == shape_[i]);
    ++i;
  }
  if (ok) return;
  std::string want = "[";
  i = 0;
  for (int64_t d : shape) want += (i++ ? ", " : "") + (d < 0 ? std::string("*") : std::to_string(d));
  want += ']';
  MOEFQ_FAIL(ErrorKind::kBadInput, what_, " has shape ", shape_str(), "; expected ", want);
}

void Tensor::expect_same_device(const Tensor& o) const {
  MOEFQ_CHECK(cuda_ == o.cuda_ && device_id_ == o.device_id_, what_, " is on ", device_name(), " but ", o.what_,
              " is on ", o.device_name());
}

bool Tensor::overlaps(const Tensor& o) const {
  if (cuda_ != o.cuda_ || bytes() == 0 || o.bytes() == 0) return false;
  const auto* a = static_cast<const char*>(data_);
  const auto* b = static_cast<const char*>(o.data_);
  return a < b + o.bytes() && b < a + bytes();
}

void Tensor::expect_like(const Tensor& o) const {
  expect_same_device(o);
  MOEFQ_CHECK(elem_ == o.elem_, what_, " has dtype ", dtype_name(), " but ", o.what_, " has ", o.dtype_name());
  MOEFQ_CHECK(shape_ == o.shape_, what_, " has shape ", shape_str(), " but ", o.what_, " has ", o.shape_str());
}

std::optional<Tensor> optional_tensor(const pybind11::object& capsule, const std::string& what) {
  if (capsule.is_none()) return std::nullopt;
  MOEFQ_CHECK(pybind11::isinstance<pybind11::capsule>(capsule), what, ": expected a DLPack capsule or None");
  return Tensor(pybind11::reinterpret_borrow<pybind11::capsule>(capsule), what);
}

}  // namespace moefq::py
