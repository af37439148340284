// Files in and out (fileio.h): inputs other than regular files are refused by name without a
// blocking open, files read whole have a cap, outputs never replace a non-regular file or a link,
// and a directory of outputs appears whole, also when two writers publish it at once.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cli/cli_test_util.h"
#include "moefq/errors.h"
#include "moefq/fileio.h"
#include "moefq/host_memory.h"
#include "test_util.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;
using test::error_of, test::read_text;

// MemAvailable read from /proc/meminfo (Linux), limited by the cgroup's room where there is one:
// a figure above zero and below the machine's total.
TEST(HostMemory, AvailableIsReadAndBelowTheTotal) {
  const std::string info = read_text("/proc/meminfo");
  const size_t at = info.find("MemTotal:");
  ASSERT_NE(at, std::string::npos);
  const uint64_t total_kib = std::stoull(info.substr(at + 9));
  const std::optional<uint64_t> avail = available_host_memory();
  ASSERT_TRUE(avail.has_value());
  EXPECT_GT(*avail, 0u);
  EXPECT_LE(*avail, total_kib * 1024);
}

constexpr std::string_view kNames[] = {"a.txt", "b.txt", "c.txt"};

class FileIo : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = test::unique_temp_path("moefq_fileio_");
    fs::create_directories(root_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  std::string p(const std::string& name) const { return (root_ / name).string(); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(root_ / name) << text; }
  std::vector<std::string> listing(const fs::path& dir) const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
  static bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

  fs::path root_;
};

// ---- Inputs

TEST_F(FileIo, InputRefusesEveryNonRegularFileByName) {
  ASSERT_EQ(::mkfifo(p("fifo").c_str(), 0600), 0);
  fs::create_directory(root_ / "dir");
  // A FIFO without a writer: an open for reading would block forever.
  EXPECT_EQ(error_of([&] { InputFile::open(p("fifo"), "--in fifo"); }),
            "--in fifo: is a FIFO (named pipe), not a regular file");
  EXPECT_EQ(error_of([&] { InputFile::open(p("dir"), "--in dir"); }), "--in dir: is a directory, not a regular file");
  EXPECT_EQ(error_of([&] { InputFile::open("/dev/zero", "--config /dev/zero"); }),
            "--config /dev/zero: is a character device, not a regular file");
  EXPECT_EQ(error_of([&] { InputFile::open(p("missing"), "--in missing"); }), "--in missing: no such file");
  // A link is followed: what counts is what it leads to.
  fs::create_symlink("/dev/zero", root_ / "zero_link");
  EXPECT_TRUE(has(error_of([&] { InputFile::open(p("zero_link"), "index"); }), "is a character device"));
  write("file", "0123456789");
  fs::create_symlink(root_ / "file", root_ / "file_link");
  EXPECT_EQ(InputFile::open(p("file_link"), "x").size(), 10u);
}

TEST_F(FileIo, ReadWholeFileHasACap) {
  write("small", "0123456789");
  EXPECT_EQ(read_regular_file(p("small"), 10, "f"), "0123456789");
  const std::string msg = error_of([&] { read_regular_file(p("small"), 9, "--load-calibration small"); });
  EXPECT_TRUE(has(msg, "--load-calibration small: the file is 10 B, over the limit of 9 B")) << msg;
  // A sparse file far over the cap is refused from its size, without reading it.
  std::ofstream(root_ / "huge").close();
  fs::resize_file(root_ / "huge", uint64_t(1) << 40);
  EXPECT_TRUE(has(error_of([&] { read_regular_file(p("huge"), size_t(64) << 20, "huge"); }), "1.0 TiB"));
  EXPECT_TRUE(has(error_of([&] { read_regular_file("/dev/zero", size_t(64) << 20, "zero"); }), "character device"));
}

TEST_F(FileIo, ReadPastTheEndOfATruncatedFileIsAnError) {
  write("f", std::string(100, 'x'));
  const InputFile f = InputFile::open(p("f"), "--in f");
  fs::resize_file(root_ / "f", 40);
  std::vector<uint8_t> buf(50);
  EXPECT_TRUE(has(error_of([&] { f.read_at(20, buf); }), "--in f: the file ends at byte 40 but had 100 bytes"));
}

