#include "train.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <torch/cuda.h>

#include "bench.h"
#include "args.h"
#include "report.h"
#include "tempo/memory.h"
#include "tempo/train/distributed.h"

namespace tempo::tools {

namespace {
namespace fs = std::filesystem;

const char* kDefaultCorpus = "/usr/share/doc/python3/html/_sources";

int64_t integer(const std::string& flag, const std::string& v, int64_t min) {
  return parse_int("tempo train", flag, v, min);
}

double number(const std::string& flag, const std::string& v) {
  double x = 0;
  bool ok = false;
  try {
    size_t pos = 0;
    x = std::stod(v, &pos);
    ok = pos == v.size() && std::isfinite(x) && x >= 0;
  } catch (...) {}
  if (!ok) throw std::invalid_argument("tempo train: " + flag + " must be a non-negative number, got '" + v + "'");
  return x;
}

// A run's log: (step, loss) and (step, eval loss) points. A row that is not numbers is an
// error naming the line; non-finite losses (a run that diverged) are counted in `skipped`
// and left out of the points, which a chart cannot place.
struct RunLog {
  std::vector<std::pair<double, double>> loss, eval;
  int64_t skipped = 0;
  double first_skipped = 0;
};

RunLog read_log(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::invalid_argument("tempo plot: cannot read " + path);
  std::string line;
  std::getline(f, line);
  if (line.rfind("step,loss", 0) != 0) throw std::invalid_argument("tempo plot: " + path + " is not a tempo train log");
  RunLog log;
  for (int64_t n = 2; std::getline(f, line); ++n) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) cells.push_back(cell);
    if (cells.size() < 6) continue;
    const auto number_at = [&](size_t i) {
      size_t pos = 0;
      double x = 0;
      try {
        x = std::stod(cells[i], &pos);
      } catch (const std::exception&) {
        pos = 0;
      }
      if (pos == 0 || pos != cells[i].size())
        throw std::invalid_argument("tempo plot: " + path + " line " + std::to_string(n) + ": '" + cells[i] +
                                    "' is not a number");
      return x;
    };
    const double step = number_at(0);
    for (const size_t col : {size_t{1}, size_t{5}}) {
      if (cells[col].empty()) continue;  // eval_loss: only where evaluated
      const double y = number_at(col);
      if (!std::isfinite(y)) {
        if (log.skipped++ == 0) log.first_skipped = step;
        continue;
      }
      (col == 1 ? log.loss : log.eval).emplace_back(step, y);
    }
  }
  if (log.loss.empty() && log.skipped == 0) throw std::invalid_argument("tempo plot: " + path + " has no logged steps");
  return log;
}
}  // namespace

