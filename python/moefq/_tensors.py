"""How moefq takes the caller's tensors: a DLPack capsule of the tensor itself (never a copy), the
caller's CUDA stream, and new tensors of the caller's kind (torch in, torch out; numpy in, numpy
out). torch and numpy are looked up only when the caller already imported them."""

import math
import numbers
import sys

# DLPack device types (dlpack.h): CUDA memory and CUDA managed memory.
_DL_CUDA = (2, 13)
# DLPack's stream convention for CUDA producers: 1 is the legacy default stream.
_LEGACY_DEFAULT_STREAM = 1


def _torch():
    return sys.modules.get("torch")


def _numpy():
    return sys.modules.get("numpy")


def is_torch(x):
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def is_numpy(x):
    np = _numpy()
    return np is not None and isinstance(x, np.ndarray)


def check_tensor(x, what):
    if not (is_torch(x) or is_numpy(x) or hasattr(x, "__dlpack__")):
        raise TypeError(f"{what}: expected a torch tensor, a numpy array or an object with __dlpack__, "
                        f"got {type(x).__name__}")


def check_out(out, what):
    """moefq writes `out` outside autograd, which never learns of the change: refuse a torch tensor
    that requires grad (while grad mode is on), as torch refuses an in-place op on a leaf that
    requires grad, rather than leave a graph that silently computes wrong gradients."""
    if is_torch(out) and out.requires_grad and _torch().is_grad_enabled():
        raise ValueError(f"{what} requires grad, and moefq writes it outside autograd; pass a tensor that does "
                         "not require grad, work under torch.no_grad(), or use moefq.torch's modules for a "
                         "straight-through gradient")


def is_cuda(x):
    if is_torch(x):
        return x.is_cuda
    if is_numpy(x):
        return False
    return x.__dlpack_device__()[0] in _DL_CUDA


def stream_of(x, stream=None):
    """The CUDA stream the work goes on: torch's current stream on x's device for torch tensors
    (new tensors moefq makes come from that stream too); for other CUDA tensors `stream` (an integer
    handle in DLPack's convention or an object with .cuda_stream), by default the legacy default
    stream."""
    if stream is not None:
        if is_torch(x):
            raise ValueError("stream= is for tensors other than torch's; for torch tensors moefq uses the current "
                             "stream: run the call under `with torch.cuda.stream(s):`")
        return int(getattr(stream, "cuda_stream", stream))
    if is_torch(x) and x.is_cuda:
        return _torch().cuda.current_stream(x.device).cuda_stream
    return _LEGACY_DEFAULT_STREAM if is_cuda(x) else 0


def capsule(x, what, stream=0):
    """A DLPack capsule of x itself. torch tensors lose their autograd link (detach is a view)."""
    check_tensor(x, what)
    if is_torch(x):
        return _torch().utils.dlpack.to_dlpack(x.detach())
    if is_numpy(x):
        if not x.flags.writeable:
            raise ValueError(f"{what}: the numpy array is read-only, and numpy exports only writeable arrays "
                             "through DLPack; pass a writeable array (e.g. x.copy())")
        return x.__dlpack__()
    return x.__dlpack__(stream=stream) if is_cuda(x) else x.__dlpack__()


def optional_capsule(x, what, stream=0):
    return None if x is None else capsule(x, what, stream)


def empty(like, shape, dtype=None):
    """A new contiguous tensor of like's kind and device; dtype: 'bfloat16' (bf16 in torch, uint16
    bf16 bits in numpy), 'float32', 'int32', or None for like's own."""
    if is_torch(like):
        t = _torch()
        dt = like.dtype if dtype is None else {"bfloat16": t.bfloat16, "float32": t.float32, "int32": t.int32}[dtype]
        return t.empty(tuple(shape), dtype=dt, device=like.device)
    if is_numpy(like):
        np = _numpy()
        dt = like.dtype if dtype is None else {"bfloat16": np.uint16, "float32": np.float32, "int32": np.int32}[dtype]
        return np.empty(tuple(shape), dtype=dt)
    raise TypeError(f"moefq makes new tensors for torch and numpy only; pass out= for {type(like).__name__}")


def empty_like(x):
    return empty(x, tuple(x.shape))


_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


def as_int32(idx, what):
    """Routing indices as int32 (a copy only when they are another integer type). Ids of a wider
    type must not wrap (a wrapped id would route to another expert): on the host they are checked to
    fit int32; int64 ids on CUDA (what torch.topk returns) are clamped to int32's range instead, on
    the device, so no host sync is needed and a CUDA graph can capture the conversion. A clamped id
    keeps its meaning: a negative one stays inactive, a positive one stays past every expert."""
    if is_torch(idx):
        t = _torch()
        if idx.dtype in (t.int16, t.int8, t.uint8):
            return idx.to(t.int32)
        if idx.dtype == t.int64:
            if idx.is_cuda:
                return idx.clamp(_INT32_MIN, _INT32_MAX).to(t.int32)
            _check_int32_range(idx, what)
            return idx.to(t.int32)
        return idx
    if is_numpy(idx):
        np = _numpy()
        if idx.dtype != np.int32 and np.issubdtype(idx.dtype, np.integer):
            info = np.iinfo(idx.dtype)
            if info.min < _INT32_MIN or info.max > _INT32_MAX:
                _check_int32_range(idx, what)
            return idx.astype(np.int32)
        return idx
    return idx


def _check_int32_range(idx, what):
    if idx.numel() if is_torch(idx) else idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise ValueError(f"{what}: ids must fit int32 ([{_INT32_MIN}, {_INT32_MAX}]), got values in [{lo}, {hi}]")


def real_number(value, what):
    """value as a float if it is a real number (int, float, numpy scalar; not bool, not a string),
    else TypeError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: expected a number, got {type(value).__name__}")
    return float(value)


def check_amax(amax, who, stored=False):
    """amax as a finite float: > 0 for an amax the caller gives (as `moefq qdq --amax`); >= 0 for one
    a quantizer stored (max calibration over all-zero data stores 0, as the C++ quantizer and the
    calibration files do)."""
    value = real_number(amax, f"{who}: amax")
    if not (math.isfinite(value) and (value >= 0 if stored else value > 0)):
        raise ValueError(f"{who}: amax must be a finite number {'>= 0' if stored else '> 0'}, got {amax}")
    return value


def is_tensor(x):
    return is_torch(x) or is_numpy(x) or hasattr(x, "__dlpack__")


def amax_args(x, amax, global_amax, who, stored=False):
    """(amax as a number, amax as a device tensor, dynamic) for the extension: CPU work takes a
    number (None: dynamic), CUDA work a 1-element float32 tensor on x's device (made with torch from
    a number; for a dynamic amax it receives max |x|). stored: amax is a quantizer's own (0 allowed,
    see check_amax)."""
    if not global_amax:
        return None, None, False
    if not is_cuda(x):
        if amax is None:
            return None, None, True
        if is_tensor(amax):
            amax = float(amax.item() if hasattr(amax, "item") else amax)
        return check_amax(amax, who, stored), None, False
    if amax is not None and is_tensor(amax):
        return None, capsule(amax, f"{who}: amax"), False
    if not is_torch(x):
        raise ValueError(f"{who}: for a CUDA tensor that is not a torch tensor, give amax as a 1-element float32 "
                         "tensor on its device")
    t = _torch()
    if amax is None:
        return None, capsule(t.empty(1, dtype=t.float32, device=x.device), f"{who}: amax"), True
    value = check_amax(amax, who, stored)
    return None, capsule(t.full((1,), value, dtype=t.float32, device=x.device), f"{who}: amax"), False