// ---- File outputs

TEST_F(FileIo, OutputPathRefusesLinksDevicesFifosDirectories) {
  write("target", "keep");
  fs::create_symlink(root_ / "target", root_ / "link");
  fs::create_symlink(root_ / "nowhere", root_ / "dangling");
  ASSERT_EQ(::mkfifo(p("fifo").c_str(), 0600), 0);
  fs::create_directory(root_ / "dir");
  EXPECT_TRUE(has(error_of([&] { check_output_path(p("link"), "--out"); }), "is a symbolic link"));
  EXPECT_TRUE(has(error_of([&] { check_output_path(p("dangling"), "--out"); }), "is a symbolic link"));
  EXPECT_TRUE(has(error_of([&] { check_output_path(p("fifo"), "--report"); }), "--report " + p("fifo") + ": is a FIFO"));
  EXPECT_TRUE(has(error_of([&] { check_output_path(p("dir"), "--save"); }), "is a directory"));
  EXPECT_TRUE(has(error_of([&] { check_output_path("/dev/null", "--out"); }), "/dev/null: is a character device"));
  EXPECT_TRUE(has(error_of([&] { check_output_path("", "--out"); }), "--out: empty path"));
  EXPECT_TRUE(has(error_of([&] { check_output_path(p("nodir/x"), "--out"); }), "does not exist"));
  EXPECT_TRUE(has(error_of([&] { check_output_path(p("target/x"), "--out"); }), "not a directory"));
  // The input itself, under another name (a hard link) too.
  fs::create_hard_link(root_ / "target", root_ / "hard");
  const std::vector<NamedPath> inputs = {{"--in", p("target")}};
  EXPECT_TRUE(has(error_of([&] { check_output_path(p("hard"), "--out", inputs); }), "is the same file as --in"));
  EXPECT_TRUE(has(error_of([&] { check_output_path(p("target"), "--out", inputs); }), "is the same file as --in"));
  // A new file and an existing regular one are fine; the probe leaves nothing behind.
  check_output_path(p("new"), "--out", inputs);
  write("old", "x");
  check_output_path(p("old"), "--out", inputs);
  EXPECT_EQ(listing(root_), (std::vector<std::string>{"dangling", "dir", "fifo", "hard", "link", "old", "target"}));
  EXPECT_EQ(read_text(root_ / "target"), "keep");
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
}

// Checked before the work, but replaced by a FIFO (or a link) while it ran: the commit refuses,
// leaves what is there and removes its temporary.
TEST_F(FileIo, CommitNeverRenamesOverANonRegularFile) {
  for (const bool fifo : {true, false}) {
    SCOPED_TRACE(fifo ? "fifo" : "link");
    fs::remove_all(root_);
    fs::create_directories(root_);
    {
      AtomicFile f(p("out"));
      f.write("data", 4);
      write("elsewhere", "keep");
      if (fifo) ASSERT_EQ(::mkfifo(p("out").c_str(), 0600), 0);
      else fs::create_symlink(root_ / "elsewhere", root_ / "out");
      EXPECT_TRUE(has(error_of([&] { f.commit(); }), fifo ? "is now a FIFO" : "is now a symbolic link"));
    }
    EXPECT_EQ(fifo, fs::is_fifo(fs::symlink_status(root_ / "out")));
    EXPECT_EQ(!fifo, fs::is_symlink(fs::symlink_status(root_ / "out")));
    EXPECT_EQ(read_text(root_ / "elsewhere"), "keep");
    EXPECT_EQ(listing(root_), (std::vector<std::string>{"elsewhere", "out"})) << "the temporary must go";
  }
}

// ---- Directory outputs

