#include "dist/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string_view>

#include "moefq/errors.h"

extern char** environ;

namespace moefq::dist {
namespace {

using Clock = std::chrono::steady_clock;

// Longer than any job; keeps the conversion to Clock::duration far from overflow.
constexpr double kMaxSeconds = 1e8;
// A line longer than this is forwarded in pieces of this size (each with the prefix), so a child
// that never writes a newline cannot make the launcher buffer without bound.
constexpr size_t kMaxLine = 1 << 16;

// The variables the launcher sets for each rank; values inherited under these names are dropped.
constexpr const char* kRankVariables[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MOEFQ_RENDEZVOUS"};

// A TCP port of 127.0.0.1 that nothing uses now (the kernel picks it); a torch rank 0 binds its
// TCPStore there moments later, as torchrun's own choice of a free port does.
int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) MOEFQ_FAIL(ErrorKind::kFailedCheck, "launch: socket: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) MOEFQ_FAIL(ErrorKind::kFailedCheck, "launch: cannot find a free TCP port for MASTER_PORT: ", std::strerror(err));
  return ntohs(addr.sin_port);
}

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

// How a process ended, from its wait status: "exited with code 3", "was killed by signal SIGKILL".
std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  return "was killed by signal " + signal_name(WTERMSIG(status)) + (WCOREDUMP(status) ? " (core dumped)" : "");
}

// The shell's convention: the exit code, or 128 + the signal number.
int exit_status_of(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

Clock::duration to_duration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// All of text, retrying short writes; false when it cannot be written (EPIPE: the reader is gone,
// SIGPIPE being ignored).
bool write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {  // an inherited non-blocking stdout
      pollfd writable{fd, POLLOUT, 0};
      ::poll(&writable, 1, -1);
      continue;
    }
    if (n <= 0) return false;
    text.remove_prefix(size_t(n));
  }
  return true;
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// One of a rank's output streams: the read end of its pipe and the text after the last newline.
struct Stream {
  int fd = -1;      // non-blocking; -1 once at end of file
  int out_fd = -1;  // the launcher's stdout or stderr
  std::string partial;
};

struct Rank {
  pid_t pid = -1;  // also its process group id
  bool running = false;
  std::string prefix;  // "[rank r] "
  Stream streams[2];   // stdout, stderr
};

class Job {
 public:
  explicit Job(const LaunchOptions& options) : options_(options) {}
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  // Undoes what run() did, also when it threw half way: kills (SIGKILL) and reaps every rank still
  // running, restores the signal state and the open-file limit, removes the rendezvous directory.
  ~Job();

  // Sets up, starts every rank, supervises them to the end; returns launch()'s exit status.
  int run();

 private:
  void set_up();
  void start_rank(int rank_idx, const std::vector<std::string>& base_env);
  void read_stream(Rank& rank, Stream& s, bool until_empty);
  void emit_lines(Rank& rank, Stream& s, bool flush_partial);
  void reap_exited();
  void handle_signals();
  // Stops the job: the first reason sets the exit status; sig goes to every rank's process group.
  void stop(const std::string& why, int exit_status, int sig);
  void signal_all(int sig);
  int num_running() const;
  bool groups_alive() const;

  const LaunchOptions& options_;
  std::string rendezvous_;
  std::vector<Rank> ranks_;
  int signal_fd_ = -1;
  sigset_t old_mask_;
  struct sigaction old_sigpipe_, old_sigchld_;
  struct rlimit old_nofile_;
  int old_subreaper_ = 0;
  bool signals_set_ = false, nofile_raised_ = false, subreaper_set_ = false;

