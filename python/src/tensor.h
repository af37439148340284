// Tensors handed over from Python through DLPack: the consumer side of the capsule protocol (the
// capsule is renamed "used_dltensor" and its tensor's deleter runs when the Tensor goes) and the
// checks every entry point makes, with messages naming the function and the argument. Nothing is
// copied: a Tensor is a view of the caller's memory, on the CPU or on one CUDA device.
// A Tensor must be created and destroyed with the GIL held (numpy's deleter needs it); its data
// may be used with the GIL released.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dlpack.h"

namespace moefq::py {

// Element types the binding works with. kBF16 also covers uint16 tensors (numpy has no bfloat16:
// a uint16 array holding bf16 bit patterns stands for one).
enum class Elem { kBF16, kF32, kI32, kI64, kOther };

class Tensor {
 public:
  // Takes over the tensor of a "dltensor" capsule. `what` names it in messages ("qdq: x").
  // Requires a C-contiguous tensor with one lane per element, on the CPU (or pinned host memory)
  // or a CUDA device. A tensor it refuses goes back to its capsule (not consumed), which
  // releases it when Python drops it.
  Tensor(const pybind11::capsule& capsule, std::string what);
  Tensor(Tensor&& other) noexcept = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  Tensor& operator=(Tensor&&) = delete;

  const std::string& what() const { return what_; }
  bool cuda() const { return cuda_; }
  int device_id() const { return device_id_; }
  std::string device_name() const;  // "cpu", "cuda:0"
  Elem elem() const { return elem_; }
  std::string dtype_name() const;   // "bfloat16", "uint16 (bf16 bits)", "float32", "int64", ...
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t ndim() const { return int64_t(shape_.size()); }
  int64_t dim(int64_t i) const { return shape_[size_t(i)]; }
  int64_t numel() const { return numel_; }
  size_t bytes() const;
  void* data() const { return data_; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data_);
  }
  // [rows, cols] view: blocks run along the last dimension (a 0-d tensor is [1, 1]).
  std::pair<int64_t, int64_t> as_matrix() const;
  std::string shape_str() const;  // "[4, 128]"

  // Checks (bad input naming the tensor): the element type is one of `allowed` (described as
  // `expected`), the rank, the shape (-1 = any extent).
  void expect_elem(std::initializer_list<Elem> allowed, const char* expected) const;
  void expect_shape(std::initializer_list<int64_t> shape) const;
  void expect_ndim(int64_t ndim) const;
  // Same device as `other`, same element type, same shape.
  void expect_same_device(const Tensor& other) const;
  void expect_like(const Tensor& other) const;
  // Whether the two tensors share a byte of memory (on the same kind of device).
  bool overlaps(const Tensor& other) const;

 private:
  // Calls the producer's deleter when a Tensor that took its tensor over goes.
  struct Release {
    void operator()(DLManagedTensor* m) const {
      if (m->deleter) m->deleter(m);
    }
  };
  std::unique_ptr<DLManagedTensor, Release> managed_;
  // The checks and fields of the constructor, read before the tensor is taken over.
  void take(const DLTensor& t);
  std::string what_;
  void* data_ = nullptr;
  bool cuda_ = false;
  int device_id_ = 0;
  Elem elem_ = Elem::kOther;
  DLDataType dtype_{};
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
};

// An optional capsule argument (None from Python).
std::optional<Tensor> optional_tensor(const pybind11::object& capsule, const std::string& what);

}  // namespace moefq::py
