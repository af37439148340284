// Files in and out, so that a bad path fails before any work and no failure or signal leaves a
// half-written or mixed output (docs/cli.md):
// - inputs are regular files only: a directory, FIFO, socket or device is refused by name, without
//   a blocking open; a file read whole has a size cap; reads that find the file shorter than when
//   it was opened (truncated meanwhile) are errors, not crashes;
// - outputs are checked before any work (check_output_path, check_output_dir), written to a
//   temporary beside the target and renamed into place when complete, never over a non-regular
//   file or a symbolic link; a directory of outputs appears whole, with one rename; a new output
//   gets the permissions of 0666 (a directory 0777) less the umask, a replaced one keeps its own;
// - live temporaries are registered, so that SIGINT, SIGTERM and SIGHUP remove them once
//   install_cleanup_signal_handlers() has run (the CLI does this at start); SIGPIPE ends nothing.
// Every failure throws moefq::Error (bad input) with a message that names the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moefq {

// A regular file opened for reading at offsets (pread: nothing is mapped, so a file truncated by
// someone else gives an error instead of SIGBUS).
class InputFile {
 public:
  // Opens `path` read-only. Messages start with `what` (e.g. "--activations acts.safetensors").
  // Refuses, naming what it is, anything but a regular file (checked with stat before opening,
  // then with fstat on a non-blocking descriptor); "no such file" only when the path is absent.
  static InputFile open(const std::string& path, std::string_view what);

  InputFile(InputFile&& other) noexcept;
  InputFile& operator=(InputFile&& other) noexcept;
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile();

  uint64_t size() const { return size_; }  // bytes when opened
  const std::string& what() const { return what_; }
  // Reads exactly dst.size() bytes at `offset`; throws naming the file when it ends earlier.
  void read_at(uint64_t offset, std::span<uint8_t> dst) const;

 private:
  InputFile() = default;
  int fd_ = -1;
  uint64_t size_ = 0;
  std::string what_;
};

// The whole of a regular file of at most max_bytes bytes (InputFile's refusals, and a file over
// the cap is refused with both sizes in the message).
std::string read_regular_file(const std::string& path, size_t max_bytes, std::string_view what);

// Checks JSON text before a DOM parser builds it, so that a file within its size cap cannot make the
// parser recurse out of the stack or build a tree many times the file's size: nesting deeper
// than max_depth, or a tree that would take more than 16 times the text's size (1 MiB at least),
// is bad input naming `what`. A scan of the text (strings skipped), no allocation.
void check_json_text(std::string_view text, std::string_view what, int max_depth);

// An input an output must not replace: (how messages name it, its path).
using NamedPath = std::pair<std::string, std::string>;

// Checks, before any work, that `path` can be written as a file output: it is not empty; it is
// absent or a regular file (a symbolic link, directory, FIFO, socket or device is refused); it is
// not the same file (device and inode) as one of `inputs`; its directory exists and a temporary
// file can be created there (tried, then removed). Messages start with `what` (e.g. "--out").
void check_output_path(const std::string& path, std::string_view what, std::span<const NamedPath> inputs = {});

// A file written to a temporary beside the target, renamed over it when complete. Several files
// of one command are published together: write and finish() each, then publish() each.
class AtomicFile {
 public:
  // Creates the temporary PATH.tmp.XXXXXX (the name cut short where PATH's name is too long for
  // that: any legal name works) with mode 0666 less the umask (or the directory's default ACL), as
  // any new file; throws naming `path` when it cannot, or when `path` is empty or a directory.
  explicit AtomicFile(std::string path);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  // Removes the temporary unless commit() succeeded; an existing target is never touched.
  ~AtomicFile();

  const std::string& path() const { return path_; }
  void write(const void* data, size_t size);  // all of it, retrying short writes
  // fsync, close, rename over the target; a target that exists passes its permission bits on to
  // the new file. Refuses (and leaves the target alone) when the target
  // is now something other than a regular file, e.g. a FIFO or a link created since the check.
  void commit();  // finish(), then publish()
  // fsync, close and the target's check: the file is complete, not yet visible.
  void finish();
  // The rename over the target (checked again), after finish().
  void publish();

 private:
  std::string path_, tmp_path_;
  int fd_ = -1;
  int slot_ = -1;  // in the registry of live temporaries
  bool committed_ = false, written_ = false;
};