  // The launcher's stdout or stderr when writing to it failed (a closed pipe): the job is stopped,
  // as a program writing there itself would get SIGPIPE.
  const char* output_lost_ = nullptr;
  int output_errno_ = 0;
  bool stopping_ = false, killed_ = false;
  int exit_status_ = 0;
  Clock::time_point job_deadline_, kill_deadline_;
};

void Job::set_up() {
  // A child's dup2 onto fd 1 or 2 must not meet one of our pipes there: keep 0-2 open.
  for (int fd = 0; fd <= 2; ++fd)
    if (::fcntl(fd, F_GETFD) < 0) ::open("/dev/null", O_RDWR);

  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/moefq_launch_XXXXXX";
  MOEFQ_CHECK(::mkdtemp(tmpl.data()) != nullptr, "launch: cannot create the rendezvous directory ", tmpl, ": ",
              std::strerror(errno), " (set TMPDIR to a writable directory)");
  rendezvous_ = tmpl;

  // Two pipes per rank, the exec-error pipe of the rank being started, the signalfd, some slack.
  const rlim_t needed = rlim_t(2 * options_.num_ranks + 32);
  if (::getrlimit(RLIMIT_NOFILE, &old_nofile_) != 0)
    MOEFQ_FAIL(ErrorKind::kFailedCheck, "launch: getrlimit: ", std::strerror(errno));
  if (old_nofile_.rlim_cur != RLIM_INFINITY && old_nofile_.rlim_cur < needed) {
    MOEFQ_CHECK(old_nofile_.rlim_max == RLIM_INFINITY || old_nofile_.rlim_max >= needed, "launch: -n ",
                options_.num_ranks, " needs ", needed, " open files but the hard limit (ulimit -Hn) is ",
                old_nofile_.rlim_max);
    struct rlimit raised = old_nofile_;
    raised.rlim_cur = needed;
    if (::setrlimit(RLIMIT_NOFILE, &raised) != 0)
      MOEFQ_FAIL(ErrorKind::kFailedCheck, "launch: setrlimit: ", std::strerror(errno));
    nofile_raised_ = true;
  }

  // Signals arrive through a signalfd polled with the pipes. SIGINT or SIGTERM ignored when the
  // launcher started (a background job of a shell script) stays ignored, for the ranks too.
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGCHLD);
  for (int sig : {SIGINT, SIGTERM}) {
    struct sigaction current;
    if (::sigaction(sig, nullptr, &current) == 0 && current.sa_handler != SIG_IGN) sigaddset(&mask, sig);
  }
  struct sigaction dfl = {}, ign = {};
  dfl.sa_handler = SIG_DFL;
  ign.sa_handler = SIG_IGN;
  // An inherited SIGCHLD = SIG_IGN would reap the ranks before we see how they ended.
  ::sigaction(SIGCHLD, &dfl, &old_sigchld_);
  ::sigaction(SIGPIPE, &ign, &old_sigpipe_);
  ::sigprocmask(SIG_BLOCK, &mask, &old_mask_);
  signals_set_ = true;
  signal_fd_ = ::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (signal_fd_ < 0) MOEFQ_FAIL(ErrorKind::kFailedCheck, "launch: signalfd: ", std::strerror(errno));
  // Processes the ranks started and left behind become our children (not init's): we reap them, so
  // that a rank's process group is empty once they have all ended.
  ::prctl(PR_GET_CHILD_SUBREAPER, &old_subreaper_);
  subreaper_set_ = ::prctl(PR_SET_CHILD_SUBREAPER, 1) == 0;

  std::vector<std::string> base_env;
  for (char** e = environ; *e; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (std::find(std::begin(kRankVariables), std::end(kRankVariables), name) == std::end(kRankVariables))
      base_env.emplace_back(entry);
  }
  // torch.distributed's env:// initialisation: rank 0 on this host, on a port free now; values set
  // by the caller are kept (they may name another address or a port of their choice).
  const auto inherited = [&](std::string_view name) {
    return std::any_of(base_env.begin(), base_env.end(), [&](const std::string& e) {
      return e.size() > name.size() && e.compare(0, name.size(), name) == 0 && e[name.size()] == '=';
    });
  };
  if (!inherited("MASTER_ADDR")) base_env.emplace_back("MASTER_ADDR=127.0.0.1");
  if (!inherited("MASTER_PORT")) base_env.emplace_back("MASTER_PORT=" + std::to_string(free_tcp_port()));
  ranks_.resize(size_t(options_.num_ranks));
  for (int r = 0; r < options_.num_ranks; ++r) start_rank(r, base_env);
}

