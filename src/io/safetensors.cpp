#include "moefq/safetensors.h"


#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <ostream>
#include <set>
#include <unordered_set>
#include <limits>
#include <tuple>
#include <nlohmann/json.hpp>
#include <utility>

#include "moefq/errors.h"
#include "moefq/fileio.h"

namespace moefq {
namespace {

using Json = nlohmann::json;

struct DtypeEntry {
  StDtype dtype;
  const char* name;
  size_t size;
};

constexpr DtypeEntry kDtypes[] = {
    {StDtype::kBool, "BOOL", 1},     {StDtype::kU8, "U8", 1},   {StDtype::kI8, "I8", 1},
    {StDtype::kF8E5M2, "F8_E5M2", 1}, {StDtype::kF8E4M3, "F8_E4M3", 1},
    {StDtype::kF8E8M0, "F8_E8M0", 1}, {StDtype::kI16, "I16", 2}, {StDtype::kU16, "U16", 2},
    {StDtype::kF16, "F16", 2},       {StDtype::kBF16, "BF16", 2}, {StDtype::kI32, "I32", 4},
    {StDtype::kU32, "U32", 4},       {StDtype::kF32, "F32", 4}, {StDtype::kF64, "F64", 8},
    {StDtype::kI64, "I64", 8},       {StDtype::kU64, "U64", 8},
};

const DtypeEntry& dtype_entry(StDtype dtype) {
  for (const DtypeEntry& e : kDtypes)
    if (e.dtype == dtype) return e;
  MOEFQ_FAIL(ErrorKind::kInternal, "unknown StDtype ", static_cast<int>(dtype));
}

std::string known_dtype_names() {
  std::string out;
  for (const DtypeEntry& e : kDtypes) {
    if (!out.empty()) out += ", ";
    out += e.name;
  }
  return out;
}

// A JSON-quoted, length-capped copy of a user-supplied string for error messages; invalid UTF-8
// becomes U+FFFD rather than a second error.
std::string quote(std::string_view s) {
  constexpr size_t kMaxShown = 120;
  std::string shown(s.substr(0, kMaxShown));
  std::string out = Json(shown).dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > kMaxShown) out += "...";
  return out;
}

// Dimensions a message shows of a shape read from a file.
constexpr size_t kMaxShownDims = 8;

// Product of the dims times `elem_size`, or nullopt when it does not fit in 64 bits. A zero dim
// makes the tensor empty whatever the other dims are, so it is checked first.
std::optional<uint64_t> checked_byte_count(const std::vector<int64_t>& shape, uint64_t elem_size) {
  for (int64_t d : shape)
    if (d == 0) return 0;
  uint64_t total = elem_size;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(total, static_cast<uint64_t>(d), &total)) return std::nullopt;
  }
  return total;
}

bool is_valid_utf8_json_string(const std::string& s) {
  try {
    (void)Json(s).dump();
    return true;
  } catch (const Json::exception&) {
    return false;
  }
}

uint64_t load_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The header's nesting never exceeds 3 (root, tensor entry, shape); anything deeper is rejected
// while parsing so a hostile header cannot build a deep tree.
constexpr int kMaxJsonDepth = 8;

// Reads the header as a stream of SAX events and hands each member of the root object to
// `on_member` as soon as it is complete: the parse is linear in the header's size (one hash
// lookup per root key; a DOM parser with a duplicate-key callback rescanned the whole root object
// after every entry, which made a header of many tensors quadratic), and only one entry's tree
// exists at a time. Duplicate keys in any object and nesting deeper than kMaxJsonDepth are errors.
class HeaderReader {
 public:
  using Member = std::function<void(const std::string& key, const Json& value)>;
  HeaderReader(std::string what, Member on_member) : what_(std::move(what)), on_member_(std::move(on_member)) {}

  void parse(std::string_view text) {
    root_keys_.reserve(text.size() / 64);  // an entry takes 60 bytes or more
    // sax_parse reports a syntax error through parse_error (which throws) or returns false.
    const bool ok = Json::sax_parse(text.begin(), text.end(), this, nlohmann::detail::input_format_t::json,
                                    /*strict=*/true, /*ignore_comments=*/false);
    MOEFQ_CHECK(ok, what_, ": header is not valid JSON");
    MOEFQ_CHECK(root_type_.empty(), what_, ": header is a JSON ", root_type_,
                ", expected an object mapping tensor names to {dtype, shape, data_offsets}");
  }