TEST_F(FileIo, OutputDirAcceptsNewOrEarlierReportsOnly) {
  check_output_dir(p("new/sub"), "--out", kNames);
  fs::create_directory(root_ / "earlier");
  write("earlier/a.txt", "1");
  check_output_dir(p("earlier"), "--out", kNames);
  check_output_dir(p("earlier/"), "--out", kNames);
  write("earlier/notes.md", "mine");
  EXPECT_TRUE(has(error_of([&] { check_output_dir(p("earlier"), "--out", kNames); }), "holds other entries (notes.md)"));
  fs::create_directory(root_ / "d2");
  fs::create_directory(root_ / "d2" / "a.txt");  // the right name, but a directory
  EXPECT_TRUE(has(error_of([&] { check_output_dir(p("d2"), "--out", kNames); }), "holds other entries (a.txt)"));
  fs::create_symlink(root_ / "earlier", root_ / "dlink");
  EXPECT_TRUE(has(error_of([&] { check_output_dir(p("dlink"), "--out", kNames); }), "is a symbolic link"));
  write("file", "x");
  EXPECT_TRUE(has(error_of([&] { check_output_dir(p("file"), "--out", kNames); }),
                  "--out " + p("file") + ": exists and is a regular file, not a directory"));
  EXPECT_TRUE(has(error_of([&] { check_output_dir(p("file/sub"), "--out", kNames); }), "is not a directory"));
  EXPECT_TRUE(has(error_of([&] { check_output_dir("", "--out", kNames); }), "--out: empty path"));
  EXPECT_TRUE(has(error_of([&] { check_output_dir(".", "--out", kNames); }), "by its name"));
  EXPECT_TRUE(has(error_of([&] { check_output_dir(p("earlier/.."), "--out", kNames); }), "by its name"));
  EXPECT_FALSE(fs::exists(root_ / "new")) << "the check creates nothing";
}

// The directory's files are removed when it is replaced: one that is an input of the run (under
// any name) makes the directory unusable as an output.
TEST_F(FileIo, OutputDirRefusesOneHoldingAnInput) {
  fs::create_directory(root_ / "earlier");
  write("earlier/b.txt", "config");
  fs::create_hard_link(root_ / "earlier" / "b.txt", root_ / "config.json");
  write("other.json", "x");
  const std::vector<NamedPath> other = {{"--config", p("other.json")}, {"--recipe", "not_a_path"}};
  check_output_dir(p("earlier"), "--out", kNames, other);
  const std::vector<NamedPath> inputs = {{"--recipe", "not_a_path"}, {"--config", p("config.json")}};
  EXPECT_EQ(error_of([&] { check_output_dir(p("earlier"), "--out", kNames, inputs); }),
            "--out " + p("earlier") + ": its b.txt is --config " + p("config.json") +
                "; the directory is replaced as a whole, so give another directory");
}

// Outputs get the permissions of any new file (0666, a directory 0777, less the umask); one that
// replaces an earlier file or directory keeps that one's permission bits.
TEST_F(FileIo, OutputPermissionsFollowTheUmaskOrTheReplacedFile) {
  const auto mode = [&](const std::string& name) {
    struct stat st {};
    EXPECT_EQ(::stat(p(name).c_str(), &st), 0) << name;
    return st.st_mode & 07777;
  };
  const mode_t saved = ::umask(027);
  write_file_atomic(p("new.json"), "{}");
  EXPECT_EQ(mode("new.json"), 0640u);
  write("old.json", "x");
  ::chmod(p("old.json").c_str(), 0604);
  write_file_atomic(p("old.json"), "{}");
  EXPECT_EQ(mode("old.json"), 0604u);
  EXPECT_EQ(read_text(root_ / "old.json"), "{}");
  for (const bool renameat2 : {true, false}) {
    SCOPED_TRACE(renameat2 ? "renameat2" : "two renames");
    if (!renameat2) ::setenv("MOEFQ_TEST_NO_RENAMEAT2", "1", 1);
    const std::string d = renameat2 ? "d1" : "d2";
    ::umask(027);
    {
      AtomicDirectory out(p(d), kNames);
      out.write("a.txt", "1");
      out.commit();
    }
    EXPECT_EQ(mode(d), 0750u);
    EXPECT_EQ(mode(d + "/a.txt"), 0640u);
    ::chmod(p(d).c_str(), 0705);
    ::umask(002);
    {
      AtomicDirectory out(p(d), kNames);
      out.write("a.txt", "2");
      out.commit();
    }
    EXPECT_EQ(mode(d), 0705u) << "the replaced directory's permissions";
    EXPECT_EQ(mode(d + "/a.txt"), 0664u);
    EXPECT_EQ(read_text(root_ / d / "a.txt"), "2");
    ::unsetenv("MOEFQ_TEST_NO_RENAMEAT2");
  }
  ::umask(saved);
}