Job::~Job() {
  for (Rank& rank : ranks_) {
    if (rank.running) {
      ::kill(-rank.pid, SIGKILL);
      ::waitpid(rank.pid, nullptr, 0);
    }
    for (Stream& s : rank.streams) close_fd(s.fd);
  }
  if (signal_fd_ >= 0) {
    // Signals taken after the last poll would kill us once unblocked; they were meant for the job.
    signalfd_siginfo info;
    while (::read(signal_fd_, &info, sizeof info) == ssize_t(sizeof info)) {
    }
    close_fd(signal_fd_);
  }
  if (signals_set_) {
    ::sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
    ::sigaction(SIGPIPE, &old_sigpipe_, nullptr);
    ::sigaction(SIGCHLD, &old_sigchld_, nullptr);
  }
  if (nofile_raised_) ::setrlimit(RLIMIT_NOFILE, &old_nofile_);
  if (subreaper_set_) ::prctl(PR_SET_CHILD_SUBREAPER, old_subreaper_);
  std::error_code ec;
  if (!rendezvous_.empty()) std::filesystem::remove_all(rendezvous_, ec);
}

void Job::start_rank(int rank_idx, const std::vector<std::string>& base_env) {
  Rank& rank = ranks_[size_t(rank_idx)];
  rank.prefix = "[rank " + std::to_string(rank_idx) + "] ";

  std::vector<std::string> env = base_env;
  env.push_back("RANK=" + std::to_string(rank_idx));
  env.push_back("WORLD_SIZE=" + std::to_string(options_.num_ranks));
  env.push_back("LOCAL_RANK=" + std::to_string(rank_idx));
  env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(options_.num_ranks));
  env.push_back("MOEFQ_RENDEZVOUS=" + rendezvous_);
  std::vector<char*> envp, argv;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  for (const std::string& a : options_.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  // [0] read end, [1] write end. The exec-error pipe is close-on-exec: end of file without data
  // means the exec succeeded, otherwise the child wrote its errno.
  int out[2] = {-1, -1}, err[2] = {-1, -1}, exec_error[2] = {-1, -1};
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0 || ::pipe2(exec_error, O_CLOEXEC) != 0) {
    const int pipe_errno = errno;
    for (int fd : {out[0], out[1], err[0], err[1], exec_error[0], exec_error[1]})
      if (fd >= 0) ::close(fd);
    MOEFQ_FAIL(ErrorKind::kFailedCheck, "launch: cannot create pipes for rank ", rank_idx, ": ",
               std::strerror(pipe_errno));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Its own process group, so that stopping the rank reaches the processes it started too.
    ::setpgid(0, 0);
    // Dies with the launcher, even a launcher killed by SIGKILL.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    ::sigaction(SIGPIPE, &old_sigpipe_, nullptr);
    ::sigaction(SIGCHLD, &old_sigchld_, nullptr);
    ::sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
    if (nofile_raised_) ::setrlimit(RLIMIT_NOFILE, &old_nofile_);
    ::execvpe(argv[0], argv.data(), envp.data());
    const int exec_errno = errno;
    [[maybe_unused]] const ssize_t n = ::write(exec_error[1], &exec_errno, sizeof exec_errno);
    ::_exit(127);
  }
  const int fork_errno = errno;
  ::close(out[1]);
  ::close(err[1]);
  ::close(exec_error[1]);
  if (pid < 0) {
    ::close(out[0]);
    ::close(err[0]);
    ::close(exec_error[0]);
    MOEFQ_FAIL(ErrorKind::kFailedCheck, "launch: cannot start rank ", rank_idx, ": fork: ", std::strerror(fork_errno));
  }
  // Also here, so that no signal can reach the rank before its group exists. EACCES: it already
  // called exec, after its own setpgid.
  ::setpgid(pid, pid);
  rank.pid = pid;
  rank.running = true;
  rank.streams[0] = {out[0], STDOUT_FILENO, {}};
  rank.streams[1] = {err[0], STDERR_FILENO, {}};
  for (Stream& s : rank.streams) ::fcntl(s.fd, F_SETFL, O_NONBLOCK);

  int exec_errno = 0;
  ssize_t n;
  do n = ::read(exec_error[0], &exec_errno, sizeof exec_errno);
  while (n < 0 && errno == EINTR);
  ::close(exec_error[0]);
  if (n == ssize_t(sizeof exec_errno)) {
    ::waitpid(pid, nullptr, 0);
    rank.running = false;
    const std::string& program = options_.command[0];
    MOEFQ_FAIL(ErrorKind::kBadInput, "launch: cannot execute '", program, "': ", std::strerror(exec_errno),
               exec_errno == ENOENT && program.find('/') == std::string::npos ? " (not found in PATH)" : "");
  }
}

