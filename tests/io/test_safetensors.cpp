// safetensors reader and writer: round trips through real files, atomic writes, and one test per
// rejection rule on files built byte by byte.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "moefq/errors.h"
#include "moefq/safetensors.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;

// A file: u64 LE header length, the header text as given (no padding), then data_size bytes whose
// values are their own offsets mod 251 so a misplaced slice shows.
std::vector<uint8_t> st_file(const std::string& header, size_t data_size) {
  std::vector<uint8_t> out(8 + header.size() + data_size);
  const uint64_t n = header.size();
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  for (size_t i = 0; i < header.size(); ++i) out[8 + i] = static_cast<uint8_t>(header[i]);
  for (size_t i = 0; i < data_size; ++i) out[8 + header.size() + i] = static_cast<uint8_t>(i % 251);
  return out;
}

std::vector<uint8_t> read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_raw(const fs::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::string> dir_entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Parses `bytes` expecting a bad-input error that starts with the file name and mentions `needle`.
void expect_rejected(const std::vector<uint8_t>& bytes, const std::string& needle) {
  try {
    parse_safetensors(bytes, "bad.safetensors");
    ADD_FAILURE() << "accepted a file that should fail with \"" << needle << "\"";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kBadInput) << msg;
    EXPECT_EQ(msg.rfind("bad.safetensors: ", 0), 0u) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << "message \"" << msg << "\" lacks \"" << needle << "\"";
  }
}

// A tensor entry for hand-built headers.
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  uint64_t begin, uint64_t end) {
  return "\"" + name + "\": {\"dtype\": \"" + dtype + "\", \"shape\": " + shape +
         ", \"data_offsets\": [" + std::to_string(begin) + ", " + std::to_string(end) + "]}";
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ = fs::temp_directory_path() /
           ("moefq_st_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
    ASSERT_TRUE(fs::create_directory(dir_));
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed * 31 + i * 7);
  return v;
}

TEST(SafetensorsDtype, NamesAndSizesRoundTrip) {
  const std::vector<std::pair<std::string, size_t>> expected = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
      {"F32", 4},  {"F64", 8}, {"I64", 8}, {"U64", 8}};
  for (const auto& [name, size] : expected) {
    const std::optional<StDtype> d = parse_st_dtype(name);
    ASSERT_TRUE(d.has_value()) << name;
    EXPECT_EQ(st_dtype_name(*d), name);
    EXPECT_EQ(st_dtype_size(*d), size) << name;
  }
  EXPECT_FALSE(parse_st_dtype("bf16").has_value());  // names are case-sensitive
  EXPECT_FALSE(parse_st_dtype("F4").has_value());
  EXPECT_FALSE(parse_st_dtype("").has_value());
}

TEST_F(SafetensorsTest, RoundTripKeepsNamesDtypesShapesBytesAndMetadata) {
  const auto w1 = pattern(2 * 3 * 2, 1);
  const auto b1 = pattern(3, 2);  // odd size: the next tensor starts unaligned, as allowed
  const auto s1 = pattern(4 * 4, 3);
  SafetensorsWriter writer;
  writer.add("layers.0.w1", StDtype::kBF16, {2, 3}, w1);
  writer.add("layers.0.bias", StDtype::kU8, {3, 1}, b1);
  writer.add("scale", StDtype::kF32, {4}, s1);
  writer.set_metadata("format", "pt");
  writer.set_metadata("origin", "moefq test \xc3\xa9");
  const fs::path path = dir_ / "model.safetensors";
  writer.write(path.string());

  const SafetensorsFile file = SafetensorsFile::open(path.string());
  const SafetensorsHeader& h = file.header();
  EXPECT_EQ(h.data_start % 8, 0u);
  const std::vector<uint8_t> raw = read_all(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | raw[i];
  EXPECT_EQ(h.data_start, 8 + n);
  EXPECT_EQ(raw.size(), h.data_start + w1.size() + b1.size() + s1.size());

  ASSERT_EQ(h.tensors.size(), 3u);
  // Data-offset order is the order the tensors were added.
  EXPECT_EQ(h.tensors[0].name, "layers.0.w1");
  EXPECT_EQ(h.tensors[1].name, "layers.0.bias");
  EXPECT_EQ(h.tensors[2].name, "scale");

  const TensorInfo* t = file.find("layers.0.w1");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, StDtype::kBF16);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t->numel(), 6);
  EXPECT_EQ(t->begin, 0u);
  EXPECT_EQ(t->end, 12u);
  auto bytes = file.read(*t);
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), w1);

  t = file.find("layers.0.bias");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, StDtype::kU8);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{3, 1}));
  bytes = file.read(*t);
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), b1);

  t = file.find("scale");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, StDtype::kF32);
  EXPECT_EQ(t->begin, 15u);
  bytes = file.read(*t);
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), s1);

  EXPECT_EQ(file.find("missing"), nullptr);
  EXPECT_EQ(h.metadata, (std::map<std::string, std::string>{{"format", "pt"},
                                                            {"origin", "moefq test \xc3\xa9"}}));
}

