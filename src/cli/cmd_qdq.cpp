// moefq qdq: fake-quantize the tensors of a safetensors file (or a built-in sample) and report
// the error metrics of each.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>

#include "cli/commands.h"
#include "cli/table.h"
#include "tool/device_choice.h"
#include "moefq/errors.h"
#include "moefq/fileio.h"
#include "moefq/host_memory.h"
#include "moefq/metrics.h"
#include "moefq/qdq.h"
#include "moefq/safetensors.h"
#include "moefq/synthetic.h"
#include "moefq/wire_bytes.h"
#ifdef MOEFQ_HAS_CUDA
#include "moefq/cuda.h"
#endif

namespace moefq::cli {
namespace {

namespace fs = std::filesystem;

struct QdqOptions {
  std::string in, out, format, amax, device = "auto", report;
  std::vector<std::string> tensors;
  int64_t sample_rows = 512, sample_cols = 7168;
};

struct Result {
  std::string tensor, dtype, format;
  std::vector<int64_t> shape;
  float amax = 0;
  bool amax_used = true;
  ErrorMetrics m;
  // The bytes per row actually sent (scales included), and logfmt10's fraction of cast groups
  // (the others go as bf16; nullopt for the other formats).
  double wire_bytes_per_row = 0;
  std::optional<double> cast_fraction;
};

// A decimal number only ("2688", "0.5", "1e3"; the command line's one parser, commands.h), finite,
// > 0 and within the fp32 range.
float parse_amax(const std::string& text) {
  const double v = decimal_error(text).empty() ? decimal_value(text) : 0.0;
  MOEFQ_CHECK(v > 0 && v <= double(std::numeric_limits<float>::max()) && float(v) > 0,
              "--amax: expected a finite decimal number > 0 (such as 2688 or 1.5e3), got '", text, "'");
  return float(v);
}

// Refuses a run whose estimated peak memory is more than the host can give, before allocating.
void check_memory(uint64_t need, const std::string& what, const std::string& advice) {
  const std::optional<uint64_t> avail = available_host_memory();
  MOEFQ_CHECK(!avail || need <= *avail, "moefq qdq: ", what, " needs about ", format_bytes(need),
              " of memory, but ", format_bytes(avail.value_or(0)), " is available; ", advice);
}

// [rows, cols] view of a tensor of any rank: blocks run along the last dimension. An empty tensor
// is [0, cols] whatever its other dimensions (their product may not even fit in 64 bits).
std::pair<int64_t, int64_t> as_matrix(const std::vector<int64_t>& shape) {
  if (shape.empty()) return {1, 1};
  if (std::find(shape.begin(), shape.end(), int64_t{0}) != shape.end()) return {0, shape.back()};
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return {rows, shape.back()};
}

// QDQ of one tensor on the chosen device; returns the amax used.
template <typename T>
float qdq_tensor(Format f, const std::vector<T>& x, std::vector<T>& y, int64_t rows, int64_t cols,
                 std::optional<float> amax, bool cuda) {
  y.resize(x.size());
  if (x.empty()) return amax.value_or(0.0f);  // nothing to do, however many rows or columns it has
  const DType dt = sizeof(T) == 2 ? DType::kBF16 : DType::kF32;
#ifdef MOEFQ_HAS_CUDA
  if (cuda) return cuda::qdq_host_tensor(f, dt, x.data(), y.data(), rows, cols, amax);
#else
  (void)cuda;
  (void)dt;
#endif
  const float a = amax ? *amax : amax_ref(x.data(), rows * cols);
  qdq_ref(f, x.data(), y.data(), rows, cols, a);
  return a;
}

template <typename T>
Result run_one(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
               const std::vector<T>& x, std::vector<T>& y, Format f, std::optional<float> amax, bool cuda) {
  const auto [rows, cols] = as_matrix(shape);
  Result r;
  r.tensor = name;
  r.dtype = dtype;
  r.format = format_name(f);
  r.shape = shape;
  r.amax = qdq_tensor(f, x, y, rows, cols, amax, cuda);
  r.amax_used = format_has_global_amax(f);
  r.m = compute_metrics(y.data(), x.data(), int64_t(x.size()));
  r.wire_bytes_per_row = wire_bytes_per_row(f, cols);
  if (f == Format::kLogfmt10) {
    const CastGroups g = logfmt10_cast_groups(x.data(), rows, cols);
    r.cast_fraction = g.fraction();
    r.wire_bytes_per_row = logfmt10_bytes_per_row(cols, g.fraction());
    if (g.cast < g.total)
      std::fprintf(stderr, "note: logfmt10 cast %llu of %s's %llu groups; the others (a block with amax >= 1, or "
                   "all its magnitudes equal) are sent as bf16%s\n", (unsigned long long)g.cast, name.c_str(),
                   (unsigned long long)g.total, g.cast == 0 ? ": nothing was compressed (rel_l2 0)" : "");
  }
  return r;
}

// The table's compact "[4,128]".
std::string shape_cell(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

void print_results(const std::vector<Result>& results) {
  Table t({"tensor", "dtype", "shape", "format", "amax", "rel_l2", "cosine", "calc_diff", "max_abs",
           "snr_db", "skipped", "B/row", "cast"});
  for (const Result& r : results) {
    const auto m = [&](const std::string& cell) { return r.m.count > 0 ? cell : std::string("-"); };  // "-": nothing compared
    t.add({r.tensor, r.dtype, shape_cell(r.shape), r.format, r.amax_used ? fmt_num(r.amax, 6) : "-",
           m(fmt_num(r.m.rel_l2)), m(fmt_fixed(r.m.cosine, 6)), m(fmt_num(r.m.calc_diff)), m(fmt_num(r.m.max_abs)),
           m(fmt_fixed(r.m.snr_db, 2)), std::to_string(r.m.skipped_nonfinite), fmt_num(r.wire_bytes_per_row, 6),
           r.cast_fraction ? fmt_num(*r.cast_fraction, 4) : "-"});
  }
  t.print();
}

nlohmann::json json_number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(fmt_num(v)); }

// The report's JSON text.
std::string report_json(const QdqOptions& o, const std::string& device, const std::vector<Result>& results) {
  nlohmann::json j;
  j["tool"] = "moefq qdq";
  j["version"] = MOEFQ_VERSION;
  j["input"] = o.in.empty() ? "built-in sample" : o.in;
  j["device"] = device;
  for (const Result& r : results)
    j["results"].push_back({{"tensor", r.tensor}, {"dtype", r.dtype}, {"shape", r.shape},
                            {"format", r.format}, {"amax", r.amax_used ? json_number(r.amax) : nlohmann::json()},
                            {"rel_l2", json_number(r.m.rel_l2)}, {"cosine", json_number(r.m.cosine)},
                            {"calc_diff", json_number(r.m.calc_diff)}, {"max_abs", json_number(r.m.max_abs)},
                            {"snr_db", json_number(r.m.snr_db)}, {"count", r.m.count},
                            {"skipped_nonfinite", r.m.skipped_nonfinite},
                            {"wire_bytes_per_row", json_number(r.wire_bytes_per_row)},
                            {"cast_fraction", r.cast_fraction ? json_number(*r.cast_fraction) : nlohmann::json()}});
  return j.dump(2) + "\n";
}

template <typename T>
std::vector<T> read_elements(const SafetensorsFile& file, const TensorInfo& t) {
  std::vector<T> v(size_t(t.end - t.begin) / sizeof(T));
  file.read_into(t, {reinterpret_cast<uint8_t*>(v.data()), v.size() * sizeof(T)});
  return v;
}

template <typename T>
std::span<const uint8_t> as_bytes(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

// Output paths are checked before any work, so a bad one fails with nothing written.
void check_outputs(const QdqOptions& o) {
  const std::vector<NamedPath> in = {{"--in", o.in}};
  if (!o.out.empty()) check_output_path(o.out, "--out", in);
  if (!o.report.empty()) {
    const std::vector<NamedPath> in_out = {{"--in", o.in}, {"--out", o.out}};
    check_output_path(o.report, "--report", in_out);
    // Neither exists yet: the inode check above cannot see that they name one file.
    std::error_code ec;
    MOEFQ_CHECK(o.out.empty() || fs::weakly_canonical(o.report, ec) != fs::weakly_canonical(o.out, ec), "--report ", o.report,
                ": is the same file as --out; give another name");
  }
}

int run_qdq(const QdqOptions& o, const CLI::App* sub) {
  MOEFQ_CHECK(sub->get_option("--out")->count() == 0 || !o.out.empty(), "--out: empty path; give a file name");
  MOEFQ_CHECK(sub->get_option("--report")->count() == 0 || !o.report.empty(),
              "--report: empty path; give a file name");
  check_outputs(o);
  std::vector<Format> formats;
  if (!o.format.empty()) {
    const auto f = parse_format(o.format);
    MOEFQ_CHECK(f.has_value(), "--format: unknown format '", o.format, "' (expected ", format_choices(), ")");
    formats.push_back(*f);
  }
  std::optional<float> amax;
  if (!o.amax.empty()) amax = parse_amax(o.amax);
  const bool cuda = tool::use_cuda(o.device);
  std::string device = "cpu";
#ifdef MOEFQ_HAS_CUDA
  if (cuda) device = "cuda: " + cuda::device_description();
#endif
  for (Format f : formats)
    if (amax && !format_has_global_amax(f))
      std::fprintf(stderr, "note: --amax is ignored by %s (its block scales need no global amax)\n", format_name(f));

  std::vector<Result> results;
  SafetensorsWriter writer;
  if (o.in.empty()) {
    // The built-in sample: synthetic activations with outlier channels, every format by default.
    MOEFQ_CHECK(o.tensors.empty(), "--tensor needs --in");
    if (formats.empty()) formats.assign(std::begin(kAllFormats), std::end(kAllFormats));
    std::fprintf(stderr, "moefq qdq: built-in sample [%lld, %lld] bf16 (synthetic activations with outlier "
                 "channels) on %s\n", (long long)o.sample_rows, (long long)o.sample_cols, device.c_str());
    // Peak: the fp32 synthetic values and their bf16 copy, or later the writer's copies of the
    // sample and of every output, the sample itself and one output being made.
    const uint64_t n = uint64_t(o.sample_rows) * uint64_t(o.sample_cols);
    check_memory(std::max(6 * n, 2 * n * (3 + formats.size())),
                 "the built-in sample of " + std::to_string(o.sample_rows) + " x " + std::to_string(o.sample_cols),
                 "give smaller --sample-rows or --sample-cols");
    std::vector<bf16> x(n);
    {
      const std::vector<float> v = synthetic_activations(o.sample_rows, o.sample_cols, 2026);
      for (size_t i = 0; i < n; ++i) x[i].bits = bf16_round(v[i]);
    }
    const std::vector<int64_t> shape = {o.sample_rows, o.sample_cols};
    writer.add("sample", StDtype::kBF16, shape, as_bytes(x));
    for (Format f : formats) {
      std::vector<bf16> y;
      results.push_back(run_one("sample", "BF16", shape, x, y, f, amax, cuda));
      writer.add(std::string("sample.") + format_name(f), StDtype::kBF16, shape, as_bytes(y));
    }
  } else {
    MOEFQ_CHECK(sub->get_option("--sample-rows")->count() + sub->get_option("--sample-cols")->count() == 0,
                "--sample-rows and --sample-cols size the built-in sample; with --in they cannot be used");
    MOEFQ_CHECK(!o.out.empty(), "--out is required with --in (the fake-quantized copy is written there)");
    MOEFQ_CHECK(formats.size() == 1, "--format is required with --in (one of ", format_choices(), ")");
    const SafetensorsFile file = SafetensorsFile::open(o.in, "--in " + o.in);
    std::set<std::string> wanted(o.tensors.begin(), o.tensors.end());
    for (const std::string& name : wanted)
      MOEFQ_CHECK(file.find(name) != nullptr, "--tensor: ", o.in, " has no tensor named '", name, "'");
    // Peak: the writer's copy of every tensor, plus the input and output of the largest one.
    uint64_t data = 0, largest = 0;
    for (const TensorInfo& t : file.header().tensors) {
      data += t.end - t.begin;
      largest = std::max<uint64_t>(largest, t.end - t.begin);
    }
    check_memory(data + 2 * largest, o.in + " (" + format_bytes(data) + " of tensors)",
                 "split the file into smaller ones");
    for (const auto& [k, v] : file.header().metadata) writer.set_metadata(k, v);
    writer.set_metadata("moefq.qdq", std::string(format_name(formats[0])) + (amax ? " amax " + o.amax : " dynamic amax"));
    const auto& tensors = file.header().tensors;
    const auto start = std::chrono::steady_clock::now();
    uint64_t bytes_done = 0;  // of `data`, for the progress lines' estimate
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TensorInfo& t = tensors[i];
      const uint64_t before = std::exchange(bytes_done, bytes_done + (t.end - t.begin));
      const bool selected = wanted.empty() || wanted.count(t.name);
      const bool floating = t.dtype == StDtype::kBF16 || t.dtype == StDtype::kF32;
      if (!selected || !floating) {
        if (selected)
          std::fprintf(stderr, "note: %s has dtype %s; copied unchanged (only BF16 and F32 are quantized)\n",
                       terminal_safe(t.name).c_str(), st_dtype_name(t.dtype));
        writer.add(t.name, t.dtype, t.shape, file.read(t));
        continue;
      }
      std::fprintf(stderr, "[%zu/%zu] %s %s %s%s\n", i + 1, tensors.size(), terminal_safe(t.name).c_str(),
                   st_dtype_name(t.dtype),
                   shape_cell(t.shape).c_str(), elapsed_and_eta(start, double(before), double(data)).c_str());
      if (t.dtype == StDtype::kBF16) {
        const auto x = read_elements<bf16>(file, t);
        std::vector<bf16> y;
        results.push_back(run_one(t.name, "BF16", t.shape, x, y, formats[0], amax, cuda));
        writer.add(t.name, t.dtype, t.shape, as_bytes(y));
      } else {
        const auto x = read_elements<float>(file, t);
        std::vector<float> y;
        results.push_back(run_one(t.name, "F32", t.shape, x, y, formats[0], amax, cuda));
        writer.add(t.name, t.dtype, t.shape, as_bytes(y));
      }
    }
  }
  // The files first: a reader that closes stdout early (`| head`) loses only the table. Both are
  // written and synced before either is published, so that a failure of one (a full disk) leaves
  // neither replaced.
  std::optional<AtomicFile> out_file, report_file;
  if (!o.out.empty()) {
    out_file.emplace(o.out);
    writer.write_to(*out_file);
  }
  if (!o.report.empty()) {
    const std::string text = report_json(o, device, results);
    report_file.emplace(o.report);
    report_file->write(text.data(), text.size());
    report_file->finish();
  }
  for (std::optional<AtomicFile>* f : {&out_file, &report_file})
    if (f->has_value()) {
      (*f)->publish();
      std::fprintf(stderr, "wrote %s\n", terminal_safe((*f)->path()).c_str());
    }
  print_results(results);
  finish_stdout();
  return 0;
}

}  // namespace

std::function<int()> add_qdq_command(CLI::App& app) {
  auto opts = std::make_shared<QdqOptions>();
  CLI::App* sub = app.add_subcommand(
      "qdq", "Fake-quantize (quantize-dequantize) the BF16/F32 tensors of a safetensors file and "
             "print each tensor's error metrics. Without --in, runs every format on a built-in sample.");
  sub->add_option("--in", opts->in, "input .safetensors file (default: a built-in sample of synthetic activations)");
  sub->add_option("--out", opts->out,
                  "output .safetensors file (same names, dtypes and shapes); required with --in, optional without");
  sub->add_option("--format", opts->format,
                  format_choices() + "; required with --in (default without --in: every format)");
  sub->add_option("--amax", opts->amax, "global amax (fp8, nvfp4, int8); default: each tensor's own max |x|");
  sub->add_option("--tensor", opts->tensors, "only these tensors (repeatable); the others are copied unchanged");
  sub->add_option("--device", opts->device, "auto | cpu | cuda (default auto: cuda when a GPU is visible)");
  sub->add_option("--report", opts->report, "also write the metrics as JSON to this file");
  sub->add_option("--sample-rows", opts->sample_rows, "rows of the built-in sample (default 512)")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--sample-cols", opts->sample_cols, "columns of the built-in sample (default 7168)")
      ->check(CLI::Range(1, 1 << 16));
  sub->footer(
      "Examples:\n"
      "  moefq qdq                                   # every format on the built-in sample\n"
      "  moefq qdq --in acts.safetensors --out acts.nvfp4.safetensors --format nvfp4 --amax 2688\n"
      "B/row: the bytes per row on the wire, scales included; cast: logfmt10's fraction of cast groups (the\n"
      "others are sent as bf16, which B/row counts).\n"
      "Exit status: 0 success, 2 bad input (nothing is written then).");
  return [sub, opts] { return sub->parsed() ? run_qdq(*opts, sub) : 0; };
}

}  // namespace moefq::cli
