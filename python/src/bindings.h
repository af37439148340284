// The parts of the _moefq extension module, each registered by its own function (module.cpp calls
// them), and what they share: the device glue of the CUDA paths.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // every part: the same type casters in each translation unit

#include <cstdint>
#include <optional>
#include <string>

#include "moefq/qdq.h"
#include "tensor.h"

#ifdef MOEFQ_HAS_CUDA
#include "moefq/cuda_device.h"
#endif

namespace moefq::py {

void init_ops(pybind11::module_& m);        // qdq, combine (ops.cpp)
void init_quantizer(pybind11::module_& m);  // QuantSpec, Quantizer, recipes, calibration files (quantizer.cpp)
void init_layer(pybind11::module_& m);      // MoeLayer (layer.cpp)
void init_eval(pybind11::module_& m);       // eval, calibrate, safetensors files (eval.cpp)

// "fp8" ... "int8", else bad input naming `who` and the choices.
Format parse_format_arg(const std::string& name, const char* who);
// An amax given as a number: finite and >= 0, else bad input naming `who`.
float check_amax(float amax, const char* who);
// Whether this build has the CUDA kernels, and how many GPUs are usable (0 without a driver).
bool built_with_cuda();
int cuda_device_count();
// A CUDA tensor needs a CUDA build: an error naming the tensor otherwise.
void require_cuda_build(const Tensor& t);

#ifdef MOEFQ_HAS_CUDA
// Makes a device current for a scope (the caller's tensors may live on another device than the
// current one); restores the previous one.
using cuda::DeviceGuard;
// The caller's stream, passed from Python as an integer (torch.cuda.Stream.cuda_stream).
inline cuda::Stream as_stream(uintptr_t stream) { return reinterpret_cast<cuda::Stream>(stream); }
#endif

}  // namespace moefq::py