TEST_F(SafetensorsTest, EmptyTensorAndScalar) {
  const auto scalar = pattern(8, 9);
  SafetensorsWriter writer;
  writer.add("empty", StDtype::kF32, {0}, {});
  writer.add("empty_wide", StDtype::kBF16, {1099511627776, 0}, {});  // zero dim: no overflow
  writer.add("scalar", StDtype::kF64, {}, scalar);
  const fs::path path = dir_ / "small.safetensors";
  writer.write(path.string());

  const SafetensorsFile file = SafetensorsFile::open(path.string());
  const TensorInfo* e = file.find("empty");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->shape, (std::vector<int64_t>{0}));
  EXPECT_EQ(e->numel(), 0);
  EXPECT_EQ(file.read(*e).size(), 0u);
  const TensorInfo* w = file.find("empty_wide");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->numel(), 0);
  const TensorInfo* s = file.find("scalar");
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(s->numel(), 1);
  const auto bytes = file.read(*s);
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), scalar);
  EXPECT_TRUE(file.header().metadata.empty());
}

TEST_F(SafetensorsTest, FileWithoutTensors) {
  const fs::path path = dir_ / "none.safetensors";
  SafetensorsWriter().write(path.string());
  const SafetensorsFile file = SafetensorsFile::open(path.string());
  EXPECT_TRUE(file.header().tensors.empty());
  EXPECT_EQ(file.header().data_start % 8, 0u);
  EXPECT_EQ(fs::file_size(path), file.header().data_start);
}

TEST_F(SafetensorsTest, MovedFileStillReads) {
  const auto payload = pattern(64, 4);
  SafetensorsWriter writer;
  writer.add("x", StDtype::kU8, {64}, payload);
  const fs::path path = dir_ / "m.safetensors";
  writer.write(path.string());
  SafetensorsFile a = SafetensorsFile::open(path.string());
  SafetensorsFile b = std::move(a);
  ASSERT_NE(b.find("x"), nullptr);
  EXPECT_EQ(b.read(*b.find("x")), payload);
  // Part of a tensor, from an offset.
  std::vector<uint8_t> part(10);
  b.read_into(*b.find("x"), part, 50);
  EXPECT_EQ(part, std::vector<uint8_t>(payload.begin() + 50, payload.begin() + 60));
}

// A file truncated after it was opened (another process rewriting it) gives an error naming the
// file; with the file mapped into memory this was SIGBUS, a crash.
TEST_F(SafetensorsTest, FileTruncatedAfterOpeningIsAnError) {
  const auto payload = pattern(1 << 16, 5);
  SafetensorsWriter writer;
  writer.add("x", StDtype::kU8, {1 << 16}, payload);
  const fs::path path = dir_ / "t.safetensors";
  writer.write(path.string());
  const SafetensorsFile file = SafetensorsFile::open(path.string(), "--in t.safetensors");
  fs::resize_file(path, file.header().data_start + 100);
  try {
    (void)file.read(*file.find("x"));
    ADD_FAILURE() << "read past the end of a truncated file";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kBadInput);
    EXPECT_NE(std::string(e.what()).find("--in t.safetensors: the file ends at byte"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("truncated while being read"), std::string::npos) << e.what();
  }
}