void Job::emit_lines(Rank& rank, Stream& s, bool flush_partial) {
  // Complete lines only, in one write, so lines of different ranks never mix.
  std::string text;
  size_t begin = 0;
  for (;;) {
    const size_t nl = s.partial.find('\n', begin), rest = s.partial.size() - begin;
    size_t len = 0;
    bool ends_in_newline = false;
    if (nl != std::string::npos && nl - begin <= kMaxLine) {
      len = nl - begin;
      ends_in_newline = true;
    } else if (rest >= kMaxLine) {
      len = kMaxLine;
    } else if (flush_partial && rest > 0) {
      len = rest;
    } else {
      break;
    }
    text += rank.prefix;
    text.append(s.partial, begin, len);
    text += '\n';
    begin += len + (ends_in_newline ? 1 : 0);
  }
  s.partial.erase(0, begin);
  if (!write_all(s.out_fd, text) && !output_lost_) {
    output_errno_ = errno;
    output_lost_ = s.out_fd == STDOUT_FILENO ? "stdout" : "stderr";
  }
}

void Job::read_stream(Rank& rank, Stream& s, bool until_empty) {
  char buf[1 << 16];
  while (s.fd >= 0) {
    const ssize_t n = ::read(s.fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) {  // end of file (or a read error, treated alike)
      emit_lines(rank, s, /*flush_partial=*/true);
      close_fd(s.fd);
      return;
    }
    s.partial.append(buf, size_t(n));
    emit_lines(rank, s, /*flush_partial=*/false);
    // One read per poll round keeps a chatty rank from starving the others.
    if (!until_empty) return;
  }
}

int Job::num_running() const {
  return int(std::count_if(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; }));
}

bool Job::groups_alive() const {
  for (const Rank& rank : ranks_)
    if (rank.pid > 0 && ::kill(-rank.pid, 0) == 0) return true;
  return false;
}

void Job::signal_all(int sig) {
  // Every rank's group, also of ranks already reaped: processes they started may still run. The
  // group id cannot be reused while a member lives.
  for (const Rank& rank : ranks_)
    if (rank.pid > 0) ::kill(-rank.pid, sig);
}

void Job::stop(const std::string& why, int exit_status, int sig) {
  const int running = num_running();
  std::string msg = "moefq launch: " + why;
  if (running > 0)
    msg += "; sending " + signal_name(sig) + " to the " + std::to_string(running) +
           (running == 1 ? " rank" : " ranks") + " still running" +
           (stopping_ ? "" : ", SIGKILL after " + seconds_text(options_.grace_s));
  std::fprintf(stderr, "%s\n", msg.c_str());
  if (!stopping_) {
    stopping_ = true;
    exit_status_ = exit_status;
    kill_deadline_ = Clock::now() + to_duration(options_.grace_s);
  }
  signal_all(sig);
}

void Job::reap_exited() {
  // The ranks, and the processes they left behind (we are their subreaper), which are not reported.
  for (;;) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    const auto it =
        std::find_if(ranks_.begin(), ranks_.end(), [pid](const Rank& r) { return r.running && r.pid == pid; });
    if (it == ranks_.end()) continue;
    const size_t r = size_t(it - ranks_.begin());
    Rank& rank = *it;
    rank.running = false;
    // Its last output before the news of its end.
    for (Stream& s : rank.streams) {
      read_stream(rank, s, /*until_empty=*/true);
      emit_lines(rank, s, /*flush_partial=*/true);
    }
    if (status != 0 && !stopping_)
      stop("rank " + std::to_string(r) + " " + describe_exit(status), exit_status_of(status), SIGTERM);
  }
}

void Job::handle_signals() {
  signalfd_siginfo info;
  bool child = false;
  while (::read(signal_fd_, &info, sizeof info) == ssize_t(sizeof info)) {
    const int sig = int(info.ssi_signo);
    if (sig == SIGCHLD) {
      child = true;
      continue;
    }
    // Forwarded as it is, so that ranks handling SIGINT (a Python KeyboardInterrupt) see SIGINT.
    stop("got " + signal_name(sig), 128 + sig, sig);
  }
  if (child) reap_exited();
}

