// safetensors files: a validating parser, a reader and an atomic writer.
// Layout: u64 little-endian header length N, N bytes of JSON header, then the data buffer, which
// the tensors cover exactly (no overlap, no hole, no trailing byte). Every malformed input is
// rejected with moefq::Error (kBadInput) before anything sized by the input is allocated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moefq/fileio.h"

namespace moefq {

class AtomicFile;

enum class StDtype {
  kBool,
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kF8E8M0,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64,
};

// The name used in the header ("BF16", "F8_E4M3", ...).
const char* st_dtype_name(StDtype dtype);
// Bytes per element.
size_t st_dtype_size(StDtype dtype);
// Exact, case-sensitive match of a header dtype name; nullopt when unknown.
std::optional<StDtype> parse_st_dtype(std::string_view name);

struct TensorInfo {
  std::string name;
  StDtype dtype = StDtype::kU8;
  std::vector<int64_t> shape;  // every dim >= 0; [] is a scalar (one element)
  uint64_t begin = 0;          // byte offsets relative to the start of the data buffer
  uint64_t end = 0;            // end - begin == numel() * st_dtype_size(dtype)
  int64_t numel() const;
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // sorted by (begin, end): consecutive and covering the data
  std::map<std::string, std::string> metadata;  // the "__metadata__" object, if any
  uint64_t data_start = 0;                      // 8 + N: file offset of the data buffer
};

// The largest header accepted, in bytes (the reference implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Validates the whole file (header and the data buffer's extent) and returns its header.
// Throws moefq::Error (kBadInput) whose message starts with `what` (usually the file name).
SafetensorsHeader parse_safetensors(std::span<const uint8_t> file_bytes, std::string_view what);

// A safetensors file opened for reading: the header is read and validated when it opens, tensor
// data only when asked for (pread, no mapping: a file truncated meanwhile gives an error, never
// SIGBUS).
class SafetensorsFile {
 public:
  // Opens and validates `path`, a regular file (InputFile's refusals); throws moefq::Error whose
  // message starts with `what` (default: the path) on any failure.
  static SafetensorsFile open(const std::string& path, std::string_view what = {});

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  // nullptr when the file has no tensor of that name.
  const TensorInfo* find(std::string_view name) const;
  // The tensor's bytes; `info` must come from this file's header(). Throws (bad input) when the
  // file has become shorter since it was opened.
  std::vector<uint8_t> read(const TensorInfo& info) const;
  // dst.size() bytes of the tensor from byte `offset` of its data into dst.
  void read_into(const TensorInfo& info, std::span<uint8_t> dst, uint64_t offset = 0) const;

 private:
  explicit SafetensorsFile(InputFile file) : file_(std::move(file)) {}

  InputFile file_;
  std::string path_;
  SafetensorsHeader header_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in header_.tensors
};

// Collects tensors and metadata, then writes them as one safetensors file. Tensors are laid out
// in the order they were added; the header is padded with spaces so the data starts at a
// multiple of 8 bytes.
class SafetensorsWriter {
 public:
  // Copies `bytes`, which must hold exactly numel(shape) * st_dtype_size(dtype) bytes. Throws on
  // a duplicate or reserved name ("__metadata__"), a negative dim or a size that overflows.
  void add(std::string name, StDtype dtype, std::vector<int64_t> shape,
           std::span<const uint8_t> bytes);
  void set_metadata(std::string key, std::string value);
  size_t num_tensors() const { return tensors_.size(); }

  // Writes to a temporary file in the directory of `path` and renames it over `path`; on any
  // failure the temporary is removed and an existing `path` is left untouched.
  void write(const std::string& path) const;
  // Writes the whole file into `out` and finishes it (complete, synced, not yet published): the
  // caller publishes it with the other outputs of its command.
  void write_to(AtomicFile& out) const;

 private:
  struct Pending {
    std::string name;
    StDtype dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Pending> tensors_;
  std::set<std::string, std::less<>> names_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moefq
