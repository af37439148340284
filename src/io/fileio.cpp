#include "moefq/fileio.h"

#include <fcntl.h>
#include <linux/stat.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>

#include "moefq/errors.h"
#include "moefq/host_memory.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// The registry of live temporaries, read by the signal handler: fixed storage, no allocation, a
// slot's path complete before it is marked live.

constexpr int kMaxTemps = 64;
enum SlotState : int { kFree, kClaimed, kLive };
struct TempSlot {
  std::atomic<int> state{kFree};
  bool is_dir = false;
  char path[PATH_MAX] = {};
};
TempSlot g_temps[kMaxTemps];

// The slot, or -1 when every slot is taken or the path is too long: that temporary is still
// removed by its owner, only not by a signal.
int register_temp(const std::string& path, bool is_dir) {
  if (path.size() >= PATH_MAX) return -1;
  for (int i = 0; i < kMaxTemps; ++i) {
    int expected = kFree;
    if (!g_temps[i].state.compare_exchange_strong(expected, kClaimed)) continue;
    std::memcpy(g_temps[i].path, path.c_str(), path.size() + 1);
    g_temps[i].is_dir = is_dir;
    g_temps[i].state.store(kLive, std::memory_order_release);
    return i;
  }
  return -1;
}

void unregister_temp(int slot) {
  if (slot >= 0) g_temps[slot].state.store(kFree, std::memory_order_release);
}

// Only async-signal-safe calls: unlink, rmdir, signal, raise. Files first, then directories.
extern "C" void remove_temps_and_reraise(int sig) {
  const int saved_errno = errno;
  for (bool dirs : {false, true})
    for (TempSlot& s : g_temps)
      if (s.state.load(std::memory_order_acquire) == kLive && s.is_dir == dirs) {
        if (dirs) ::rmdir(s.path);
        else ::unlink(s.path);
      }
  // The signal is blocked while its handler runs: raised again, it ends the process with its
  // default action as soon as the handler returns.
  ::signal(sig, SIG_DFL);
  ::raise(sig);
  errno = saved_errno;
}

extern "C" void ignore_signal(int) {}

// ---------------------------------------------------------------------------------------------

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISREG(mode)) return "a regular file";
  return "a file of unknown kind";
}

std::string error_text(int err) { return std::strerror(err); }

// "what path" for messages, or just what when it already holds the path.
std::string named(std::string_view what, const std::string& path) {
  return std::string(what) + " " + path;
}

// What a failed write or sync means for the user: a full disk or a file size limit is named as such.
std::string write_error_text(int err) {
  if (err == ENOSPC || err == EDQUOT) return error_text(err) + " (the file system is full; nothing was written)";
  if (err == EFBIG)
    return error_text(err) + " (over the file size limit, such as `ulimit -f`, or the file system's; nothing was "
           "written)";
  return error_text(err);
}

void write_all(int fd, const void* data, size_t size, const std::string& what) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    MOEFQ_CHECK(n > 0, what, ": write failed: ", n < 0 ? write_error_text(errno) : "wrote nothing");
    p += n;
    size -= static_cast<size_t>(n);
  }
}

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // durability only: the publication itself does not depend on it
  ::fsync(fd);
  ::close(fd);
}