void print_train_usage(FILE* out) {
  std::fprintf(out,
               "usage: tempo train --out DIR [--model PRESET|HF_DIR] [--objective mlm|clm] [--method P]\n"
               "                   [--data FILE|DIR|IDS.safetensors] [--tokenizer train|FILE.model] [--vocab N]\n"
               "                   [--seq S] [--batch B] [--accum K] [--steps N] [--lr LR] [--warmup N]\n"
               "                   [--weight-decay W] [--clip C] [--eval-every N] [--eval-batches N]\n"
               "                   [--save-every N] [--seed S] [--dtype fp32|bf16] [--device cpu|cuda]\n"
               "                   [--hidden H] [--layers L] [--heads A] [--intermediate I] [--positions P]\n"
               "                   [--dropout P] [--budget BYTES] [--resume] [--plot FILE.svg] [--nproc N]\n"
               "                   [--bucket MIB] [--no-overlap]\n"
               "Trains a BERT/RoBERTa (masked LM) or GPT-2/LLaMA (causal LM) on real text and writes\n"
               "DIR/log.csv (step, loss, lr, tokens_per_s, held_bytes, eval_loss, grad_norm), DIR/checkpoints/\n"
               "(every --save-every steps and at the end; the newest two kept) and DIR/tokenizer.model.\n"
               "--data defaults to %s (Debian's python3-doc: the\n"
               "reStructuredText sources of Python's documentation, PSF licence); the last 5%% of its tokens\n"
               "are held out for the eval loss. --resume continues from the newest checkpoint that\n"
               "verifies, exactly (the same losses as a run never interrupted). Defaults: --model bert-base\n"
               "--method tempo --seq 128 --batch 8 --steps 300 --lr 5e-4 --warmup 30 --weight-decay 0.01\n"
               "--clip 1 --eval-every 50 --save-every 100. --nproc N: N data-parallel processes on this\n"
               "machine (c10d: Gloo on the CPU, NCCL and a GPU each with --device cuda), each reading its share of "
               "every step's batch (--batch is per process);\n"
               "across machines, start one per process with torchrun's RANK, WORLD_SIZE, MASTER_ADDR,\n"
               "MASTER_PORT set. Gradients are summed over processes in buckets of --bucket MiB (25),\n"
               "each started during the backward as soon as its gradients are final; --no-overlap sums\n"
               "them all after the backward. --budget BYTES (11GiB, 512MiB): the memory the run may\n"
               "hold on its device (CPU: tempo's counting allocator; CUDA: the caching allocator's share\n"
               "of the GPU, its cache included); a first step past it is refused (exit 2).\n"
               "SIGINT (Ctrl-C) or SIGTERM during the steps: the step in progress ends, is checkpointed,\n"
               "and the run exits 130 or 143 (a second signal stops it at once); --resume goes on. One\n"
               "run at a time per DIR (its folder is locked).\n"
               "usage: tempo plot OUT.svg RUN_DIR [RUN_DIR...]   the runs' loss and eval-loss curves\n",
               kDefaultCorpus);
}

TrainCommand parse_train_args(const std::vector<std::string>& args) {
  TrainCommand c;
  c.args = args;
  auto& o = c.options;
  o.data = kDefaultCorpus;
  o.progress = isatty(2);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string k = current_flag("tempo train", args[i]);
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) throw std::invalid_argument("tempo train: " + k + " needs a value");
      return args[++i];
    };
    if (k == "--model")
      o.model = value();
    else if (k == "--objective")
      o.objective = value();
    else if (k == "--method")
      o.method = value();
    else if (k == "--data")
      o.data = value();
    else if (k == "--tokenizer")
      o.tokenizer = value();
    else if (k == "--vocab")
      o.vocab = integer(k, value(), 16);
    else if (k == "--seq")
      o.seq = integer(k, value(), 2);
    else if (k == "--batch")
      o.batch = integer(k, value(), 1);
    else if (k == "--accum")
      o.accum = integer(k, value(), 1);
    else if (k == "--steps")
      o.steps = integer(k, value(), 1);
    else if (k == "--warmup")
      o.warmup = integer(k, value(), 0);
    else if (k == "--lr")
      o.lr = number(k, value());
    else if (k == "--weight-decay")
      o.weight_decay = number(k, value());
    else if (k == "--clip")
      o.clip = number(k, value());
    else if (k == "--eval-every")
      o.eval_every = integer(k, value(), 0);
    else if (k == "--eval-batches")
      o.eval_batches = integer(k, value(), 1);
    else if (k == "--save-every")
      o.save_every = integer(k, value(), 0);
    else if (k == "--seed")
      o.seed = static_cast<uint64_t>(integer(k, value(), 0));
    else if (k == "--dtype")
      o.dtype = value();
    else if (k == "--device")
      o.device = value();
    else if (k == "--hidden")
      o.hidden = integer(k, value(), 1);
    else if (k == "--layers")
      o.layers = integer(k, value(), 1);
    else if (k == "--heads")
      o.heads = integer(k, value(), 1);
    else if (k == "--intermediate")
      o.intermediate = integer(k, value(), 1);
    else if (k == "--positions")
      o.positions = integer(k, value(), 1);
    else if (k == "--dropout")
      o.dropout = number(k, value());
    else if (k == "--budget")
      o.budget = parse_bytes(value(), "tempo train");
    else if (k == "--out")
      o.out = value();
    else if (k == "--resume")
      o.resume = true;
    else if (k == "--plot")
      c.plot = value();
    else if (k == "--nproc")
      c.nproc = static_cast<int>(integer(k, value(), 1));
    else if (k == "--bucket") {
      const double mib = number(k, value());
      if (!(mib > 0)) throw std::invalid_argument("tempo train: --bucket must be a positive number of MiB");
      o.bucket_bytes = std::max<int64_t>(static_cast<int64_t>(mib * 1048576.0), 1);
    } else if (k == "--no-overlap")
      o.overlap = false;
    else
      throw std::invalid_argument("tempo train: unknown argument '" + k + "'");
  }
  if (o.lr <= 0) throw std::invalid_argument("tempo train: --lr must be positive");
  if (o.dropout >= 1) throw std::invalid_argument("tempo train: --dropout must be below 1");
  if (!c.plot.empty()) check_output("tempo train", "--plot", c.plot, /*svg=*/true);
  return c;
}