int Job::run() {
  set_up();
  job_deadline_ = Clock::now() + (options_.timeout_s ? to_duration(*options_.timeout_s) : Clock::duration::zero());
  std::vector<pollfd> fds;
  std::vector<std::pair<Rank*, Stream*>> owners;
  // Once the job is stopped, processes the ranks started count too, until the grace ends.
  while (num_running() > 0 || (stopping_ && !killed_ && groups_alive())) {
    fds.assign(1, pollfd{signal_fd_, POLLIN, 0});
    owners.assign(1, {nullptr, nullptr});
    for (Rank& rank : ranks_)
      for (Stream& s : rank.streams)
        if (s.fd >= 0) {
          fds.push_back({s.fd, POLLIN, 0});
          owners.push_back({&rank, &s});
        }
    const Clock::time_point now = Clock::now();
    std::optional<Clock::time_point> wake;
    if (!stopping_ && options_.timeout_s) wake = job_deadline_;
    if (stopping_ && !killed_) wake = kill_deadline_;
    // Processes left behind by the ranks may end without a SIGCHLD to us (their parent lives on):
    // look again soon.
    if (stopping_ && !killed_ && num_running() == 0)
      wake = std::min(kill_deadline_, now + std::chrono::milliseconds(100));
    int timeout_ms = -1;
    if (wake) {
      const auto ms = std::chrono::ceil<std::chrono::milliseconds>(*wake - now).count();
      timeout_ms = int(std::clamp<int64_t>(ms, 0, INT_MAX));
    }
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) MOEFQ_FAIL(ErrorKind::kFailedCheck, "launch: poll: ", std::strerror(errno));
    for (size_t i = 1; ready > 0 && i < fds.size(); ++i)
      if (fds[i].revents) read_stream(*owners[i].first, *owners[i].second, /*until_empty=*/false);
    if (ready > 0 && fds[0].revents) handle_signals();

    const Clock::time_point after = Clock::now();
    if (!stopping_ && output_lost_)
      stop(std::string("cannot write to ") + output_lost_ + ": " + std::strerror(output_errno_), 128 + SIGPIPE,
           SIGTERM);
    if (!stopping_ && options_.timeout_s && after >= job_deadline_)
      stop("timeout: the job ran longer than --timeout " + seconds_text(*options_.timeout_s), kTimeoutExitStatus,
           SIGTERM);
    if (stopping_ && !killed_ && after >= kill_deadline_ && (num_running() > 0 || groups_alive())) {
      const int running = num_running();
      const std::string who = running == 0 ? std::string("processes started by the ranks")
                                           : std::to_string(running) + (running == 1 ? " rank" : " ranks");
      std::fprintf(stderr, "moefq launch: %s still running after --grace %s; sending SIGKILL\n", who.c_str(),
                   seconds_text(options_.grace_s).c_str());
      signal_all(SIGKILL);
      killed_ = true;
    }
  }
  // Output still in the pipes; processes the ranks left behind may hold them open, so take only
  // what is there.
  for (Rank& rank : ranks_)
    for (Stream& s : rank.streams) {
      read_stream(rank, s, /*until_empty=*/true);
      emit_lines(rank, s, /*flush_partial=*/true);
    }
  return exit_status_;
}

}  // namespace

int launch(const LaunchOptions& options) {
  MOEFQ_CHECK(options.num_ranks >= 1 && options.num_ranks <= kMaxRanks, "launch: -n must be 1 to ", kMaxRanks,
              " ranks, got ", options.num_ranks);
  MOEFQ_CHECK(!options.command.empty() && !options.command[0].empty(),
              "launch: missing the program to run: moefq launch -n N -- PROGRAM ARGS...");
  if (options.timeout_s)
    MOEFQ_CHECK(std::isfinite(*options.timeout_s) && *options.timeout_s > 0 && *options.timeout_s <= kMaxSeconds,
                "launch: --timeout must be a number of seconds > 0 and <= ", kMaxSeconds, ", got ", *options.timeout_s);
  MOEFQ_CHECK(std::isfinite(options.grace_s) && options.grace_s >= 0 && options.grace_s <= kMaxSeconds,
              "launch: --grace must be a number of seconds >= 0 and <= ", kMaxSeconds, ", got ", options.grace_s);
  Job job(options);
  return job.run();
}

}  // namespace moefq::dist