// "dir/" and "dir//" name "dir"; "/" stays.
std::string without_trailing_slashes(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

std::string parent_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// The template of a temporary beside `path`: its name followed by `suffix` (".tmp.XXXXXX"), the
// name cut short where needed so that the temporary's name fits the directory's limit (NAME_MAX):
// any name legal for the target is legal for its temporary.
std::string temp_template(const std::string& path, std::string_view suffix = ".tmp.XXXXXX") {
  const std::string dir = parent_of(path);
  long name_max = ::pathconf(dir.c_str(), _PC_NAME_MAX);
  if (name_max <= 0) name_max = NAME_MAX;
  std::string base = fs::path(path).filename().string();
  const size_t keep = size_t(name_max) > suffix.size() ? size_t(name_max) - suffix.size() : 1;
  if (base.size() > keep) base.resize(keep);
  const std::string prefix = fs::path(path).has_parent_path() ? fs::path(path).parent_path().string() + "/" : "";
  return prefix + base + std::string(suffix);
}

// Whether the entry at `path` (not followed) is the root of a mount: a mount point, or a file or
// directory bind-mounted there. Such a target cannot be replaced by a rename (EBUSY).
bool is_mount_root(const std::string& path) {
  struct statx sx {};
  if (::statx(AT_FDCWD, path.c_str(), AT_SYMLINK_NOFOLLOW, STATX_BASIC_STATS, &sx) == 0 &&
      (sx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT) != 0)
    return (sx.stx_attributes & STATX_ATTR_MOUNT_ROOT) != 0;
  // Kernels before 5.8: another file system than its directory's.
  struct stat st {}, ps {};
  return ::lstat(path.c_str(), &st) == 0 && ::stat(parent_of(path).c_str(), &ps) == 0 && st.st_dev != ps.st_dev;
}

void check_not_mount_root(const std::string& path, const std::string& w) {
  MOEFQ_CHECK(!is_mount_root(path), w, ": is a mount point (something is mounted there), which cannot be "
              "replaced; give another name");
}

// Creates a file (mode 0666, opened for writing) or a directory (mode 0777) named `tmpl` with its
// trailing XXXXXX replaced by random letters, and returns the file's descriptor (0 for a
// directory) or -1 with errno set. Unlike mkstemp (0600) and mkdtemp (0700), the umask and a
// default ACL of the directory apply, as to any file the user creates: an output gets the
// permissions the user asked for without moefq reading the process-wide umask.
int create_unique(std::string& tmpl, bool dir) {
  static constexpr char kLetters[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  constexpr size_t kSuffix = 6;
  if (tmpl.size() < kSuffix || tmpl.compare(tmpl.size() - kSuffix, kSuffix, "XXXXXX") != 0) {
    errno = EINVAL;
    return -1;
  }
  static thread_local std::mt19937_64 rng{std::random_device{}() ^ (uint64_t(::getpid()) << 32)};
  for (int attempt = 0; attempt < 1000; ++attempt) {
    for (size_t i = tmpl.size() - kSuffix; i < tmpl.size(); ++i) tmpl[i] = kLetters[rng() % (sizeof kLetters - 1)];
    const int rc = dir ? ::mkdir(tmpl.c_str(), 0777)
                       : ::open(tmpl.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (rc >= 0) return rc;
    if (errno != EEXIST) return -1;
  }
  errno = EEXIST;
  return -1;
}

// Creating (then removing) a temporary file or directory from `tmpl` (ending in XXXXXX) is the
// test of whether outputs can be written there: access(2) says yes to root on a read-only or
// immutable directory, and knows nothing of name lengths or full disks.
void probe_writable(std::string tmpl, bool dir, const std::string& what, const std::string& where) {
  if (dir) {
    MOEFQ_CHECK(::mkdtemp(tmpl.data()) != nullptr, what, ": cannot create a directory in ", where, ": ",
                error_text(errno));
    ::rmdir(tmpl.c_str());
  } else {
    const int fd = ::mkostemp(tmpl.data(), O_CLOEXEC);
    MOEFQ_CHECK(fd >= 0, what, ": cannot create a file in ", where, ": ", error_text(errno));
    ::close(fd);
    ::unlink(tmpl.c_str());
  }
}

bool is_allowed_name(std::span<const std::string_view> names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// The entries of an existing directory that are not regular files named in `names` (at most 4,
// for the message), or empty when it holds only earlier outputs.
std::vector<std::string> foreign_entries(const std::string& dir, std::span<const std::string_view> names) {
  std::vector<std::string> foreign;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!is_allowed_name(names, name) || !it->is_regular_file(ec) || it->is_symlink(ec)) foreign.push_back(name);
    if (foreign.size() >= 4) break;
  }
  MOEFQ_CHECK(!ec, dir, ": cannot list the directory: ", ec.message());
  return foreign;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

bool no_renameat2_for_tests() { return std::getenv("MOEFQ_TEST_NO_RENAMEAT2") != nullptr; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Inputs

InputFile InputFile::open(const std::string& path, std::string_view what_view) {
  const std::string what(what_view);
  struct stat st {};
  // stat before open: opening a FIFO blocks until a writer comes, and opening a device can act.
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    MOEFQ_CHECK(err != ENOENT, what, ": no such file");
    MOEFQ_FAIL(ErrorKind::kBadInput, what, ": cannot open: ", error_text(err));
  }
  MOEFQ_CHECK(S_ISREG(st.st_mode), what, ": is ", kind_of(st.st_mode), ", not a regular file");
  // Non-blocking, in case the path was replaced by a FIFO since the stat; fstat decides.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  MOEFQ_CHECK(fd >= 0, what, ": cannot open: ", error_text(errno));
  InputFile f;
  f.fd_ = fd;
  f.what_ = what;
  MOEFQ_CHECK(::fstat(fd, &st) == 0, what, ": cannot stat: ", error_text(errno));
  MOEFQ_CHECK(S_ISREG(st.st_mode), what, ": is ", kind_of(st.st_mode), ", not a regular file");
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  f.size_ = static_cast<uint64_t>(st.st_size);
  return f;
}

InputFile::InputFile(InputFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), size_(other.size_), what_(std::move(other.what_)) {}

InputFile& InputFile::operator=(InputFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
    what_ = std::move(other.what_);
  }
  return *this;
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InputFile::read_at(uint64_t offset, std::span<uint8_t> dst) const {
  size_t done = 0;
  while (done < dst.size()) {
    const ssize_t n = ::pread(fd_, dst.data() + done, dst.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    MOEFQ_CHECK(n >= 0, what_, ": read failed at byte ", offset + done, ": ", error_text(errno));
    MOEFQ_CHECK(n > 0, what_, ": the file ends at byte ", offset + done, " but had ", size_,
                " bytes when it was opened: it was truncated while being read");
    done += static_cast<size_t>(n);
  }
}

std::string read_regular_file(const std::string& path, size_t max_bytes, std::string_view what) {
  const InputFile f = InputFile::open(path, what);
  MOEFQ_CHECK(f.size() <= max_bytes, what, ": the file is ", format_bytes(f.size()), ", over the limit of ",
              format_bytes(max_bytes), " for this kind of file");
  std::string text(f.size(), '\0');
  f.read_at(0, {reinterpret_cast<uint8_t*>(text.data()), text.size()});
  return text;
}

void check_json_text(std::string_view text, std::string_view what, int max_depth) {
  // What a DOM (nlohmann::json) costs, roughly: every value 16 bytes in its parent's array (twice
  // that while the array grows), a container's own allocation, an object member's map node and key.
  constexpr uint64_t kValue = 32, kContainer = 64, kMember = 96;
  int depth = 0;
  uint64_t values = 1, containers = 0, members = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    switch (c) {
      case '"': in_string = true; break;
      case '[':
      case '{':
        MOEFQ_CHECK(++depth <= max_depth, what, ": nests deeper than ", max_depth, " levels (at byte ", i,
                    "); this kind of file is far shallower");
        ++containers;
        break;
      case ']':
      case '}': --depth; break;
      case ',': ++values; break;
      case ':': ++members; break;
      default: break;
    }
  }
  const uint64_t need = values * kValue + containers * kContainer + members * kMember;
  const uint64_t budget = std::max<uint64_t>(16 * uint64_t(text.size()), uint64_t{1} << 20);
  MOEFQ_CHECK(need <= budget, what, ": ", values, " JSON values in ", format_bytes(text.size()),
              " would take about ", format_bytes(need), " to read, more than 16 times the file's size; this "
              "kind of file holds far fewer, larger values");
}

// ---------------------------------------------------------------------------------------------
// Outputs

void check_output_path(const std::string& path, std::string_view what, std::span<const NamedPath> inputs) {
  MOEFQ_CHECK(!path.empty(), what, ": empty path; give a file name");
  const std::string w = named(what, path);
  MOEFQ_CHECK(path.back() != '/', w, ": ends with '/'; give a file name");
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    MOEFQ_CHECK(!S_ISLNK(st.st_mode), w, ": is a symbolic link; outputs never replace a link (give the path it "
                "points to, or another name)");
    MOEFQ_CHECK(!S_ISDIR(st.st_mode), w, ": is a directory; give a file name");
    MOEFQ_CHECK(S_ISREG(st.st_mode), w, ": is ", kind_of(st.st_mode), "; outputs are written to regular files only");
    check_not_mount_root(path, w);
    for (const auto& [input_what, input_path] : inputs) {
      struct stat in {};
      MOEFQ_CHECK(input_path.empty() || ::stat(input_path.c_str(), &in) != 0 || in.st_dev != st.st_dev ||
                      in.st_ino != st.st_ino,
                  w, ": is the same file as ", input_what, " ", input_path, "; write the output to another file");
    }
  } else {
    const int err = errno;
    // ENOTDIR: a parent is a file, which the check of the directory below names.
    MOEFQ_CHECK(err == ENOENT || err == ENOTDIR, w, ": cannot be written: ", error_text(err));
  }
  const std::string dir = parent_of(path);
  struct stat ds {};
  if (::stat(dir.c_str(), &ds) != 0) MOEFQ_FAIL(ErrorKind::kBadInput, w, ": the directory ", dir, " does not exist");
  MOEFQ_CHECK(S_ISDIR(ds.st_mode), w, ": ", dir, " is not a directory");
  probe_writable(temp_template(path), false, w, "the directory " + dir);
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  // Same directory as the target, so the final rename stays within one file system.
  MOEFQ_CHECK(!path_.empty(), "an output file has an empty path; give a file name");
  MOEFQ_CHECK(path_.back() != '/', path_, ": ends with '/'; give a file name");
  struct stat st {};
  MOEFQ_CHECK(::stat(path_.c_str(), &st) != 0 || !S_ISDIR(st.st_mode), path_, ": is a directory; give a file name");
  std::string tmpl = temp_template(path_);
  fd_ = create_unique(tmpl, false);
  MOEFQ_CHECK(fd_ >= 0, path_, ": cannot write: cannot create a temporary file in ", parent_of(path_), ": ",
              error_text(errno));
  tmp_path_ = tmpl;
  slot_ = register_temp(tmp_path_, false);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_path_.c_str());
  unregister_temp(slot_);
}

void AtomicFile::write(const void* data, size_t size) {
  write_all(fd_, data, size, tmp_path_);
  if (!written_) {
    written_ = true;
    test_signal_point("atomic-file-write");
  }
}

void AtomicFile::commit() {
  finish();
  publish();
}

void AtomicFile::finish() {
  if (fd_ < 0) return;
  MOEFQ_CHECK(::fsync(fd_) == 0, tmp_path_, ": fsync failed: ", write_error_text(errno));
  // The target was checked before the work began; something else may have been put there since.
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0) {
    MOEFQ_CHECK(S_ISREG(st.st_mode), path_, ": is now ", kind_of(st.st_mode),
                "; outputs never replace anything but a regular file (nothing was written)");
    // A replaced file keeps its permissions (a new one has 0666 less the umask from its creation).
    MOEFQ_CHECK(::fchmod(fd_, st.st_mode & 0777) == 0, tmp_path_, ": chmod failed: ", error_text(errno));
  }
  const int close_rc = ::close(fd_);
  fd_ = -1;
  MOEFQ_CHECK(close_rc == 0, tmp_path_, ": close failed: ", write_error_text(errno));
}