namespace {
// A free TCP port on this machine for the children's rendezvous.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) ::close(fd);
  if (!port) throw std::runtime_error("tempo train: no free port for --nproc");
  return port;
}

// ---- stopping on SIGINT and SIGTERM ----
// A worker (a run, or one rank of several): the first signal during the steps asks the trainer
// to stop after the step in progress, with a checkpoint of it; a second one, or one before the
// steps (reading the corpus, training a tokenizer), has the signal's default action. The
// launcher of --nproc passes a signal on to its workers, which may have had it already (Ctrl-C
// reaches the whole process group): one Ctrl-C then reaches a worker twice, directly and as the
// launcher's copy, in either order and possibly after the steps have ended, and only a second
// signal from the same source counts as a second one.
tempo::train::StopRequest g_stop;
constexpr int kFromLauncher = 0x7e3b0;                         // sigqueue's value on the launcher's copies
bool g_speak = true;                                           // the rank that prints (0)
volatile sig_atomic_t g_seen_direct = 0, g_seen_launcher = 0;  // the sources of the signals had

void default_action(int sig) {
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void on_stop_signal(int sig, siginfo_t* info, void*) {
  const bool from_launcher = info && info->si_code == SI_QUEUE && info->si_value.sival_int == kFromLauncher;
  volatile sig_atomic_t& seen = from_launcher ? g_seen_launcher : g_seen_direct;
  if (g_stop.requested != 0) {
    if (seen) return default_action(sig);  // a second signal
    seen = 1;                              // the other copy of the first
    return;
  }
  if (!g_stop.accepting) return default_action(sig);
  seen = 1;
  g_stop.requested = sig;
  if (g_speak) {
    static const char msg[] = "\ntempo train: stopping after this step, with a checkpoint (again: stop at once)\n";
    [[maybe_unused]] const ssize_t n = ::write(2, msg, sizeof msg - 1);
  }
}

void install(int sig, void (*handler)(int, siginfo_t*, void*)) {
  struct sigaction a {};
  a.sa_sigaction = handler;
  a.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&a.sa_mask);
  ::sigaction(sig, &a, nullptr);
}

// The launcher: its workers' pids (spawn's list, copied where a signal handler may read it), and
// how many stop signals it has passed on (the second kills them).
constexpr int kMaxWorkers = 1024;
pid_t g_workers[kMaxWorkers];
volatile sig_atomic_t g_nworkers = 0, g_forwarded = 0, g_signal = 0;

void on_launcher_signal(int sig, siginfo_t*, void*) {
  const int again = g_forwarded;
  g_forwarded = again + 1;
  g_signal = sig;
  for (int i = 0; i < g_nworkers; ++i) {
    if (again) {
      ::kill(g_workers[i], SIGKILL);
    } else {
      union sigval v {};
      v.sival_int = kFromLauncher;
      ::sigqueue(g_workers[i], sig, v);
    }
  }
}

// A worker's exit that is a stop asked for (by a signal), not a failure.
bool stopped_as_asked(int status) {
  return WIFEXITED(status) && (WEXITSTATUS(status) == 128 + SIGINT || WEXITSTATUS(status) == 128 + SIGTERM);
}