TEST_F(SafetensorsTest, HeaderOrderDoesNotMatterTensorsComeBackInOffsetOrder) {
  const std::string header =
      "{" + entry("b", "U8", "[4]", 4, 8) + ", " + entry("a", "U8", "[4]", 0, 4) +
      ", \"__metadata__\": {\"k\": \"v\"}}";
  const auto bytes = st_file(header, 8);
  const SafetensorsHeader h = parse_safetensors(bytes, "x");
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "a");
  EXPECT_EQ(h.tensors[1].name, "b");
  EXPECT_EQ(h.data_start, 8 + header.size());
  EXPECT_EQ(h.metadata.at("k"), "v");
}

// --- atomic writes ------------------------------------------------------------------------------

TEST_F(SafetensorsTest, WriteIntoMissingDirectoryFailsAndCreatesNothing) {
  SafetensorsWriter writer;
  writer.add("x", StDtype::kU8, {2}, pattern(2, 1));
  const fs::path path = dir_ / "missing" / "out.safetensors";
  try {
    writer.write(path.string());
    ADD_FAILURE() << "write into a missing directory succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot create"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir_ / "missing"));
  EXPECT_TRUE(dir_entries(dir_).empty());
}

TEST_F(SafetensorsTest, FailedWriteLeavesExistingOutputUntouched) {
  const fs::path path = dir_ / "out.safetensors";
  SafetensorsWriter small;
  small.add("x", StDtype::kU8, {16}, pattern(16, 5));
  small.write(path.string());
  const std::vector<uint8_t> before = read_all(path);

  // Make the second write fail half way: cap the file size so write() returns EFBIG.
  SafetensorsWriter large;
  large.add("y", StDtype::kF32, {64 * 1024}, pattern(256 * 1024, 6));
  rlimit old_limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit capped = old_limit;
  capped.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &capped), 0);
  bool threw = false;
  std::string message;
  try {
    large.write(path.string());
  } catch (const Error& e) {
    threw = true;
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);

  EXPECT_TRUE(threw);
  EXPECT_NE(message.find("write failed"), std::string::npos) << message;
  EXPECT_EQ(read_all(path), before);
  EXPECT_EQ(dir_entries(dir_), std::vector<std::string>{"out.safetensors"});  // temp removed
  const SafetensorsFile file = SafetensorsFile::open(path.string());
  EXPECT_NE(file.find("x"), nullptr);
}