void AtomicFile::publish() {
  MOEFQ_ASSERT(fd_ < 0 && !committed_, path_, ": publish() before finish() or twice");
  struct stat st {};
  MOEFQ_CHECK(::lstat(path_.c_str(), &st) != 0 || S_ISREG(st.st_mode), path_, ": is now ", kind_of(st.st_mode),
              "; outputs never replace anything but a regular file (nothing was written)");
  MOEFQ_CHECK(::rename(tmp_path_.c_str(), path_.c_str()) == 0, path_, ": cannot rename ", tmp_path_,
              " into place: ", error_text(errno));
  committed_ = true;
  unregister_temp(std::exchange(slot_, -1));
}

void write_file_atomic(const std::string& path, std::string_view content) {
  AtomicFile f(path);
  f.write(content.data(), content.size());
  f.commit();
}

// ---------------------------------------------------------------------------------------------
// Directories of outputs

void check_output_dir(const std::string& path_in, std::string_view what, std::span<const std::string_view> names,
                      std::span<const NamedPath> inputs) {
  MOEFQ_CHECK(!path_in.empty(), what, ": empty path; give a directory name");
  const std::string path = without_trailing_slashes(path_in), w = named(what, path_in);
  const std::string base = fs::path(path).filename().string();
  MOEFQ_CHECK(base != "." && base != ".." && path != "/", w, ": give the directory by its name (it is ",
              "replaced as a whole when the reports are published)");
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    MOEFQ_CHECK(!S_ISLNK(st.st_mode), w, ": is a symbolic link; outputs never replace a link (give the path it "
                "points to, or another name)");
    MOEFQ_CHECK(S_ISDIR(st.st_mode), w, ": exists and is ", kind_of(st.st_mode), ", not a directory");
    struct stat cwd {};
    MOEFQ_CHECK(::stat(".", &cwd) != 0 || cwd.st_dev != st.st_dev || cwd.st_ino != st.st_ino, w,
                ": is the working directory; give another directory (it is replaced as a whole)");
    check_not_mount_root(path, w);
    const std::vector<std::string> foreign = foreign_entries(path, names);
    MOEFQ_CHECK(foreign.empty(), w, ": holds other entries (", join(foreign), foreign.size() >= 4 ? ", ..." : "",
                "); the directory is replaced as a whole, so give a new or empty directory, or one that holds "
                "only earlier reports");
    // Its files are removed when it is replaced: none may be an input of this run.
    for (const std::string_view name : names) {
      struct stat out {};
      const std::string file = path + "/" + std::string(name);
      if (::stat(file.c_str(), &out) != 0) continue;
      for (const auto& [input_what, input_path] : inputs) {
        struct stat in {};
        MOEFQ_CHECK(input_path.empty() || ::stat(input_path.c_str(), &in) != 0 || in.st_dev != out.st_dev ||
                        in.st_ino != out.st_ino,
                    w, ": its ", name, " is ", input_what, " ", input_path,
                    "; the directory is replaced as a whole, so give another directory");
      }
    }
    probe_writable(temp_template(path), true, w, parent_of(path));
    return;
  }
  const int err = errno;
  MOEFQ_CHECK(err == ENOENT || err == ENOTDIR, w, ": cannot be written: ", error_text(err));
  // Absent: its nearest existing ancestor must be a directory where directories can be created.
  fs::path a = fs::path(path).parent_path();
  std::error_code ec;
  while (!a.empty() && !fs::exists(fs::symlink_status(a, ec)) && a != a.root_path()) a = a.parent_path();
  const std::string ancestor = a.empty() ? std::string(".") : a.string();
  MOEFQ_CHECK(fs::is_directory(ancestor, ec), w, ": ", ancestor, " is not a directory");
  probe_writable((fs::path(ancestor) / ".moefq-probe.XXXXXX").string(), true, w, ancestor);
}