// The whole file in one call.
void write_file_atomic(const std::string& path, std::string_view content);

// Checks, before any work, that `path` can be published as an AtomicDirectory holding the files
// `names`: not empty and not "." or ".."; absent, or a directory (not a link, not a mount point) that holds only
// regular files of those names (earlier outputs: the directory is replaced as a whole) and is not
// the working directory; its nearest existing ancestor is a directory where a temporary
// directory can be created (tried, then removed).
// Nor may one of those files be one of `inputs` (device and inode compared): it would be removed
// with the directory it replaces.
void check_output_dir(const std::string& path, std::string_view what, std::span<const std::string_view> names,
                      std::span<const NamedPath> inputs = {});

// A directory of files that appears whole or not at all: the files go into a temporary directory
// PATH.tmp.XXXXXX beside the target, published by one rename (an atomic exchange when the target
// exists; the earlier files, now in the temporary, are then removed). Of concurrent writers, the
// last to publish wins with all of its files; a reader never sees files of two runs. A new
// directory gets 0777 less the umask, one that replaces an earlier directory that one's permission
// bits; its files 0666 less the umask.
class AtomicDirectory {
 public:
  // Creates the target's missing parent directories and the temporary one.
  AtomicDirectory(std::string path, std::span<const std::string_view> names);
  AtomicDirectory(const AtomicDirectory&) = delete;
  AtomicDirectory& operator=(const AtomicDirectory&) = delete;
  // Removes the temporary directory and its files unless commit() succeeded.
  ~AtomicDirectory();

  // Writes the file `name` (one of `names`) into the temporary directory.
  void write(std::string_view name, std::string_view content);
  // Publishes the directory with one rename.
  void commit();

 private:
  void remove_temporary();
  std::string path_, tmp_path_;
  std::vector<std::string> names_;
  std::vector<int> slots_;  // the temporary directory's, then each file's
};

// A std::filesystem failure on a path the user gave (a symbolic link loop, a name too long, no
// permission) as a message naming the path: "PATH: Too many levels of symbolic links". It is bad
// input (the CLI's exit status 2, Python's ValueError), not an internal error.
std::string filesystem_error_message(const std::filesystem::filesystem_error& e);

// From now on the terminating signals listed above remove the live temporaries of AtomicFile and
// AtomicDirectory, then end the process with the signal's default action; SIGPIPE no longer ends
// the process: a write to a pipe whose reader has gone fails with EPIPE instead (printing then
// stops quietly), so that a run whose table is piped into `head` still publishes its outputs; nor
// does SIGXFSZ: a write over the file size limit fails with EFBIG, reported as a full disk is. A
// signal that is ignored, or has a handler, when this is called is left as it is. Call once, from
// main.
void install_cleanup_signal_handlers();

// Flushes stdout at the end of a command. Returns when everything printed was written, or when
// stdout is a pipe or socket whose reader has gone (the reader closed it early, taking what it
// wanted: the command's exit status stands). Any other failure (a full disk, an I/O error) throws
// moefq::Error: the table was lost. Commands publish their output files before they print.
void finish_stdout();

// `s` safe to print to a terminal: control characters (newline, tab, escape, C1 controls) as
// escapes (\n, \t, \x1b, \u009b) and bytes that are not UTF-8 as \xNN, so that a name from a file
// cannot move the cursor, recolour or rewrite what the user sees; a backslash stays as it is.
// keep_newlines: a message's own line breaks (and tabs) stay.
std::string terminal_safe(std::string_view s, bool keep_newlines = false);

// A test hook: when the environment variable MOEFQ_TEST_RAISE is "POINT:SIGNUM" with POINT equal to
// `point`, raises signal SIGNUM here (tests kill or stop a run at a chosen step). Points:
// "atomic-file-write" (an AtomicFile after its first write), "atomic-dir-written" (every file of an
// AtomicDirectory written, before publishing), "atomic-dir-published" (published, before the
// earlier files are removed).
// With MOEFQ_TEST_NO_RENAMEAT2 set, AtomicDirectory publishes as on a file system without
// renameat2's flags (the earlier directory moved aside, then the new one renamed in), so tests
// cover that path too.
void test_signal_point(std::string_view point);

}  // namespace moefq