  // ---- nlohmann's SAX interface.
  bool null() { return value(Json(nullptr)); }
  bool boolean(bool v) { return value(Json(v)); }
  bool number_integer(Json::number_integer_t v) { return value(Json(v)); }
  bool number_unsigned(Json::number_unsigned_t v) { return value(Json(v)); }
  bool number_float(Json::number_float_t v, const std::string&) { return value(Json(v)); }
  bool string(std::string& v) { return value(Json(std::move(v))); }
  bool binary(Json::binary_t& v) { return value(Json::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(Json::object()); }
  bool start_array(std::size_t) { return open(Json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(std::string& k) {
    if (depth_ == 1) {
      MOEFQ_CHECK(root_keys_.insert(k).second, what_, ": header has the key ", quote(k), " twice in one object");
      member_key_ = std::move(k);
    } else {
      MOEFQ_CHECK(nested_keys_.back().insert(k).second, what_, ": header has the key ", quote(k),
                  " twice in one object");
      key_ = std::move(k);
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    MOEFQ_FAIL(ErrorKind::kBadInput, what_, ": header is not valid JSON: ", e.what());
  }

 private:
  // A scalar: the root itself (not an object), a member of the root, or inside a member.
  bool value(Json v) {
    if (depth_ == 0) {
      root_type_ = v.type_name();
    } else if (depth_ == 1) {
      on_member_(member_key_, v);
    } else {
      insert(std::move(v));
    }
    return true;
  }
  bool open(Json container) {
    MOEFQ_CHECK(depth_ < kMaxJsonDepth, what_, ": header nests deeper than ", kMaxJsonDepth,
                " levels; a safetensors header is at most 3 deep");
    const bool object = container.is_object();
    ++depth_;
    if (depth_ == 1) {
      if (!object) root_type_ = container.type_name();
      MOEFQ_CHECK(object, what_, ": header is a JSON ", root_type_,
                  ", expected an object mapping tensor names to {dtype, shape, data_offsets}");
      return true;
    }
    if (depth_ == 2) {
      member_ = std::move(container);
      open_.assign(1, &member_);
    } else {
      open_.push_back(&insert(std::move(container)));
    }
    if (object) nested_keys_.emplace_back();
    return true;
  }
  bool close() {
    if (depth_ >= 2) {
      if (open_.back()->is_object()) nested_keys_.pop_back();
      open_.pop_back();
      if (depth_ == 2) on_member_(member_key_, member_);
    }
    --depth_;
    return true;
  }
  // Adds v to the innermost open container (an array, or an object under the last key) and
  // returns where it went. The containers above it get nothing until it closes, so the pointers
  // to them stay valid.
  Json& insert(Json v) {
    Json& top = *open_.back();
    if (top.is_array()) {
      top.push_back(std::move(v));
      return top.back();
    }
    return top[key_] = std::move(v);
  }

  std::string what_;
  Member on_member_;
  int depth_ = 0;
  std::string root_type_;                       // when the root is not an object
  std::unordered_set<std::string> root_keys_;   // every key of the root object so far
  std::string member_key_, key_;                // the root member being read; the last nested key
  Json member_;                                 // its value, while it is a container
  std::vector<Json*> open_;                     // the open containers inside it
  std::vector<std::set<std::string>> nested_keys_;
};

// Reads a non-negative JSON integer that fits `limit`; `field` names it in messages.
// "FILE: tensor NAME" for messages, built only when one is made (a header may hold millions of entries).
struct Where {
  const std::string& what;
  const std::string& name;
};
std::ostream& operator<<(std::ostream& os, const Where& w) { return os << w.what << ": tensor " << quote(w.name); }

// A field's name for messages, with its index when it has one ("shape dimension 2").
struct Field {
  const char* name;
  int64_t index = -1;
};
std::ostream& operator<<(std::ostream& os, const Field& f) {
  os << f.name;
  if (f.index >= 0) os << ' ' << std::to_string(f.index);
  return os;
}

uint64_t get_unsigned(const Json& v, uint64_t limit, const Where& where, const Field& field) {
  if (v.is_number_unsigned()) {
    const uint64_t x = v.get<uint64_t>();
    MOEFQ_CHECK(x <= limit, where, ": ", field, " is ", x, ", larger than the maximum ", limit);
    return x;
  }
  MOEFQ_CHECK(!v.is_number_integer(), where, ": ", field, " is negative (", v.get<int64_t>(), ")");
  MOEFQ_CHECK(!v.is_number_float(), where, ": ", field, " is not an integer (", v.dump(),
              "); it must be a non-negative integer");
  MOEFQ_FAIL(ErrorKind::kBadInput, where, ": ", field, " is a JSON ", v.type_name(),
             ", expected a non-negative integer");
}

const Json& require_field(const Json& entry, const char* field, const Where& where) {
  auto it = entry.find(field);
  MOEFQ_CHECK(it != entry.end(), where, ": missing \"", field, "\"");
  return *it;
}

TensorInfo parse_tensor_entry(const std::string& name, const Json& entry, uint64_t data_size,
                              const std::string& what) {
  const Where where{what, name};
  MOEFQ_CHECK(entry.is_object(), where, ": entry is a JSON ", entry.type_name(),
              ", expected an object with \"dtype\", \"shape\" and \"data_offsets\"");
  TensorInfo info;
  info.name = name;

  const Json& dtype = require_field(entry, "dtype", where);
  MOEFQ_CHECK(dtype.is_string(), where, ": \"dtype\" is a JSON ", dtype.type_name(),
              ", expected a string such as \"BF16\"");
  const std::string& dtype_name = dtype.get_ref<const std::string&>();
  const std::optional<StDtype> parsed_dtype = parse_st_dtype(dtype_name);
  MOEFQ_CHECK(parsed_dtype.has_value(), where, ": unknown dtype ", quote(dtype_name), " (known: ",
              known_dtype_names(), ")");
  info.dtype = *parsed_dtype;

  const Json& shape = require_field(entry, "shape", where);
  MOEFQ_CHECK(shape.is_array(), where, ": \"shape\" is a JSON ", shape.type_name(),
              ", expected an array of non-negative integers");
  info.shape.reserve(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    const uint64_t d = get_unsigned(shape[i], std::numeric_limits<int64_t>::max(), where,
                                    Field{"shape dimension", int64_t(i)});
    info.shape.push_back(static_cast<int64_t>(d));
  }
  const std::optional<uint64_t> num_bytes = checked_byte_count(info.shape, st_dtype_size(info.dtype));
  MOEFQ_CHECK(num_bytes.has_value(), where, ": shape ", shape_str(info.shape, kMaxShownDims), " of ", dtype_name,
              " overflows: its byte count does not fit in 64 bits");

  const Json& offsets = require_field(entry, "data_offsets", where);
  MOEFQ_CHECK(offsets.is_array() && offsets.size() == 2, where, ": \"data_offsets\" is ",
              offsets.is_array() ? "an array of " + std::to_string(offsets.size()) + " elements"
                                 : std::string("a JSON ") + offsets.type_name(),
              ", expected [begin, end]");
  const uint64_t kAny = std::numeric_limits<uint64_t>::max();
  info.begin = get_unsigned(offsets[0], kAny, where, Field{"data_offsets begin"});
  info.end = get_unsigned(offsets[1], kAny, where, Field{"data_offsets end"});
  MOEFQ_CHECK(info.begin <= info.end, where, ": data_offsets [", info.begin, ", ", info.end,
              "] has begin > end");
  MOEFQ_CHECK(info.end <= data_size, where, ": data_offsets [", info.begin, ", ", info.end,
              "] end out of range: the data buffer holds ", data_size, " bytes (truncated file?)");
  MOEFQ_CHECK(*num_bytes == info.end - info.begin, where, ": shape ", shape_str(info.shape, kMaxShownDims), " of ",
              dtype_name, " needs ", *num_bytes, " bytes but data_offsets [", info.begin, ", ",
              info.end, "] span ", info.end - info.begin, " bytes");
  return info;
}

void parse_metadata(const Json& meta, std::map<std::string, std::string>& out, const std::string& what) {
  MOEFQ_CHECK(meta.is_object(), what, ": \"__metadata__\" is a JSON ", meta.type_name(),
              ", expected an object of string values");
  for (const auto& [key, value] : meta.items()) {
    MOEFQ_CHECK(value.is_string(), what, ": \"__metadata__\" value for key ", quote(key),
                " is a JSON ", value.type_name(), ", expected a string");
    out.emplace(key, value.get<std::string>());
  }
}

// Tensors sorted by (begin, end) must tile [0, data_size) exactly, as the reference reader requires.
void check_coverage(const std::vector<TensorInfo>& tensors, uint64_t data_size, const std::string& what) {
  uint64_t cursor = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : tensors) {
    MOEFQ_CHECK(t.begin >= cursor, what, ": tensors ", quote(prev ? prev->name : ""), " [",
                prev ? prev->begin : 0, ", ", prev ? prev->end : 0, "] and ", quote(t.name), " [",
                t.begin, ", ", t.end, "] overlap");
    MOEFQ_CHECK(t.begin == cursor, what, ": hole in the data buffer: bytes [", cursor, ", ",
                t.begin, ") are not covered by any tensor (before ", quote(t.name), ")");
    cursor = t.end;
    prev = &t;
  }
  MOEFQ_CHECK(cursor == data_size, what, ": the data buffer has ", data_size - cursor,
              " trailing bytes [", cursor, ", ", data_size, ") not covered by any tensor");
}

}  // namespace

const char* st_dtype_name(StDtype dtype) { return dtype_entry(dtype).name; }

size_t st_dtype_size(StDtype dtype) { return dtype_entry(dtype).size; }

std::optional<StDtype> parse_st_dtype(std::string_view name) {
  for (const DtypeEntry& e : kDtypes)
    if (name == e.name) return e.dtype;
  return std::nullopt;
}

int64_t TensorInfo::numel() const {
  const std::optional<uint64_t> n = checked_byte_count(shape, 1);
  MOEFQ_ASSERT(n.has_value() && *n <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
               "tensor ", quote(name), ": element count of shape ", shape_str(shape, kMaxShownDims),
               " does not fit in int64");
  return static_cast<int64_t>(*n);
}

namespace {

// The header of a file of file_size bytes from its first bytes `head` (at least 8 + N of them when
// the file has a valid length prefix N; all of it when shorter).
SafetensorsHeader parse_header(std::span<const uint8_t> head, uint64_t file_size, const std::string& what) {
  MOEFQ_CHECK(file_size >= 8, what, ": file is ", file_size,
              " bytes, shorter than the 8-byte header length; truncated or not a safetensors file");
  const uint64_t header_len = load_u64_le(head.data());
  const uint64_t after_prefix = file_size - 8;
  MOEFQ_CHECK(header_len <= kMaxSafetensorsHeaderBytes, what, ": header length ", header_len,
              " exceeds the limit of ", kMaxSafetensorsHeaderBytes,
              " bytes; corrupt or not a safetensors file");
  MOEFQ_CHECK(header_len <= after_prefix, what, ": header length ", header_len,
              " is larger than the ", after_prefix,
              " bytes after the length prefix; truncated or not a safetensors file");
  MOEFQ_ASSERT(head.size() >= 8 + header_len, what, ": the header was not read whole");

  const std::string_view text(reinterpret_cast<const char*>(head.data()) + 8, header_len);
  SafetensorsHeader header;
  header.data_start = 8 + header_len;
  const uint64_t data_size = after_prefix - header_len;
  HeaderReader reader(what, [&](const std::string& key, const Json& value) {
    if (key == "__metadata__")
      parse_metadata(value, header.metadata, what);
    else
      header.tensors.push_back(parse_tensor_entry(key, value, data_size, what));
  });
  reader.parse(text);
  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  check_coverage(header.tensors, data_size, what);
  return header;
}

}  // namespace

SafetensorsHeader parse_safetensors(std::span<const uint8_t> file_bytes, std::string_view what) {
  return parse_header(file_bytes, file_bytes.size(), std::string(what));
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile SafetensorsFile::open(const std::string& path, std::string_view what_view) {
  const std::string what = what_view.empty() ? path : std::string(what_view);
  InputFile in = InputFile::open(path, what);
  const uint64_t size = in.size();
  // The length prefix, then the header it announces when that is plausible (parse_header says why
  // when it is not); tensor data is read only when asked for.
  std::vector<uint8_t> head(size_t(std::min<uint64_t>(size, 8)));
  in.read_at(0, head);
  if (size >= 8) {
    const uint64_t n = load_u64_le(head.data());
    if (n <= kMaxSafetensorsHeaderBytes && n <= size - 8) {
      head.resize(size_t(8 + n));
      in.read_at(8, {head.data() + 8, size_t(n)});
    }
  }
  SafetensorsFile file(std::move(in));
  file.path_ = path;
  file.header_ = parse_header(head, size, what);
  for (size_t i = 0; i < file.header_.tensors.size(); ++i)
    file.index_.emplace(file.header_.tensors[i].name, i);
  return file;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

void SafetensorsFile::read_into(const TensorInfo& info, std::span<uint8_t> dst, uint64_t offset) const {
  MOEFQ_ASSERT(info.begin <= info.end && header_.data_start + info.end <= file_.size(), path_, ": tensor ",
               quote(info.name), " is not from this file");
  MOEFQ_ASSERT(offset <= info.end - info.begin && dst.size() <= info.end - info.begin - offset, path_,
               ": tensor ", quote(info.name), ": bytes [", offset, ", ", offset + dst.size(), ") are outside its ",
               info.end - info.begin, " bytes");
  file_.read_at(header_.data_start + info.begin + offset, dst);
}

std::vector<uint8_t> SafetensorsFile::read(const TensorInfo& info) const {
  std::vector<uint8_t> bytes(size_t(info.end - info.begin));
  read_into(info, bytes);
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter

void SafetensorsWriter::add(std::string name, StDtype dtype, std::vector<int64_t> shape,
                            std::span<const uint8_t> bytes) {
  MOEFQ_CHECK(name != "__metadata__", "safetensors: \"__metadata__\" is reserved, not a tensor name");
  MOEFQ_CHECK(is_valid_utf8_json_string(name), "safetensors: tensor name ", quote(name),
              " is not valid UTF-8");
  MOEFQ_CHECK(!names_.contains(name), "safetensors: tensor ", quote(name), " added twice");
  for (int64_t d : shape)
    MOEFQ_CHECK(d >= 0, "safetensors: tensor ", quote(name), ": shape ", shape_str(shape, kMaxShownDims),
                " has a negative dimension");
  const std::optional<uint64_t> num_bytes = checked_byte_count(shape, st_dtype_size(dtype));
  MOEFQ_CHECK(num_bytes.has_value(), "safetensors: tensor ", quote(name), ": shape ",
              shape_str(shape, kMaxShownDims), " overflows: its byte count does not fit in 64 bits");
  MOEFQ_CHECK(*num_bytes == bytes.size(), "safetensors: tensor ", quote(name), ": shape ",
              shape_str(shape, kMaxShownDims), " of ", st_dtype_name(dtype), " needs ", *num_bytes,
              " bytes but ", bytes.size(), " were given");
  names_.insert(name);
  tensors_.push_back({std::move(name), dtype, std::move(shape), {bytes.begin(), bytes.end()}});
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  MOEFQ_CHECK(is_valid_utf8_json_string(key) && is_valid_utf8_json_string(value),
              "safetensors: metadata ", quote(key), " is not valid UTF-8");
  metadata_[std::move(key)] = std::move(value);
}

void SafetensorsWriter::write(const std::string& path) const {
  AtomicFile out(path);
  write_to(out);
  out.publish();
}

void SafetensorsWriter::write_to(AtomicFile& out) const {
  Json header = Json::object();
  uint64_t offset = 0;
  for (const Pending& t : tensors_) {
    const uint64_t end = offset + t.bytes.size();
    header[t.name] = {{"dtype", st_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  std::string text = header.dump();
  // Readers may reinterpret the data in place; start it on an 8-byte boundary.
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  MOEFQ_CHECK(text.size() <= kMaxSafetensorsHeaderBytes, out.path(), ": header of ", text.size(),
              " bytes exceeds the ", kMaxSafetensorsHeaderBytes, "-byte limit readers accept");

  uint8_t prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  out.write(prefix, sizeof(prefix));
  out.write(text.data(), text.size());
  for (const Pending& t : tensors_) out.write(t.bytes.data(), t.bytes.size());
  out.finish();
}

}  // namespace moefq