AtomicDirectory::AtomicDirectory(std::string path, std::span<const std::string_view> names)
    : path_(without_trailing_slashes(std::move(path))) {
  for (std::string_view n : names) names_.emplace_back(n);
  const fs::path parent = fs::path(path_).parent_path();
  std::error_code ec;
  if (!parent.empty()) fs::create_directories(parent, ec);
  MOEFQ_CHECK(!ec, path_, ": cannot create the directory ", parent.string(), ": ", ec.message());
  std::string tmpl = temp_template(path_);
  MOEFQ_CHECK(create_unique(tmpl, true) >= 0, path_, ": cannot create a temporary directory in ",
              parent_of(path_), ": ", error_text(errno));
  tmp_path_ = tmpl;
  slots_.push_back(register_temp(tmp_path_, true));
}

AtomicDirectory::~AtomicDirectory() { remove_temporary(); }

void AtomicDirectory::remove_temporary() {
  if (tmp_path_.empty()) return;
  for (const std::string& n : names_) ::unlink((tmp_path_ + "/" + n).c_str());
  ::rmdir(tmp_path_.c_str());
  for (int s : slots_) unregister_temp(s);
  slots_.clear();
  tmp_path_.clear();
}

void AtomicDirectory::write(std::string_view name, std::string_view content) {
  MOEFQ_ASSERT(std::find(names_.begin(), names_.end(), name) != names_.end(), "AtomicDirectory: ", name,
               " is not one of its files");
  const std::string p = tmp_path_ + "/" + std::string(name);
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);  // less the umask
  MOEFQ_CHECK(fd >= 0, p, ": cannot create: ", error_text(errno));
  slots_.push_back(register_temp(p, false));
  try {
    write_all(fd, content.data(), content.size(), p);
    MOEFQ_CHECK(::fsync(fd) == 0, p, ": fsync failed: ", error_text(errno));
  } catch (...) {
    ::close(fd);
    throw;
  }
  MOEFQ_CHECK(::close(fd) == 0, p, ": close failed: ", error_text(errno));
}