TEST_F(FileIo, DirectoryIsPublishedWholeAndReplacesTheEarlierOne) {
  for (const bool renameat2 : {true, false}) {
    SCOPED_TRACE(renameat2 ? "renameat2" : "two renames");
    if (!renameat2) ::setenv("MOEFQ_TEST_NO_RENAMEAT2", "1", 1);
    fs::remove_all(root_);
    fs::create_directories(root_);
    {
      AtomicDirectory d(p("x/rep"), kNames);
      d.write("a.txt", "A1");
      d.write("b.txt", "B1");
      d.write("c.txt", "C1");
      EXPECT_FALSE(fs::exists(root_ / "x" / "rep")) << "nothing visible before the commit";
      d.commit();
    }
    EXPECT_EQ(read_text(root_ / "x" / "rep" / "b.txt"), "B1");
    // An earlier directory missing one file is replaced whole: no file of it survives.
    fs::remove(root_ / "x" / "rep" / "c.txt");
    {
      AtomicDirectory d(p("x/rep"), kNames);
      d.write("a.txt", "A2");
      d.write("c.txt", "C2");
      d.commit();
    }
    EXPECT_EQ(listing(root_ / "x" / "rep"), (std::vector<std::string>{"a.txt", "c.txt"}));
    EXPECT_EQ(read_text(root_ / "x" / "rep" / "c.txt"), "C2");
    EXPECT_EQ(listing(root_ / "x"), std::vector<std::string>{"rep"}) << "no temporary is left";
    // Not committed (an error while writing): the earlier directory stays as it was.
    {
      AtomicDirectory d(p("x/rep"), kNames);
      d.write("a.txt", "A3");
    }
    EXPECT_EQ(read_text(root_ / "x" / "rep" / "a.txt"), "A2");
    EXPECT_EQ(listing(root_ / "x"), std::vector<std::string>{"rep"});
    ::unsetenv("MOEFQ_TEST_NO_RENAMEAT2");
  }
}

// Two runs writing the same report directory at once: the one that publishes last wins with all of
// its files; no mix of the two is ever left.
TEST_F(FileIo, ConcurrentWritersNeverMixTheirFiles) {
  for (const bool renameat2 : {true, false}) {
    SCOPED_TRACE(renameat2 ? "renameat2" : "two renames");
    if (!renameat2) ::setenv("MOEFQ_TEST_NO_RENAMEAT2", "1", 1);
    fs::remove_all(root_);
    fs::create_directories(root_);
    AtomicDirectory first(p("rep"), kNames), second(p("rep"), kNames);
    for (std::string_view n : kNames) first.write(n, "first " + std::string(n));
    for (std::string_view n : kNames) second.write(n, "second " + std::string(n));
    second.commit();
    first.commit();
    for (std::string_view n : kNames) EXPECT_EQ(read_text(root_ / "rep" / n), "first " + std::string(n));
    EXPECT_EQ(listing(root_), std::vector<std::string>{"rep"});
    ::unsetenv("MOEFQ_TEST_NO_RENAMEAT2");
  }
}

// A directory that gained a foreign file since the check is not replaced.
TEST_F(FileIo, PublishRefusesADirectoryThatGainedOtherFiles) {
  fs::create_directory(root_ / "rep");
  AtomicDirectory d(p("rep"), kNames);
  d.write("a.txt", "A");
  write("rep/mine.txt", "precious");
  EXPECT_TRUE(has(error_of([&] { d.commit(); }), "now holds other entries (mine.txt)"));
  EXPECT_EQ(read_text(root_ / "rep" / "mine.txt"), "precious");
}