TEST_F(SafetensorsTest, WriteOverADirectoryFailsAndRemovesTheTemporary) {
  const fs::path path = dir_ / "taken";
  fs::create_directory(path);
  write_raw(path / "keep", {1, 2, 3});
  SafetensorsWriter writer;
  writer.add("x", StDtype::kU8, {2}, pattern(2, 1));
  EXPECT_THROW(writer.write(path.string()), Error);
  EXPECT_TRUE(fs::is_directory(path));
  EXPECT_EQ(read_all(path / "keep"), (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(dir_entries(dir_), std::vector<std::string>{"taken"});
}

// --- writer rejections --------------------------------------------------------------------------

void expect_add_rejected(SafetensorsWriter& w, std::string name, StDtype dtype,
                         std::vector<int64_t> shape, std::vector<uint8_t> bytes,
                         const std::string& needle) {
  try {
    w.add(std::move(name), dtype, std::move(shape), bytes);
    ADD_FAILURE() << "add accepted a tensor that should fail with \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kBadInput);
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(SafetensorsWriter, RejectsBadTensors) {
  SafetensorsWriter w;
  w.add("a", StDtype::kU8, {2}, pattern(2, 0));
  expect_add_rejected(w, "a", StDtype::kU8, {2}, pattern(2, 0), "added twice");
  expect_add_rejected(w, "b", StDtype::kBF16, {3}, pattern(5, 0), "needs 6 bytes but 5");
  expect_add_rejected(w, "c", StDtype::kU8, {-1}, {}, "negative");
  expect_add_rejected(w, "d", StDtype::kF32, {int64_t{1} << 40, int64_t{1} << 40}, {}, "overflows");
  expect_add_rejected(w, "__metadata__", StDtype::kU8, {0}, {}, "reserved");
  expect_add_rejected(w, "bad\xff", StDtype::kU8, {0}, {}, "UTF-8");
  EXPECT_EQ(w.num_tensors(), 1u);  // failed adds change nothing
}

// --- reader rejections --------------------------------------------------------------------------

TEST(SafetensorsParse, RejectsFileShorterThanLengthPrefix) {
  expect_rejected({}, "shorter than the 8-byte header length");
  expect_rejected({1, 0, 0, 0, 0, 0, 0}, "file is 7 bytes");
}

TEST_F(SafetensorsTest, OpenRejectsEmptyAndMissingFiles) {
  const fs::path empty = dir_ / "empty.safetensors";
  write_raw(empty, {});
  try {
    SafetensorsFile::open(empty.string());
    ADD_FAILURE() << "opened an empty file";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(empty.string() + ": file is 0 bytes", 0), 0u) << e.what();
  }
  const fs::path missing = dir_ / "nope.safetensors";
  try {
    SafetensorsFile::open(missing.string());
    ADD_FAILURE() << "opened a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nope.safetensors: no such file"), std::string::npos) << e.what();
  }
  try {
    SafetensorsFile::open(dir_.string());
    ADD_FAILURE() << "opened a directory";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(": is a directory, not a regular file"), std::string::npos) << e.what();
  }
}

// A FIFO is refused by name at once: opening it for reading would wait for a writer forever.
TEST_F(SafetensorsTest, OpenRefusesAFifoWithoutBlocking) {
  const fs::path fifo = dir_ / "pipe.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  try {
    SafetensorsFile::open(fifo.string(), "--in pipe.safetensors");
    ADD_FAILURE() << "opened a FIFO";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "--in pipe.safetensors: is a FIFO (named pipe), not a regular file");
  }
}

TEST(SafetensorsParse, RejectsHeaderLongerThanFile) {
  auto bytes = st_file("{}", 0);
  bytes[0] = 200;  // claims 200 header bytes, has 2
  expect_rejected(bytes, "header length 200 is larger than the 2 bytes");
}

TEST(SafetensorsParse, RejectsHeaderOverLimitBeforeReadingIt) {
  std::vector<uint8_t> bytes(64, ' ');
  const uint64_t n = kMaxSafetensorsHeaderBytes + 1;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(n >> (8 * i));
  expect_rejected(bytes, "exceeds the limit of 100000000 bytes");
  for (int i = 0; i < 8; ++i) bytes[i] = 0xff;
  expect_rejected(bytes, "exceeds the limit");
}

TEST(SafetensorsParse, RejectsMalformedJson) {
  expect_rejected(st_file("{\"a\": ", 0), "not valid JSON");
  expect_rejected(st_file("{} trailing", 0), "not valid JSON");
  expect_rejected(st_file("", 0), "not valid JSON");
  expect_rejected(st_file("{\"a\xff\": 1}", 0), "not valid JSON");  // invalid UTF-8
}

TEST(SafetensorsParse, RejectsHeaderThatIsNotAnObject) {
  expect_rejected(st_file("[1, 2]", 0), "header is a JSON array, expected an object");
  expect_rejected(st_file("{\"a\": 3}", 0), "tensor \"a\": entry is a JSON number");
}