void AtomicDirectory::commit() {
  fsync_directory(tmp_path_);
  test_signal_point("atomic-dir-written");
  const std::string& tmp = tmp_path_;
  // The published directory may only replace one of earlier outputs; check again at the moment
  // of replacing, as something may have been put there since check_output_dir.
  const auto check_replaceable = [&] {
    struct stat st {};
    if (::lstat(path_.c_str(), &st) != 0) return;
    MOEFQ_CHECK(S_ISDIR(st.st_mode), path_, ": is now ", kind_of(st.st_mode), "; nothing was written");
    std::vector<std::string_view> names(names_.begin(), names_.end());
    const std::vector<std::string> foreign = foreign_entries(path_, names);
    MOEFQ_CHECK(foreign.empty(), path_, ": now holds other entries (", join(foreign), "); nothing was written");
    // The directory that replaces an earlier one keeps its permissions (a new one has 0777 less the
    // umask from its creation).
    MOEFQ_CHECK(::chmod(tmp.c_str(), st.st_mode & 0777) == 0, tmp, ": chmod failed: ", error_text(errno));
  };
  bool published = false;
  if (!no_renameat2_for_tests()) {
    for (int attempt = 0; attempt < 16 && !published; ++attempt) {
      if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, path_.c_str(), RENAME_NOREPLACE) == 0) {
        // Nothing was there: the temporary name is free now.
        for (int s : slots_) unregister_temp(s);
        slots_.clear();
        tmp_path_.clear();
        published = true;
        break;
      }
      int err = errno;
      if (err == EINVAL || err == ENOSYS) break;  // the file system has no renameat2 flags
      MOEFQ_CHECK(err == EEXIST || err == ENOTEMPTY, path_, ": cannot publish ", tmp, ": ", error_text(err));
      check_replaceable();
      if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, path_.c_str(), RENAME_EXCHANGE) == 0) {
        published = true;  // the earlier files are now in the temporary directory
        break;
      }
      err = errno;
      if (err == EINVAL || err == ENOSYS) break;
      MOEFQ_CHECK(err == ENOENT, path_, ": cannot publish ", tmp, ": ", error_text(err));
      // Removed since the first rename failed: try again.
    }
  }
  if (!published) {
    // Without renameat2's flags: move the earlier directory aside, then rename the new one into
    // place. Between the two renames the target is absent (no files rather than mixed ones).
    for (int attempt = 0; attempt < 16 && !published; ++attempt) {
      check_replaceable();
      std::string aside = temp_template(path_, ".old.XXXXXX");
      MOEFQ_CHECK(::mkdtemp(aside.data()) != nullptr, path_, ": cannot create a temporary directory: ",
                  error_text(errno));
      // rename(2) replaces the empty directory `aside`.
      const bool moved = ::rename(path_.c_str(), aside.c_str()) == 0;
      const int err = errno;
      if (!moved) ::rmdir(aside.c_str());
      MOEFQ_CHECK(moved || err == ENOENT, path_, ": cannot move the earlier directory aside: ", error_text(err));
      const int aside_slot = moved ? register_temp(aside, true) : -1;
      std::vector<int> aside_files;
      if (moved)
        for (const std::string& n : names_) aside_files.push_back(register_temp(aside + "/" + n, false));
      const bool renamed = ::rename(tmp.c_str(), path_.c_str()) == 0;
      const int rename_err = errno;
      if (moved) {
        for (const std::string& n : names_) ::unlink((aside + "/" + n).c_str());
        ::rmdir(aside.c_str());
        for (int s : aside_files) unregister_temp(s);
        unregister_temp(aside_slot);
      }
      if (renamed) {
        for (int s : slots_) unregister_temp(s);
        slots_.clear();
        tmp_path_.clear();
        published = true;
        break;
      }
      // Another run published between the two renames: move theirs aside in turn.
      MOEFQ_CHECK(rename_err == EEXIST || rename_err == ENOTEMPTY, path_, ": cannot publish ", tmp, ": ",
                  error_text(rename_err));
    }
  }
  MOEFQ_CHECK(published, path_, ": cannot publish ", tmp, ": other runs kept replacing the directory");
  fsync_directory(parent_of(path_));
  test_signal_point("atomic-dir-published");
  remove_temporary();  // after an exchange: the earlier files
}