// --nproc N: this program N times with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, as
// torchrun starts workers. If one fails, the others are killed (they cannot finish a step
// without it); SIGINT and SIGTERM are passed on, so every worker stops after the same step;
// a worker whose launcher dies (even by SIGKILL) gets SIGTERM.
int spawn(const TrainCommand& c) {
  if (c.options.device == "cuda") {
    if (!tempo::train::nccl_available())
      throw std::invalid_argument(
          "tempo train: --device cuda --nproc needs NCCL (this build has none: build against "
          "a CUDA torch whose nvidia-nccl package is installed)");
    const auto gpus = static_cast<int>(torch::cuda::device_count());
    if (gpus < c.nproc)
      throw std::invalid_argument("tempo train: --nproc " + std::to_string(c.nproc) +
                                  " on CUDA needs a GPU per process, "
                                  "this machine has " +
                                  std::to_string(gpus));
  } else if (!tempo::train::gloo_available()) {
    throw std::invalid_argument(
        "tempo train: --nproc needs Gloo (this build has none: install libgloo-dev and rebuild)");
  }
  const std::string port = std::to_string(free_port()), world = std::to_string(c.nproc);
  std::vector<std::string> args{"tempo", "train"};
  for (size_t i = 0; i < c.args.size(); ++i) {
    if (c.args[i] == "--nproc") {
      ++i;
      continue;
    }
    args.push_back(c.args[i]);
  }
  if (c.nproc > kMaxWorkers)
    throw std::invalid_argument("tempo train: --nproc is at most " + std::to_string(kMaxWorkers));
  std::vector<pid_t> pids;
  const pid_t launcher = ::getpid();
  install(SIGINT, on_launcher_signal);
  install(SIGTERM, on_launcher_signal);
  for (int r = 0; r < c.nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher) std::_Exit(128 + SIGTERM);  // it died before the line above
      ::signal(SIGINT, SIG_DFL), ::signal(SIGTERM, SIG_DFL);   // until the worker installs its own
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", world.c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv("/proc/self/exe", argv.data());
      std::_Exit(127);
    }
    if (pid < 0) {
      for (pid_t p : pids) ::kill(p, SIGKILL);
      throw std::runtime_error("tempo train: fork failed");
    }
    pids.push_back(pid);
    g_workers[r] = pid;
    g_nworkers = r + 1;
  }
  // The exit status: the first failure's (a sibling killed because of it does not count), else
  // that of a stop asked for, else 0.
  int failed = 0, stopped = 0;
  for (size_t done = 0; done < pids.size();) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    ++done;
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    if (code == 0) continue;
    if (stopped_as_asked(status)) {
      if (!stopped) stopped = code;
      continue;
    }
    if (g_forwarded > 1) {  // killed by the launcher, at a second signal: as that signal would have
      failed = 128 + g_signal;
      continue;
    }
    if (!failed) {
      // A worker that failed says why itself; one killed by a signal that the launcher did not
      // pass on cannot.
      if (WIFSIGNALED(status) && g_forwarded == 0) {
        const int rank = static_cast<int>(std::find(pids.begin(), pids.end(), pid) - pids.begin());
        const int sig = WTERMSIG(status);
        std::fprintf(stderr, "tempo train: process %d of %d was killed by signal %d (%s)%s; stopping the others\n",
                     rank, c.nproc, sig, strsignal(sig),
                     sig == SIGKILL ? ": out of memory? (the kernel's OOM killer sends SIGKILL)" : "");
      }
      failed = code;
      for (pid_t p : pids)
        if (p != pid) ::kill(p, SIGKILL);
    }
  }
  return failed ? failed : stopped;
}

// A torchrun variable: unset or empty gives the fallback; anything but a whole number from
// `least` to `most` is a mistake in the launch (exit 2), named.
int env_int(const char* name, int fallback, long least, long most) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(v, &end, 10);
  if (errno != 0 || *end != '\0' || n < least || n > most)
    throw std::invalid_argument("tempo train: " + std::string(name) + "='" + v + "' is not a whole number from " +
                                std::to_string(least) + " to " + std::to_string(most));
  return static_cast<int>(n);
}
}  // namespace