TEST(SafetensorsParse, RejectsDeepNesting) {
  expect_rejected(st_file("{\"__metadata__\": [[[[[[[[[[[[]]]]]]]]]]]]}", 0), "nests deeper");
}

TEST(SafetensorsParse, RejectsMissingOrMistypedFields) {
  expect_rejected(st_file("{\"a\": {\"shape\": [1], \"data_offsets\": [0, 1]}}", 1),
                  "tensor \"a\": missing \"dtype\"");
  expect_rejected(st_file("{\"a\": {\"dtype\": \"U8\", \"data_offsets\": [0, 1]}}", 1),
                  "missing \"shape\"");
  expect_rejected(st_file("{\"a\": {\"dtype\": \"U8\", \"shape\": [1]}}", 1),
                  "missing \"data_offsets\"");
  expect_rejected(st_file("{\"a\": {\"dtype\": 5, \"shape\": [1], \"data_offsets\": [0, 1]}}", 1),
                  "\"dtype\" is a JSON number");
  expect_rejected(st_file("{\"a\": {\"dtype\": \"U8\", \"shape\": \"1\", \"data_offsets\": [0, 1]}}", 1),
                  "\"shape\" is a JSON string");
  expect_rejected(st_file("{\"a\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [1]}}", 1),
                  "\"data_offsets\" is an array of 1 elements");
  expect_rejected(st_file("{\"a\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": {}}}", 1),
                  "\"data_offsets\" is a JSON object");
  expect_rejected(st_file("{\"a\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, \"1\"]}}", 1),
                  "data_offsets end is a JSON string");
  expect_rejected(st_file("{\"a\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [-1, 0]}}", 1),
                  "data_offsets begin is negative (-1)");
}

TEST(SafetensorsParse, RejectsUnknownDtypeByName) {
  expect_rejected(st_file("{" + entry("w", "F4_E2M1", "[2]", 0, 1) + "}", 1),
                  "unknown dtype \"F4_E2M1\"");
}

TEST(SafetensorsParse, RejectsBadDimensions) {
  expect_rejected(st_file("{" + entry("w", "U8", "[2, -3]", 0, 0) + "}", 0),
                  "shape dimension 1 is negative (-3)");
  expect_rejected(st_file("{" + entry("w", "U8", "[1.5]", 0, 0) + "}", 0),
                  "shape dimension 0 is not an integer");
  expect_rejected(st_file("{" + entry("w", "U8", "[\"4\"]", 0, 0) + "}", 0),
                  "shape dimension 0 is a JSON string");
  expect_rejected(st_file("{" + entry("w", "U8", "[9223372036854775808]", 0, 0) + "}", 0),
                  "larger than the maximum");
  expect_rejected(st_file("{" + entry("w", "U8", "[18446744073709551616]", 0, 0) + "}", 0),
                  "not an integer");  // beyond u64: the JSON parser makes it a float
}

TEST(SafetensorsParse, RejectsAbsurdSizes) {
  // 2^40 * 2^40 elements: the byte count overflows 64 bits before any allocation.
  expect_rejected(st_file("{" + entry("w", "F32", "[1099511627776, 1099511627776]", 0, 16) + "}", 16),
                  "overflows");
  // Fits in 64 bits but not in the file.
  expect_rejected(
      st_file("{" + entry("w", "U8", "[4294967296, 4294967295]", 0, 18446744069414584320ull) + "}", 16),
      "end out of range");
}

TEST(SafetensorsParse, RejectsShapeBytesMismatch) {
  expect_rejected(st_file("{" + entry("w", "BF16", "[2, 3]", 0, 10) + "}", 10),
                  "shape [2, 3] of BF16 needs 12 bytes but data_offsets [0, 10] span 10 bytes");
}

TEST(SafetensorsParse, RejectsBeginAfterEnd) {
  expect_rejected(st_file("{" + entry("w", "U8", "[4]", 8, 4) + "}", 8), "begin > end");
}