// ---------------------------------------------------------------------------------------------

std::string filesystem_error_message(const std::filesystem::filesystem_error& e) {
  std::string m = e.path1().empty() ? std::string("a path") : e.path1().string();
  if (!e.path2().empty()) m += " (and " + e.path2().string() + ")";
  return m + ": " + e.code().message();
}

std::string terminal_safe(std::string_view s, bool keep_newlines) {
  std::string out;
  out.reserve(s.size());
  char buf[16];
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += char(c);
      ++i;
      continue;
    }
    if (c < 0x80) {  // C0 controls and DEL
      if (keep_newlines && (c == '\n' || c == '\t')) out += char(c);
      else if (c == '\n') out += "\\n";
      else if (c == '\t') out += "\\t";
      else if (c == '\r') out += "\\r";
      else {
        std::snprintf(buf, sizeof buf, "\\x%02x", c);
        out += buf;
      }
      ++i;
      continue;
    }
    // A UTF-8 sequence: its length from the lead byte, then continuation bytes.
    const size_t len = c >= 0xf0 && c < 0xf5 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c < 0xe0 ? 2 : 0;
    bool valid = len > 0 && i + len <= s.size();
    for (size_t k = 1; valid && k < len; ++k) valid = (static_cast<unsigned char>(s[i + k]) & 0xc0) == 0x80;
    if (!valid) {
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
      ++i;
      continue;
    }
    if (len == 2 && c == 0xc2 && static_cast<unsigned char>(s[i + 1]) < 0xa0) {  // C1 controls, U+0080-U+009F
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(s[i + 1]));
      out += buf;
    } else {
      out.append(s.substr(i, len));
    }
    i += len;
  }
  return out;
}