int run_train(const TrainCommand& c) {
  if (c.nproc > 1) return spawn(c);
  const auto& o = c.options;
  // Launched as one of several (by --nproc, or by torchrun-style environment variables). Under
  // torchrun a world of one is a process group too (as torch's DDP makes one): the gradients go
  // through Gloo or NCCL, summed over one process (without that backend built, it runs alone).
  const char* world_env = std::getenv("WORLD_SIZE");
  const int world = env_int("WORLD_SIZE", 1, 1, 1 << 20), rank = env_int("RANK", 0, 0, world - 1);
  std::unique_ptr<tempo::train::Communicator> comm;
  const bool nccl = o.device == "cuda";
  const bool built = nccl ? tempo::train::nccl_available() : tempo::train::gloo_available();
  if ((world_env && *world_env) && (world != 1 || built)) {
    const char* addr = std::getenv("MASTER_ADDR");
    const std::string a = addr ? addr : "127.0.0.1";
    const int port = env_int("MASTER_PORT", 29500, 1, 65535);
    comm = nccl ? tempo::train::make_nccl_communicator(rank, world, a, port, env_int("LOCAL_RANK", rank, 0, 1023))
                : tempo::train::make_gloo_communicator(rank, world, a, port);
  } else {
    comm = std::make_unique<tempo::train::Communicator>();
  }
  tempo::train::TrainOptions opts = o;
  opts.progress = o.progress && rank == 0;
  opts.stop = &g_stop;
  g_speak = rank == 0;
  install(SIGINT, on_stop_signal);
  install(SIGTERM, on_stop_signal);
  const auto s = tempo::train::train(opts, *comm);
  const int code = s.stopped ? 128 + (g_stop.requested != 0 ? g_stop.requested.load() : SIGTERM) : 0;
  if (rank != 0) return code;
  if (comm->distributed())
    std::printf("data parallel: %d process%s (%s)\n", world, world > 1 ? "es" : "", nccl ? "NCCL" : "Gloo");
  for (const auto& n : s.notes) std::printf("%s\n", n.c_str());
  if (s.last_step > 0)  // none when a resumed run was already complete
    std::printf("steps %lld..%lld: loss %.4f -> %.4f, eval loss %.4f -> %.4f, %.0f tokens/s, peak %.1f MiB\n",
                static_cast<long long>(s.first_step), static_cast<long long>(s.last_step), s.first_loss, s.last_loss,
                s.first_eval, s.last_eval, s.tokens_per_s, s.peak_bytes / 1048576.0);
  std::printf("log: %s\n", (fs::path(o.out) / "log.csv").c_str());
  if (!c.plot.empty()) {
    const int plotted = run_plot({c.plot, o.out});
    if (plotted != 0) return plotted;
  }
  return code;
}

int run_plot(const std::vector<std::string>& args) {
  if (args.size() < 2) throw std::invalid_argument("tempo plot: usage: tempo plot OUT.svg RUN_DIR [RUN_DIR...]");
  check_output("tempo plot", "OUT.svg", args[0], /*svg=*/true);
  LineChart loss{"training loss", "step", {}}, eval{"eval loss", "step", {}};
  for (size_t i = 1; i < args.size(); ++i) {
    RunLog log = read_log((fs::path(args[i]) / "log.csv").string());
    const std::string name = fs::weakly_canonical(fs::absolute(args[i])).filename().string();  // runs/x/ -> x
    if (log.skipped > 0)
      std::printf("%s: %lld non-finite losses (the first at step %.0f) are left out of the plot\n", name.c_str(),
                  static_cast<long long>(log.skipped), log.first_skipped);
    loss.series.push_back({name, std::move(log.loss)});
    eval.series.push_back({name, std::move(log.eval)});
  }
  write_line_charts(args[0], "tempo train", {loss, eval});
  std::printf("plot written to %s\n", args[0].c_str());
  return 0;
}

}  // namespace tempo::tools