// A mount point cannot be replaced by a rename: refused when the output is checked, by name.
// Every mount point of this machine that is a directory (/proc, /dev, ...) or a file is tried.
TEST_F(FileIo, OutputsRefuseMountPoints) {
  std::ifstream mounts("/proc/self/mountinfo");
  std::string line;
  int tried = 0;
  while (std::getline(mounts, line)) {
    std::istringstream fields(line);
    std::string id, parent, devno, root, point;
    fields >> id >> parent >> devno >> root >> point;
    if (point == "/" || point.find('\\') != std::string::npos) continue;  // "/" is refused for itself
    struct stat st {};
    if (::lstat(point.c_str(), &st) != 0) continue;
    std::string m;
    if (S_ISDIR(st.st_mode))
      m = error_of([&] { check_output_dir(point, "--out", kNames); });
    else if (S_ISREG(st.st_mode))
      m = error_of([&] { check_output_path(point, "--out"); });
    else
      continue;
    EXPECT_TRUE(has(m, "--out " + point + ": is a mount point")) << m;
    ++tried;
  }
  EXPECT_GT(tried, 0) << "no mount point to try (/proc is one on Linux)";
}

// Any name the file system allows works for an output: the temporary's name is cut short where
// the target's name plus ".tmp.XXXXXX" would be too long. An empty path or a directory is refused
// by AtomicFile itself (save_safetensors, calibration files), with nothing created.
TEST_F(FileIo, AtomicFileTakesAnyLegalNameAndRefusesDirectories) {
  const std::string longest(255, 'n');
  check_output_path(p(longest), "--out");
  write_file_atomic(p(longest), "x");
  EXPECT_EQ(read_text(root_ / longest), "x");
  write_file_atomic(p(longest), "y");  // replaced through a temporary of a shortened name
  EXPECT_EQ(read_text(root_ / longest), "y");
  EXPECT_TRUE(has(error_of([&] { check_output_path(p(longest + "n"), "--out"); }), "File name too long"));
  fs::create_directory(root_ / "d");
  EXPECT_TRUE(has(error_of([&] { write_file_atomic(p("d"), "x"); }), "is a directory"));
  EXPECT_TRUE(has(error_of([&] { write_file_atomic(p("d") + "/", "x"); }), "ends with '/'"));
  EXPECT_TRUE(has(error_of([&] { write_file_atomic("", "x"); }), "empty path"));
  EXPECT_EQ(listing(root_), (std::vector<std::string>{"d", longest}));
  EXPECT_TRUE(listing(root_ / "d").empty());
}

// Text printed to a terminal: controls escaped, UTF-8 kept, other bytes as \xNN.
TEST(TerminalSafe, EscapesControlsAndBadBytes) {
  EXPECT_EQ(terminal_safe("plain name.weight"), "plain name.weight");
  EXPECT_EQ(terminal_safe("a\nb\tc\rd\x1b[31m\x07"), "a\\nb\\tc\\rd\\x1b[31m\\x07");
  EXPECT_EQ(terminal_safe("line\n\ttab", true), "line\n\ttab");
  EXPECT_EQ(terminal_safe("\xc3\xa9t\xc3\xa9 \xe2\x82\xac"), "\xc3\xa9t\xc3\xa9 \xe2\x82\xac");  // été €
  EXPECT_EQ(terminal_safe("\xc2\x9b" "2J"), "\\u009b2J");  // the C1 control sequence introducer
  EXPECT_EQ(terminal_safe("\xff\xc3"), "\\xff\\xc3");
}

// JSON text checked before a DOM parser builds it: depth, and a tree far larger than the text.
TEST(JsonText, DepthAndTreeSizeAreBounded) {
  check_json_text(R"({"version": 2, "quantizers": {"a": {"amax": 1.5, "rank_amax": [1, 2]}}})", "f.json", 16);
  check_json_text(R"({"s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[ \" {{{{{{{{{{{{{{{{{{{{{{"})", "f.json", 4);  // in strings
  const std::string deep = error_of([] { check_json_text(std::string(17, '['), "f.json", 16); });
  EXPECT_NE(deep.find("f.json: nests deeper than 16"), std::string::npos) << deep;
  std::string wide = "[{}";
  for (int i = 0; i < 1'000'000; ++i) wide += ",{}";
  wide += "]";
  const std::string m = error_of([&] { check_json_text(wide, "w.json", 16); });
  EXPECT_NE(m.find("w.json: 1000001 JSON values"), std::string::npos) << m;
}

}  // namespace
}  // namespace moefq
