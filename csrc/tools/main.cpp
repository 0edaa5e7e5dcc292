// The `tempo` command line: `tempo --version`, `tempo env`, `tempo bench`, `tempo slim`,
// `tempo train`, `tempo plot`.
#include <ATen/Parallel.h>
#include <c10/util/Logging.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <unistd.h>

#include "tempo/common.h"
#include "tempo/models/hf_files.h"
#include "tempo/train/distributed.h"
#include "tempo/train/tokenizer.h"

#include "bench.h"
#include "slim.h"
#include "train.h"

namespace {

void usage(FILE* out) {
  std::fprintf(out,
               "usage: tempo <command>\n"
               "  --version   print the version\n"
               "  env         versions, threads, CUDA built and present\n"
               "  bench       memory, maximum batch and throughput of a model per method\n"
               "              (tempo bench --help)\n"
               "  slim        SLiM: peak memory, time and gradient discrepancy per chunk size of a\n"
               "              chunked Performer step (tempo slim --help)\n"
               "  train       train a model on real text: log, checkpoints, exact resume (tempo train --help)\n"
               "  plot        loss curves of tempo train runs (tempo plot OUT.svg RUN_DIR...)\n"
               "  help        this text\n");
}

int env() {
  const tempo::BuildInfo info = tempo::build_info();
  std::printf("tempo             %s\n", info.version);
  std::printf("libtorch          %s\n", TORCH_VERSION);
#if defined(__clang__)
  std::printf("compiler          clang %s\n", __clang_version__);
#elif defined(__GNUC__)
  std::printf("compiler          gcc %d.%d.%d\n", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__);
#endif
  std::printf("cpu threads       %d (ATen intra-op), %d (tempo OpenMP%s)\n", at::get_num_threads(), info.max_threads,
              info.openmp ? "" : ", not built");
  std::printf("cuda kernels      %s\n", info.cuda_compiled ? "built"
                                        : TEMPO_TORCH_CPU_ONLY
                                            ? "not built (torch has CUDA; no nvcc, or TEMPO_CUDA=OFF, at build time)"
                                            : "not built (CPU-only torch)");
  const bool present = torch::cuda::is_available();
  std::printf("cuda devices      %s\n",
              present ? std::to_string(torch::cuda::device_count()).c_str() : "none available");
  // The optional libraries: what a build without each cannot do.
  std::printf("hf checkpoints    %s\n", tempo::models::hf_files_available()
                                            ? "read and written (nlohmann-json)"
                                            : "no: built without nlohmann-json (tempo train refused: its "
                                              "checkpoints are safetensors)");
  std::printf("tokenizer         %s\n", tempo::train::Tokenizer::available()
                                            ? "SentencePiece"
                                            : "no: built without SentencePiece (tempo train takes pretokenized ids)");
  const bool gloo = tempo::train::gloo_available(), nccl = tempo::train::nccl_available();
  std::printf("data parallel     %s\n", gloo && nccl ? "Gloo (cpu), NCCL (cuda)"
                                        : gloo       ? "Gloo (cpu); no NCCL"
                                        : nccl       ? "NCCL (cuda); no Gloo: built without its headers"
                                                     : "no: built without Gloo's headers or NCCL");
  return 0;
}

// The results go to stdout (--json, the table), often redirected to a file: a write that
// failed there (a full disk) is an error, not a cut-short file and exit 0.
int stdout_written(int rc) {
  if (std::fflush(stdout) == 0 && !std::ferror(stdout)) return rc;
  std::fprintf(stderr, "tempo: writing the output failed: %s\n", std::strerror(errno));
  return rc != 0 ? rc : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // LibTorch programs start with c10's enforce checks fatal (torch's Python module turns this
  // off): a failed CPU allocation would abort the process instead of throwing an error that
  // reaches the handlers below.
  FLAGS_caffe2_use_fatal_for_enforce = false;
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "--version" || cmd == "version") {
    std::printf("tempo %s\n", tempo::build_info().version);
    return 0;
  }
  if (cmd == "env") return env();
  if (cmd == "bench" || cmd == "slim" || cmd == "train" || cmd == "plot") {
    std::vector<std::string> args(argv + 2, argv + argc);
    for (const auto& a : args)
      if (a == "--help" || a == "-h") {
        if (cmd == "bench")
          tempo::tools::print_bench_usage(stdout);
        else if (cmd == "slim")
          tempo::tools::print_slim_usage(stdout);
        else
          tempo::tools::print_train_usage(stdout);
        return 0;
      }
    try {
      int rc = 0;
      if (cmd == "bench")
        rc = tempo::tools::run_bench(tempo::tools::parse_bench_args(args));
      else if (cmd == "slim")
        rc = tempo::tools::run_slim(tempo::tools::parse_slim_args(args));
      else if (cmd == "train")
        rc = tempo::tools::run_train(tempo::tools::parse_train_args(args));
      else
        rc = tempo::tools::run_plot(args);
      return stdout_written(rc);
    } catch (const std::invalid_argument& e) {
      std::fprintf(stderr, "%s%s (see tempo %s --help)\n", isatty(2) ? "\r\033[K" : "", e.what(), cmd.c_str());
      return 2;
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "%s%s\n", isatty(2) ? "\r\033[K" : "", e.what_without_backtrace());
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s%s\n", isatty(2) ? "\r\033[K" : "", e.what());
      return 1;
    }
  }
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    usage(stdout);
    return 0;
  }
  std::fprintf(stderr, "tempo: unknown command '%s'\n", cmd.c_str());
  usage(stderr);
  return 2;
}