void install_cleanup_signal_handlers() {
  constexpr int kCleanup[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, SIGVTALRM, SIGPROF};
  for (int sig : kCleanup) {
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) != 0 || old.sa_handler != SIG_DFL) continue;
    struct sigaction sa {};
    sa.sa_handler = remove_temps_and_reraise;
    sigemptyset(&sa.sa_mask);
    for (int other : kCleanup) sigaddset(&sa.sa_mask, other);
    ::sigaction(sig, &sa, nullptr);
  }
  // A handler that does nothing rather than SIG_IGN: an ignored signal stays ignored in the
  // programs `moefq launch` starts, a handled one is reset to its default by exec.
  // SIGXFSZ likewise: over a file size limit (`ulimit -f`) a write then fails with EFBIG, which
  // ends the command like a full disk (a message, nothing published, the temporaries removed).
  for (int sig : {SIGPIPE, SIGXFSZ}) {
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) != 0 || old.sa_handler != SIG_DFL) continue;
    struct sigaction sa {};
    sa.sa_handler = ignore_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    ::sigaction(sig, &sa, nullptr);
  }
}

void finish_stdout() {
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  if (flushed && !std::ferror(stdout)) return;
  // A pipe or socket whose reader has gone reports POLLERR to its writer: the reader closed it
  // early (`| head`), having taken what it wanted.
  pollfd p{STDOUT_FILENO, POLLOUT, 0};
  if (::poll(&p, 1, 0) == 1 && (p.revents & POLLERR) != 0) return;
  MOEFQ_FAIL(ErrorKind::kBadInput, "stdout: the results could not be written in full (",
             flushed ? std::string("a write failed") : error_text(err), "); the output files were written first");
}

void test_signal_point(std::string_view point) {
  static const char* const spec = std::getenv("MOEFQ_TEST_RAISE");
  if (spec == nullptr) return;
  const std::string_view s(spec);
  const size_t colon = s.rfind(':');
  if (colon == std::string_view::npos || s.substr(0, colon) != point) return;
  const int sig = std::atoi(spec + colon + 1);
  if (sig > 0) ::raise(sig);
}

}  // namespace moefq