TEST(SafetensorsParse, RejectsOffsetsOutOfRange) {
  expect_rejected(st_file("{" + entry("w", "U8", "[16]", 0, 16) + "}", 12),
                  "end out of range: the data buffer holds 12 bytes");
}

TEST(SafetensorsParse, RejectsOverlappingTensors) {
  expect_rejected(
      st_file("{" + entry("a", "U8", "[8]", 0, 8) + ", " + entry("b", "U8", "[8]", 4, 12) + "}", 12),
      "tensors \"a\" [0, 8] and \"b\" [4, 12] overlap");
  // An empty tensor inside another also breaks the tiling.
  expect_rejected(
      st_file("{" + entry("a", "U8", "[8]", 0, 8) + ", " + entry("e", "U8", "[0]", 4, 4) + "}", 8),
      "overlap");
}

TEST(SafetensorsParse, RejectsHolesAndTrailingBytes) {
  expect_rejected(
      st_file("{" + entry("a", "U8", "[4]", 0, 4) + ", " + entry("b", "U8", "[4]", 8, 12) + "}", 12),
      "bytes [4, 8) are not covered");
  expect_rejected(st_file("{" + entry("a", "U8", "[4]", 4, 8) + "}", 8), "bytes [0, 4) are not covered");
  expect_rejected(st_file("{" + entry("a", "U8", "[4]", 0, 4) + "}", 6), "2 trailing bytes [4, 6)");
  expect_rejected(st_file("{}", 3), "3 trailing bytes");
}

TEST(SafetensorsParse, RejectsDuplicateKeys) {
  expect_rejected(
      st_file("{" + entry("a", "U8", "[4]", 0, 4) + ", " + entry("a", "U8", "[4]", 4, 8) + "}", 8),
      "key \"a\" twice");
  expect_rejected(
      st_file("{\"a\": {\"dtype\": \"U8\", \"dtype\": \"I8\", \"shape\": [1], \"data_offsets\": [0, 1]}}", 1),
      "key \"dtype\" twice");
}

// A header of 1.5M tensors (about the most the 100 MB header limit holds) is read: the parse is
// linear in the header (it was quadratic in the tensor count: hours for such a header), and a
// duplicate name at the very end is still found.
TEST(SafetensorsParse, HeaderOfManyTensorsIsReadInOnePass) {
  constexpr size_t kTensors = 1'500'000;
  std::string header = "{";
  header.reserve(kTensors * 64);
  for (size_t i = 0; i < kTensors; ++i) {
    if (i) header += ',';
    header += "\"t" + std::to_string(i) + "\":{\"dtype\":\"BF16\",\"shape\":[" + std::to_string(i % 7) +
              ",0],\"data_offsets\":[0,0]}";
  }
  header += ",\"__metadata__\":{\"k\":\"v\"}}";
  ASSERT_LE(header.size(), kMaxSafetensorsHeaderBytes);
  const SafetensorsHeader h = parse_safetensors(st_file(header, 0), "many.safetensors");
  ASSERT_EQ(h.tensors.size(), kTensors);
  EXPECT_EQ(h.metadata.at("k"), "v");
  EXPECT_EQ(h.tensors.front().name, "t0");  // sorted by (begin, end, name)
  EXPECT_EQ(h.tensors.back().name, "t999999");
  header.back() = ',';
  header += "\"t1234567\":{\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[0,0]}}";
  expect_rejected(st_file(header, 0), "key \"t1234567\" twice");
}

TEST(SafetensorsParse, RejectsBadMetadata) {
  expect_rejected(st_file("{\"__metadata__\": {\"k\": 1}}", 0),
                  "\"__metadata__\" value for key \"k\" is a JSON number");
  expect_rejected(st_file("{\"__metadata__\": [\"k\"]}", 0), "\"__metadata__\" is a JSON array");
}

}  // namespace
}  // namespace moefq
