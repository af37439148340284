// End-to-end tests of `moefq qdq` (and the `moefq bench` guard): the real binary is run in a fresh
// directory per test, its output files are read back and compared byte for byte with qdq_ref, and
// every kind of bad input must exit 2 with a message naming the problem and change nothing on disk.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "moefq_binary.h"
#include "moefq/qdq.h"
#include "moefq/safetensors.h"
#include "test_util.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;

using test::describe, test::quote, test::read_bytes, test::read_text, test::RunResult, test::span_of,
    test::split_lines, test::split_words, test::write_bytes;

// Each test gets an empty working directory (test::WorkDirTest).
class CliTest : public test::WorkDirTest {
 protected:
  CliTest() : WorkDirTest("moefq_cli_") {}

  // Runs `moefq ARGS` (ARGS already shell-quoted where needed) in work_.
  RunResult moefq(const std::string& args) const { return run_in_work(test::moefq_command(args)); }

  // Names in the working directory, sorted.
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(work_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

// ------------------------------------------------------------------------------------------------
// The input file of the round-trip tests: a bf16 tensor of synthetic activations (outlier
// channels), an I64 tensor whose values name their own index, and an f32 tensor with specials
// (NaN, inf, subnormals, zero and NaN blocks), plus metadata. The I64 tensor sits between the two
// so a shifted copy shows.
struct QdqInput {
  std::vector<bf16> act;    // [4, 64] bf16
  std::vector<int64_t> idx; // [5] i64
  std::vector<float> w;     // [3, 32] f32, with specials
  std::map<std::string, std::string> metadata = {{"format", "pt"}, {"source", "test_cli_qdq"}};
};

QdqInput write_input(const fs::path& p) {
  QdqInput in;
  // Rows 2 and 3 scaled below 1, where logfmt10 casts (it keeps rows reaching 1 as bf16).
  std::vector<float> act = test::activations(4, 64, 11, /*specials=*/false);
  for (size_t i = 2 * 64; i < act.size(); ++i) act[i] = std::ldexp(act[i], -6);
  in.act = test::to_bf16(act);
  for (int64_t i = 0; i < 5; ++i) in.idx.push_back(int64_t(0x0102030405060708) * (i + 1) + i);
  in.w = test::activations(3, 32, 12, /*specials=*/true);
  SafetensorsWriter w;
  w.add("layers.0.act", StDtype::kBF16, {4, 64}, span_of(in.act));
  w.add("layers.0.idx", StDtype::kI64, {5}, span_of(in.idx));
  w.add("layers.0.w", StDtype::kF32, {3, 32}, span_of(in.w));
  for (const auto& [k, v] : in.metadata) w.set_metadata(k, v);
  w.write(p.string());
  return in;
}

template <typename T>
std::vector<T> tensor_values(const SafetensorsFile& f, const std::string& name) {
  const TensorInfo* t = f.find(name);
  if (t == nullptr) return {};
  const auto bytes = f.read(*t);
  std::vector<T> v(bytes.size() / sizeof(T));
  if (!bytes.empty()) std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

template <typename T>
std::vector<T> expected_qdq(Format f, const std::vector<T>& x, int64_t rows, int64_t cols, std::optional<float> amax) {
  std::vector<T> y(x.size());
  qdq_ref(f, x.data(), y.data(), rows, cols, amax ? *amax : amax_ref(x.data(), int64_t(x.size())));
  return y;
}

// Names, dtypes and shapes of the output equal the input's; the input's metadata is kept.
void expect_same_layout(const SafetensorsFile& in, const SafetensorsFile& out) {
  ASSERT_EQ(in.header().tensors.size(), out.header().tensors.size());
  for (const TensorInfo& t : in.header().tensors) {
    const TensorInfo* o = out.find(t.name);
    ASSERT_NE(o, nullptr) << "output lacks tensor " << t.name;
    EXPECT_EQ(o->dtype, t.dtype) << t.name;
    EXPECT_EQ(o->shape, t.shape) << t.name;
  }
  for (const auto& [k, v] : in.header().metadata) {
    const auto it = out.header().metadata.find(k);
    ASSERT_NE(it, out.header().metadata.end()) << "output lacks metadata key " << k;
    EXPECT_EQ(it->second, v) << "metadata " << k;
  }
}

bool tensor_bytes_equal(const SafetensorsFile& a, const SafetensorsFile& b, const std::string& name) {
  const auto x = a.read(*a.find(name)), y = b.read(*b.find(name));
  return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin());
}

// ------------------------------------------------------------------------------------------------
// The built-in sample.

// The table rows of stdout: format -> rel_l2 cell. Fails the test on a malformed table.
std::map<std::string, std::string> table_rel_l2(const std::string& out) {
  std::map<std::string, std::string> rows;
  const auto lines = split_lines(out);
  size_t header = lines.size();
  for (size_t i = 0; i < lines.size(); ++i)
    if (split_words(lines[i]).size() > 0 && split_words(lines[i])[0] == "tensor") header = i;
  EXPECT_LT(header, lines.size()) << "no table header in stdout:\n" << out;
  if (header >= lines.size()) return rows;
  const auto cols = split_words(lines[header]);
  const auto fmt_col = std::find(cols.begin(), cols.end(), "format") - cols.begin();
  const auto rel_col = std::find(cols.begin(), cols.end(), "rel_l2") - cols.begin();
  EXPECT_LT(size_t(rel_col), cols.size()) << lines[header];
  for (size_t i = header + 2; i < lines.size(); ++i) {
    const auto w = split_words(lines[i]);
    if (w.empty()) continue;
    EXPECT_EQ(w.size(), cols.size()) << "row: " << lines[i];
    if (w.size() != cols.size()) continue;
    rows[w[size_t(fmt_col)]] = w[size_t(rel_col)];
  }
  return rows;
}

TEST_F(CliTest, SampleOnCpuPrintsEveryFormatAndTheReportAgrees) {
  const RunResult r = moefq("qdq --device cpu --report r.json");
  ASSERT_EQ(r.status, 0) << describe(r);
  const auto rows = table_rel_l2(r.out);
  ASSERT_EQ(rows.size(), std::size(kAllFormats)) << r.out;
  for (Format f : kAllFormats) EXPECT_TRUE(rows.count(format_name(f))) << "no row for " << format_name(f) << ":\n" << r.out;
  EXPECT_NE(r.err.find("built-in sample"), std::string::npos) << r.err;
  EXPECT_EQ(listing(), std::vector<std::string>{"r.json"}) << "only the report is written";

  const nlohmann::json j = nlohmann::json::parse(read_text(path("r.json")));
  EXPECT_EQ(j.at("tool"), "moefq qdq");
  EXPECT_EQ(j.at("device"), "cpu");
  ASSERT_EQ(j.at("results").size(), std::size(kAllFormats)) << j.dump(2);
  for (const auto& res : j.at("results")) {
    const std::string fmt = res.at("format");
    ASSERT_TRUE(rows.count(fmt)) << fmt;
    ASSERT_TRUE(res.at("rel_l2").is_number()) << res.dump();
    const double rel = res.at("rel_l2");
    // The table prints "%.4g" of the same double; a finite error below 1 for every format (the
    // sample holds a sink token's massive activations, which per-tensor int8 pays for dearly).
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.4g", rel);
    EXPECT_EQ(rows.at(fmt), buf) << fmt;
    EXPECT_GT(rel, 0.0) << fmt;
    EXPECT_LT(rel, 1.0) << fmt;
    EXPECT_EQ(res.at("shape"), (std::vector<int64_t>{512, 7168})) << fmt;
    EXPECT_EQ(res.at("amax").is_null(), !format_has_global_amax(*parse_format(fmt))) << fmt;
  }
}

TEST_F(CliTest, NoArgumentsRunsTheSample) {
  const RunResult r = moefq("qdq");
  ASSERT_EQ(r.status, 0) << describe(r);
  const auto rows = table_rel_l2(r.out);
  EXPECT_EQ(rows.size(), std::size(kAllFormats)) << r.out;
  for (Format f : kAllFormats) EXPECT_TRUE(rows.count(format_name(f))) << format_name(f) << ":\n" << r.out;
  EXPECT_TRUE(listing().empty()) << "nothing is written without --out or --report";
}

TEST_F(CliTest, SampleWithOneFormatAndOut) {
  const RunResult r = moefq("qdq --device cpu --format int8 --sample-rows 3 --sample-cols 40 --out s.safetensors");
  ASSERT_EQ(r.status, 0) << describe(r);
  const auto rows = table_rel_l2(r.out);
  ASSERT_EQ(rows.size(), 1u) << r.out;
  EXPECT_TRUE(rows.count("int8")) << r.out;
  const SafetensorsFile s = SafetensorsFile::open(path("s.safetensors").string());
  ASSERT_NE(s.find("sample"), nullptr);
  ASSERT_NE(s.find("sample.int8"), nullptr);
  EXPECT_EQ(s.find("sample.int8")->shape, (std::vector<int64_t>{3, 40}));
  const auto x = tensor_values<bf16>(s, "sample");
  EXPECT_TRUE(test::bytes_equal(expected_qdq(Format::kInt8, x, 3, 40, std::nullopt), tensor_values<bf16>(s, "sample.int8")));
}

// logfmt10 sends a group it cannot cast as bf16: the table, the report and a note say what was
// sent (a tensor of magnitudes >= 1 is not compressed at all; one in (0, 1) is, whole).
TEST_F(CliTest, Logfmt10SaysWhatWasCastAndSent) {
  std::vector<bf16> big(size_t(4 * 1024)), small(big.size());
  for (size_t i = 0; i < big.size(); ++i) {
    big[i].bits = bf16_round(1.0f + float(i % 97) / 8.0f);
    small[i].bits = bf16_round(0.01f + float(i % 89) / 200.0f);
  }
  SafetensorsWriter w;
  w.add("big", StDtype::kBF16, {4, 1024}, span_of(big));
  w.add("small", StDtype::kBF16, {4, 1024}, span_of(small));
  w.write(path("a.safetensors").string());
  const RunResult r = moefq("qdq --in a.safetensors --out b.safetensors --format logfmt10 --device cpu --report r.json");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_NE(r.err.find("note: logfmt10 cast 0 of big's 4 groups"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("nothing was compressed (rel_l2 0)"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("of small's"), std::string::npos) << "every group of small was cast:\n" << r.err;
  EXPECT_NE(r.out.find("B/row"), std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(read_text(path("r.json")));
  for (const auto& res : j.at("results")) {
    const bool is_big = res.at("tensor") == "big";
    EXPECT_EQ(res.at("cast_fraction"), is_big ? 0.0 : 1.0) << res.dump();
    EXPECT_EQ(res.at("wire_bytes_per_row"), is_big ? 2048.0 : wire_bytes_per_row(Format::kLogfmt10, 1024)) << res.dump();
    EXPECT_EQ(res.at("rel_l2") == 0.0, is_big) << res.dump();
  }
  // Other formats have no cast fraction, and their bytes.
  const RunResult f = moefq("qdq --in a.safetensors --out c.safetensors --format fp8 --device cpu --report f.json");
  ASSERT_EQ(f.status, 0) << describe(f);
  const nlohmann::json jf = nlohmann::json::parse(read_text(path("f.json")));
  EXPECT_TRUE(jf.at("results")[0].at("cast_fraction").is_null());
  EXPECT_EQ(jf.at("results")[0].at("wire_bytes_per_row"), 1024.0);
}

// ------------------------------------------------------------------------------------------------
// File round trips: every format, with a dynamic amax and with --amax 2688.

struct RoundTripCase {
  Format format;
  std::optional<float> amax;
};

class CliRoundTrip : public CliTest, public ::testing::WithParamInterface<RoundTripCase> {};

TEST_P(CliRoundTrip, QuantizesFloatTensorsAndCopiesTheRest) {
  const auto [f, amax] = GetParam();
  const QdqInput in = write_input(path("a.safetensors"));
  std::string args = std::string("qdq --in a.safetensors --out b.safetensors --format ") + format_name(f) + " --device cpu";
  if (amax) args += " --amax 2688";
  const RunResult r = moefq(args);
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_EQ(listing(), (std::vector<std::string>{"a.safetensors", "b.safetensors"}));

  const SafetensorsFile a = SafetensorsFile::open(path("a.safetensors").string());
  const SafetensorsFile b = SafetensorsFile::open(path("b.safetensors").string());
  expect_same_layout(a, b);
  EXPECT_TRUE(tensor_bytes_equal(a, b, "layers.0.idx")) << "the I64 tensor must be copied byte for byte";
  EXPECT_NE(r.err.find("layers.0.idx"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("copied unchanged"), std::string::npos) << r.err;
  EXPECT_TRUE(test::bytes_equal(expected_qdq(f, in.act, 4, 64, amax), tensor_values<bf16>(b, "layers.0.act")))
      << "bf16 tensor";
  EXPECT_TRUE(test::bytes_equal(expected_qdq(f, in.w, 3, 32, amax), tensor_values<float>(b, "layers.0.w")))
      << "f32 tensor";
  // The QDQ changed something (the oracle is not the identity on this data).
  EXPECT_FALSE(tensor_bytes_equal(a, b, "layers.0.act"));

  // The table has one row per quantized tensor; formats without a global amax say --amax is ignored.
  std::string table_rows;
  for (const auto& line : split_lines(r.out))
    if (line.rfind("layers.0.", 0) == 0) table_rows += line.substr(0, line.find(' ')) + ";";
  EXPECT_EQ(table_rows, "layers.0.act;layers.0.w;") << r.out;
  const bool ignored_note = r.err.find("--amax is ignored") != std::string::npos;
  EXPECT_EQ(ignored_note, amax.has_value() && !format_has_global_amax(f)) << r.err;
  const auto tag = b.header().metadata.find("moefq.qdq");
  ASSERT_NE(tag, b.header().metadata.end());
  EXPECT_NE(tag->second.find(format_name(f)), std::string::npos) << tag->second;
}

std::vector<RoundTripCase> round_trip_cases() {
  std::vector<RoundTripCase> cases;
  for (Format f : kAllFormats) {
    cases.push_back({f, std::nullopt});
    cases.push_back({f, 2688.0f});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllFormats, CliRoundTrip, ::testing::ValuesIn(round_trip_cases()),
                         [](const ::testing::TestParamInfo<RoundTripCase>& info) {
                           return std::string(format_name(info.param.format)) + (info.param.amax ? "_amax2688" : "_dynamic");
                         });

TEST_F(CliTest, TensorOptionQuantizesOnlyThatTensor) {
  const QdqInput in = write_input(path("a.safetensors"));
  const RunResult r = moefq("qdq --in a.safetensors --out b.safetensors --format nvfp4 --device cpu --tensor layers.0.w");
  ASSERT_EQ(r.status, 0) << describe(r);
  const SafetensorsFile a = SafetensorsFile::open(path("a.safetensors").string());
  const SafetensorsFile b = SafetensorsFile::open(path("b.safetensors").string());
  expect_same_layout(a, b);
  EXPECT_TRUE(tensor_bytes_equal(a, b, "layers.0.act")) << "an unselected tensor must be copied byte for byte";
  EXPECT_TRUE(tensor_bytes_equal(a, b, "layers.0.idx"));
  EXPECT_TRUE(test::bytes_equal(expected_qdq(Format::kNvfp4, in.w, 3, 32, std::nullopt), tensor_values<float>(b, "layers.0.w")));
  EXPECT_EQ(r.err.find("layers.0.act"), std::string::npos) << "an unselected tensor is not reported:\n" << r.err;
}

// ------------------------------------------------------------------------------------------------
// Bad input: exit 2, "moefq: error: ..." naming the problem, and nothing changed on disk, both when
// the output file does not exist and when it does.

class CliBadInput : public CliTest {
 protected:
  void SetUp() override {
    CliTest::SetUp();
    write_input(path("a.safetensors"));
  }

  // Runs args twice: without an output file (none may appear, nor a temporary) and with an existing
  // one (it must keep its bytes). `needles` must all appear in the error message.
  void expect_rejected(const std::string& args, const std::vector<std::string>& needles) {
    SCOPED_TRACE("moefq " + args);
    std::error_code ec;
    fs::remove(path("b.safetensors"), ec);
    const auto before = listing();
    const auto input = read_bytes(path("a.safetensors"));
    RunResult r = moefq(args);
    check_error(r, needles);
    EXPECT_EQ(listing(), before) << "bad input must leave the directory as it was";
    EXPECT_EQ(read_bytes(path("a.safetensors")), input);

    const std::vector<uint8_t> sentinel = {'o', 'l', 'd', ' ', 'o', 'u', 't', 'p', 'u', 't'};
    write_bytes(path("b.safetensors"), sentinel);
    const auto before2 = listing();
    r = moefq(args);
    check_error(r, needles);
    EXPECT_EQ(listing(), before2);
    EXPECT_EQ(read_bytes(path("b.safetensors")), sentinel) << "an existing output file must be left untouched";
    fs::remove(path("b.safetensors"), ec);
  }

  static void check_error(const RunResult& r, const std::vector<std::string>& needles) {
    EXPECT_EQ(r.status, 2) << describe(r);
    EXPECT_NE(r.err.find("moefq: error: "), std::string::npos) << describe(r);
    for (const auto& n : needles)
      EXPECT_NE(r.err.find(n), std::string::npos) << "the message lacks \"" << n << "\"\n" << describe(r);
    EXPECT_EQ(r.out.find("rel_l2"), std::string::npos) << "no table on bad input\n" << describe(r);
  }

  const std::string io_ = "qdq --in a.safetensors --out b.safetensors --device cpu ";
};

TEST_F(CliBadInput, UnknownFormat) {
  expect_rejected(io_ + "--format nvfp5", {"--format", "'nvfp5'", "nvfp4"});
  expect_rejected("qdq --device cpu --format FP8 --out b.safetensors", {"--format", "'FP8'"});
}

TEST_F(CliBadInput, BadAmax) {
  for (const std::string v : {"abc", "-1", "0", "inf", "nan", "-inf", "1e40", "2688x"})
    expect_rejected(io_ + "--format nvfp4 --amax=" + quote(v), {"--amax", "'" + v + "'"});
  expect_rejected(io_ + "--format nvfp4 --amax=", {"--amax"});
  // A negative value as a separate argument: either CLI11 or the amax check must refuse it.
  expect_rejected(io_ + "--format fp8 --amax -1", {"--amax"});
}

TEST_F(CliBadInput, UnknownTensor) {
  expect_rejected(io_ + "--format nvfp4 --tensor layers.0.w --tensor nope", {"--tensor", "'nope'", "a.safetensors"});
  expect_rejected("qdq --device cpu --tensor layers.0.w --out b.safetensors", {"--tensor", "--in"});
}

TEST_F(CliBadInput, MissingInputFile) {
  expect_rejected("qdq --in missing.safetensors --out b.safetensors --format fp8 --device cpu", {"missing.safetensors"});
}

TEST_F(CliBadInput, TruncatedFile) {
  auto bytes = read_bytes(path("a.safetensors"));
  bytes.resize(bytes.size() - 10);
  write_bytes(path("t.safetensors"), bytes);
  expect_rejected("qdq --in t.safetensors --out b.safetensors --format fp8 --device cpu", {"t.safetensors"});
  bytes.resize(5);  // shorter than the length prefix
  write_bytes(path("t.safetensors"), bytes);
  expect_rejected("qdq --in t.safetensors --out b.safetensors --format fp8 --device cpu", {"t.safetensors"});
}

TEST_F(CliBadInput, MalformedHeader) {
  const std::string header = "{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]";  // no closing brace
  std::vector<uint8_t> bytes(8 + header.size() + 4, 0);
  for (size_t i = 0; i < 8; ++i) bytes[i] = uint8_t(uint64_t(header.size()) >> (8 * i));
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  write_bytes(path("m.safetensors"), bytes);
  expect_rejected("qdq --in m.safetensors --out b.safetensors --format fp8 --device cpu", {"m.safetensors"});
}

TEST_F(CliBadInput, MissingOutOrFormat) {
  expect_rejected("qdq --in a.safetensors --format fp8 --device cpu", {"--out"});
  expect_rejected("qdq --in a.safetensors --out b.safetensors --device cpu", {"--format"});
}

TEST_F(CliBadInput, UnknownDeviceOrOption) {
  expect_rejected("qdq --in a.safetensors --out b.safetensors --format fp8 --device gpu", {"--device", "'gpu'"});
  expect_rejected(io_ + "--format fp8 --bogus", {"--bogus"});
  expect_rejected("qdq --device cpu --sample-rows 0 --out b.safetensors", {"--sample-rows"});
  expect_rejected(io_ + "--format fp8 extra_word", {"extra_word"});
  // An unknown command: CLI11 says only "A subcommand is required" (it does not name the word).
  expect_rejected("frobnicate", {"unknown command 'frobnicate'", "eval, calibrate, qdq"});
}

// The report is bad input too when it cannot be written: both outputs are checked before any work,
// so the output file does not appear either.
TEST_F(CliBadInput, UnwritableReport) {
  expect_rejected(io_ + "--format fp8 --report no_such_dir/r.json", {"no_such_dir"});
}

// A report path equal to --out or --in must be refused, not written over the file.
TEST_F(CliBadInput, ReportOverOutputOrInput) {
  expect_rejected(io_ + "--format fp8 --report b.safetensors", {"--report"});
  expect_rejected(io_ + "--format fp8 --report a.safetensors", {"--report"});
}

// ------------------------------------------------------------------------------------------------

TEST_F(CliTest, HelpShowsUsageAndAnExample) {
  RunResult r = moefq("--help");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_NE(r.out.find("qdq"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bench"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("COMMAND --help"), std::string::npos) << r.out;

  r = moefq("qdq --help");
  ASSERT_EQ(r.status, 0) << describe(r);
  for (const char* opt : {"--in", "--out", "--format", "--amax", "--tensor", "--device", "--report"})
    EXPECT_NE(r.out.find(opt), std::string::npos) << opt << "\n" << r.out;
  EXPECT_NE(r.out.find("moefq qdq --in"), std::string::npos) << "no example\n" << r.out;
  EXPECT_TRUE(listing().empty());
}

TEST_F(CliTest, BenchNeedsCudaAndAGpu) {
#ifdef MOEFQ_HAS_CUDA
  // A CUDA build: with a GPU the (small) benchmark runs; without one it must refuse clearly.
  const RunResult r = moefq("bench qdq --rows 128 --cols 256 --reps 1 --launches 1 --formats fp8");
  if (r.status == 0) {
    EXPECT_NE(r.out.find("fp8"), std::string::npos) << describe(r);
  } else {
    EXPECT_EQ(r.status, 2) << describe(r);
    EXPECT_NE(r.err.find("moefq: error: "), std::string::npos) << describe(r);
  }
#else
  const RunResult r = moefq("bench qdq");
  EXPECT_EQ(r.status, 2) << describe(r);
  EXPECT_NE(r.err.find("moefq: error: "), std::string::npos) << describe(r);
  EXPECT_NE(r.err.find("without CUDA"), std::string::npos) << describe(r);
#endif
  EXPECT_TRUE(listing().empty());
}

}  // namespace
}  // namespace moefq
