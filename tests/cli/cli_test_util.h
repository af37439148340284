// Helpers of the tests that run programs (the moefq binary, headless Chromium) through the shell:
// a unique temporary path, file reads and writes, shell quoting, a run with stdout and stderr
// captured to files, a fixture whose program runs in a fresh directory, and splitting of captured
// text into lines and words.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace moefq::test {

// What a program run left behind.
struct RunResult {
  int status = -1;  // exit status, or -1 when the process did not exit normally
  std::string out, err;
};

// A path under the system temporary directory that no other test process uses:
// prefix + pid + "_" + a random number. Nothing is created.
inline std::filesystem::path unique_temp_path(const std::string& prefix) {
  std::random_device rd;
  return std::filesystem::temp_directory_path() /
         (prefix + std::to_string(::getpid()) + "_" + std::to_string(rd()));
}

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline std::vector<uint8_t> read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::filesystem::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// s as one single-quoted shell word.
inline std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs the shell command line `command` (its words already quoted where needed) in directory cwd
// (the current one when empty), stdout to the file out and stderr to the file err; returns the
// exit status and the text of both files.
inline RunResult run_captured(const std::string& command, const std::filesystem::path& out,
                              const std::filesystem::path& err, const std::filesystem::path& cwd = {}) {
  const std::string cmd = (cwd.empty() ? std::string() : "cd " + quote(cwd.string()) + " && ") + command + " >" +
                          quote(out.string()) + " 2>" + quote(err.string());
  const int raw = std::system(cmd.c_str());
  RunResult r;
  r.status = (raw != -1 && WIFEXITED(raw)) ? WEXITSTATUS(raw) : -1;
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

// A fixture for a program run in a fresh directory per test: work_ (the program's cwd, so relative
// paths resolve there, holding only what the program wrote) and, beside it under root_, the files
// of the captured stdout and stderr. root_ is removed at the end of the test.
class WorkDirTest : public ::testing::Test {
 protected:
  // prefix: the start of root_'s name (unique_temp_path).
  explicit WorkDirTest(std::string prefix) : prefix_(std::move(prefix)) {}

  void SetUp() override {
    root_ = unique_temp_path(prefix_);
    work_ = root_ / "work";
    std::filesystem::create_directories(work_);
    std::filesystem::create_directories(root_ / "log");
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }

  // Runs the shell command line `command` in work_, stdout and stderr captured.
  RunResult run_in_work(const std::string& command) const {
    return run_captured(command, root_ / "log" / "stdout", root_ / "log" / "stderr", work_);
  }

  std::filesystem::path path(const std::string& name) const { return work_ / name; }

  // Every path under work_, relative, sorted.
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::recursive_directory_iterator(work_))
      names.push_back(std::filesystem::relative(e.path(), work_).string());
    std::sort(names.begin(), names.end());
    return names;
  }

  // A run refused as bad input: exit 2, "moefq: error: " and every needle on stderr, no table
  // (no "rel_l2") on stdout, and work_ as `before` (its listing() before the run) held.
  void expect_bad_input(const RunResult& r, const std::vector<std::string>& before,
                        const std::vector<std::string>& needles) const;

  std::filesystem::path root_, work_;

 private:
  std::string prefix_;
};

// A failure message: the exit status and both captured streams.
inline std::string describe(const RunResult& r) {
  return "exit " + std::to_string(r.status) + "\n--- stdout ---\n" + r.out + "--- stderr ---\n" + r.err;
}

inline void WorkDirTest::expect_bad_input(const RunResult& r, const std::vector<std::string>& before,
                                         const std::vector<std::string>& needles) const {
  EXPECT_EQ(r.status, 2) << describe(r);
  EXPECT_NE(r.err.find("moefq: error: "), std::string::npos) << describe(r);
  for (const auto& n : needles)
    EXPECT_NE(r.err.find(n), std::string::npos) << "the message lacks \"" << n << "\"\n" << describe(r);
  EXPECT_EQ(r.out.find("rel_l2"), std::string::npos) << "no table on bad input\n" << describe(r);
  EXPECT_EQ(listing(), before) << "bad input must leave the directory as it was";
}

inline std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The whitespace-separated words of a line.
inline std::vector<std::string> split_words(const std::string& line) {
  std::vector<std::string> words;
  std::istringstream in(line);
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

}  // namespace moefq::test
