// The DLPack C ABI (v0.8, the unversioned "dltensor" capsule that torch.utils.dlpack.to_dlpack,
// torch.Tensor.__dlpack__ and numpy.ndarray.__dlpack__ produce), written from the published
// specification: a tensor descriptor, its device and element type, and the managed wrapper whose
// deleter the consumer calls when done. Layouts must match the specification byte for byte.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moefq::py {

enum DLDeviceType : int32_t {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,  // pinned host memory: host-addressable
  kDLCUDAManaged = 13,
};

struct DLDevice {
  int32_t device_type;  // DLDeviceType
  int32_t device_id;
};

enum DLDataTypeCode : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLOpaqueHandle = 3,
  kDLBfloat = 4,
  kDLComplex = 5,
  kDLBool = 6,
};

struct DLDataType {
  uint8_t code;  // DLDataTypeCode
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;    // [ndim]
  int64_t* strides;  // [ndim] in elements, or null for a compact row-major tensor
  uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

static_assert(sizeof(DLDevice) == 8 && sizeof(DLDataType) == 4);
static_assert(offsetof(DLTensor, device) == 8 && offsetof(DLTensor, ndim) == 16 && offsetof(DLTensor, dtype) == 20 &&
              offsetof(DLTensor, shape) == 24 && offsetof(DLTensor, strides) == 32 &&
              offsetof(DLTensor, byte_offset) == 40 && sizeof(DLTensor) == 48);
static_assert(offsetof(DLManagedTensor, manager_ctx) == 48 && offsetof(DLManagedTensor, deleter) == 56);

// The capsule names of the protocol: a producer's capsule, renamed by the consumer that takes it.
inline constexpr const char* kDltensorCapsule = "dltensor";
inline constexpr const char* kUsedDltensorCapsule = "used_dltensor";

}  // namespace moefq::py
