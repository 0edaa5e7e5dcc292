#include "tempo/train/trainer.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include "tempo/memory.h"
#include "tempo/models/file_write.h"
#include "tempo/models/pretrained.h"
#include "tempo/train/adamw.h"
#include "tempo/train/checkpoint.h"
#include "tempo/train/data.h"
#include "tempo/train/distributed.h"
#include "tempo/train/manifest.h"

namespace tempo::train {

namespace {
namespace fs = std::filesystem;
using tempo::models::Arch;
using tempo::models::Method;
using tempo::models::ModelConfig;
using tempo::models::TransformerModel;

[[noreturn]] void user_error(const std::string& what) { throw std::invalid_argument("tempo train: " + what); }

std::string training_what(const std::string& model, int64_t parameters) {
  return "training " + model + " (" + std::to_string(parameters) +
         " parameters, with their gradients and AdamW's two moments)";
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Autocast to bf16 for the forward (fp32 master weights and optimizer), when asked.
struct Autocast {
  Autocast(bool on, c10::DeviceType d) : on_(on), d_(d) {
    if (!on_) return;
    prev_ = at::autocast::is_autocast_enabled(d_);
    at::autocast::set_autocast_enabled(d_, true);
    at::autocast::set_autocast_dtype(d_, at::kBFloat16);
  }
  ~Autocast() {
    if (!on_) return;
    at::autocast::set_autocast_enabled(d_, prev_);
    at::autocast::clear_cache();
  }
  bool on_, prev_ = false;
  c10::DeviceType d_;
};

bool is_norm_or_bias(const std::string& name) {
  return name.find("bias") != std::string::npos || name.find("norm") != std::string::npos;
}

// The number of predicted positions of a batch.
int64_t targets_of(const tempo::models::Batch& b, bool mlm) {
  return mlm ? b.labels.ne(-100).sum().item<int64_t>() : b.input_ids.size(0) * (b.input_ids.size(1) - 1);
}

void to_device(tempo::models::Batch& b, const c10::Device& device) {
  b.input_ids = b.input_ids.to(device), b.attention_mask = b.attention_mask.to(device);
  if (b.labels.defined()) b.labels = b.labels.to(device);
}

// An exclusive lock on the run's folder (flock, released by the kernel however the process
// ends), so that two runs cannot write one folder's log and checkpoints at once. Where the
// filesystem has no such locks (some network filesystems), the run goes on unlocked.
class FolderLock {
 public:
  explicit FolderLock(const fs::path& dir) {
    fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd_ < 0) return;
    if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) return;
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK)
      user_error("another tempo train is running in " + dir.string() +
                 " (it holds the folder's lock): wait for it to end, stop it, or choose another --out");
  }
  ~FolderLock() {
    if (fd_ >= 0) ::close(fd_);
  }
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;

 private:
  int fd_ = -1;
};

// Marks the steps as running for a StopRequest (and unmarks them however train() leaves).
struct Accepting {
  explicit Accepting(StopRequest* r) : r_(r) {
    if (r_) r_->accepting = true;
  }
  ~Accepting() {
    if (r_) r_->accepting = false;
  }
  StopRequest* r_;
};

const char* kHeader = "step,loss,lr,tokens_per_s,held_bytes,eval_loss,grad_norm";

// The 2-norm of all the gradients, as clip_grad_norm_ computes it, without clipping.
double gradient_norm(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> norms;
  for (const auto& p : params)
    if (p.grad().defined()) norms.push_back(p.grad().norm());
  return norms.empty() ? 0.0 : at::stack(norms).norm().item<double>();
}

// Keeps the header and the rows up to `step` (a resumed run rewrites what follows).
void truncate_log(const fs::path& log, int64_t step) {
  std::ifstream in(log);
  std::vector<std::string> keep;
  std::string line;
  while (std::getline(in, line)) {
    if (keep.empty()) {
      keep.push_back(line);
      continue;
    }
    try {  // a row cut short by a kill is the last one, after the checkpoint: dropped either way
      if (line.find(',') != std::string::npos && std::stoll(line.substr(0, line.find(','))) <= step)
        keep.push_back(line);
    } catch (const std::exception&) {}
  }
  in.close();
  std::string text;
  for (const auto& l : keep) text += l + "\n";
  tempo::models::write_file_atomically(log.string(), text, "tempo train");
}

// What an exact resumption needs to be the same, as "--option=value" lines (kept with each
// checkpoint): a resumed run that changes one goes on, but is told it is no longer the run it
// continues. The model's shape is checked by the tensors themselves.
std::string run_settings(const TrainOptions& o, const std::string& objective, int world, const std::string& tokenizer,
                         const Corpus& corpus) {
  auto num = [](double v) {  // the shortest text that reads back as v
    char b[40];
    for (int digits = 1; digits <= 17; ++digits) {
      std::snprintf(b, sizeof b, "%.*g", digits, v);
      if (std::strtod(b, nullptr) == v) break;
    }
    return std::string(b);
  };
  std::error_code ec;
  const fs::path data = fs::weakly_canonical(fs::path(o.data), ec);
  std::ostringstream s;
  s << "--data=" << (ec ? o.data : data.string()) << "\n--objective=" << objective << "\n--method=" << o.method
    << "\n--dtype=" << o.dtype << "\n--seq=" << o.seq << "\n--batch=" << o.batch << "\n--accum=" << o.accum
    << "\n--processes=" << world << "\n--seed=" << o.seed << "\n--lr=" << num(o.lr) << "\n--warmup=" << o.warmup
    << "\n--steps=" << o.steps << "\n--weight-decay=" << num(o.weight_decay) << "\n--clip=" << num(o.clip)
    << "\n--dropout=" << num(o.dropout) << "\n";
  if (!tokenizer.empty()) s << "--tokenizer=" << tokenizer << "\n";  // the model file's checksum
  // The ids trained on: a corpus edited (or another tokenizer) since gives other windows.
  uint32_t sum = 0;
  for (const auto* ids : {&corpus.train, &corpus.eval}) {
    const at::Tensor c = ids->contiguous();
    sum = tempo::train::crc32(c.data_ptr(), static_cast<size_t>(c.nbytes()), sum);
  }
  char ids[64];
  std::snprintf(ids, sizeof ids, "%lld+%lld ids, crc32:%08x", static_cast<long long>(corpus.train.numel()),
                static_cast<long long>(corpus.eval.numel()), sum);
  s << "corpus=" << ids << "\n";
  return s.str();
}

std::vector<std::pair<std::string, std::string>> parse_settings(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> kv;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) kv.emplace_back(line.substr(0, eq), line.substr(eq + 1));
  }
  return kv;
}

// One saved setting's value; empty where the saved run did not record it.
std::string saved_setting(const std::string& saved, const std::string& key) {
  for (const auto& [k, v] : parse_settings(saved))
    if (k == key) return v;
  return "";
}

// "--batch 8 (was 4), --lr 0.001 (was 0.0005)" for the settings that differ; options the
// saved run did not record are not compared.
std::string changed_settings(const std::string& saved, const std::string& now) {
  const auto before = parse_settings(saved);
  std::string out;
  for (const auto& [key, value] : parse_settings(now))
    for (const auto& [k, v] : before)
      if (k == key && v != value) out += (out.empty() ? "" : ", ") + key + " " + value + " (was " + v + ")";
  return out;
}

// ---- train()'s sections ------------------------------------------------------------------

// The options, checked; the device they name (with tempo's CPU accounting, and the budget set).
c10::Device check_options(const TrainOptions& o) {
  // Checkpoints and pretokenized ids are safetensors files: refused at once, not at the first
  // checkpoint after the steps before it have run.
  if (!tempo::models::hf_files_available())
    user_error(
        "this build has no nlohmann-json, and a run's checkpoints and pretokenized ids are safetensors files "
        "(install nlohmann-json3-dev and rebuild; on a machine without it, see docs/results/cuda-build.md)");
  if (o.out.empty()) user_error("--out DIR is required (the log, checkpoints and tokenizer go there)");
  if (o.seq < 2 || o.batch < 1 || o.accum < 1 || o.steps < 1 || o.warmup < 0 || o.lr <= 0 || o.clip < 0 ||
      o.weight_decay < 0 || o.eval_batches < 1)
    user_error(
        "--seq >= 2, --batch, --accum, --steps, --eval-batches >= 1, --lr > 0 and --warmup, --clip, "
        "--weight-decay >= 0 are required");
  if (o.dtype != "fp32" && o.dtype != "bf16") user_error("--dtype must be fp32 or bf16, got '" + o.dtype + "'");
  if (o.device != "cpu" && o.device != "cuda") user_error("--device must be cpu or cuda, got '" + o.device + "'");
  const c10::Device device(o.device == "cuda" ? c10::kCUDA : c10::kCPU);
  if (device.is_cuda() && !at::hasCUDA()) user_error("--device cuda but no CUDA device is available");
  if (device.is_cpu()) tempo::memory::track_cpu();
  if (o.budget) {  // on CUDA, on the device this process uses (NCCL's made it current)
    try {
      tempo::memory::set_limit(device, o.budget);
    } catch (const c10::Error& e) {
      user_error(e.what_without_backtrace());
    }
  }
  return device;
}

// The run's folder (--out): its checkpoints and log. The lead locks it before it looks at its
// checkpoints (a folder that does not exist yet is locked once made, and looked at again).
struct RunFolder {
  fs::path out, ckdir, log;
  bool lead, resume;
  std::unique_ptr<FolderLock> lock;

  RunFolder(const TrainOptions& o, bool lead_rank)
      : out(o.out), ckdir(out / "checkpoints"), log(out / "log.csv"), lead(lead_rank), resume(o.resume) {
    if (fs::exists(out) && !fs::is_directory(out)) user_error("--out " + o.out + " is a file, not a folder");
    if (lead && fs::is_directory(out)) lock = std::make_unique<FolderLock>(out);
    check_checkpoints();
  }

  void check_checkpoints() const {
    if (resume && !fs::exists(ckdir)) user_error("--resume, but " + ckdir.string() + " holds no checkpoint");
    if (!resume && fs::exists(ckdir) && !fs::is_empty(ckdir))
      user_error(out.string() +
                 " already holds checkpoints: add --resume to continue that run, or choose another --out");
  }

  // Made, writable, locked (now, if it was not there before).
  void open() {
    if (!lead) return;
    std::error_code ec;
    fs::create_directories(out, ec);
    if (ec) user_error("cannot make the run folder --out " + out.string() + ": " + ec.message());
    if (::access(out.c_str(), W_OK) != 0)
      user_error("cannot write in the run folder --out " + out.string() + ": " + std::strerror(errno));
    if (!lock) {
      lock = std::make_unique<FolderLock>(out);
      check_checkpoints();
    }
  }
};

// The method and the model's config, checked before the corpus is read (a tokenizer
// trained on it takes a while), so that a mistyped option fails at once.
struct Plan {
  Method method;
  bool folder;  // --model is a Hugging Face folder (else a preset)
  ModelConfig planned;
  std::string objective;
  bool mlm;
};

Plan plan_model(const TrainOptions& o) {
  const Method method = [&] {
    try {
      return Method::parse(o.method);
    } catch (const c10::Error& e) {
      user_error(e.what_without_backtrace());
    }
  }();
  const bool folder = fs::is_directory(o.model);
  const ModelConfig planned = [&] {
    try {
      if (folder) return tempo::models::pretrained_config(o.model);
      ModelConfig c = ModelConfig::preset(o.model);
      c.resize(o.hidden, o.layers, o.heads, o.intermediate, o.positions, 0);  // the vocabulary comes with the corpus
      c.validate();
      return c;
    } catch (const c10::Error& e) {
      user_error(e.what_without_backtrace());
    }
  }();
  const bool encoder = planned.arch == Arch::kBert || planned.arch == Arch::kRoberta;
  const std::string objective = o.objective.empty() ? (encoder ? "mlm" : "clm") : o.objective;
  if (objective != "mlm" && objective != "clm") user_error("--objective must be mlm or clm, got '" + objective + "'");
  if ((objective == "mlm") != encoder)
    user_error(std::string("--objective ") + objective + " does not fit a " + tempo::models::arch_name(planned.arch) +
               " (mlm: bert, roberta; clm: gpt2, llama)");
  const bool mlm = objective == "mlm";
  const int64_t max_seq = planned.arch == Arch::kLlama     ? planned.max_positions
                          : planned.arch == Arch::kRoberta ? planned.max_positions - planned.pad_id - 1
                                                           : planned.max_positions;
  if (o.seq > max_seq)
    user_error("--seq " + std::to_string(o.seq) + " is longer than the model's " + std::to_string(max_seq) +
               " positions");

  return Plan{method, folder, planned, objective, mlm};
}

// The tokenized corpus and what the run says of it.
struct CorpusSetup {
  Corpus corpus;
  std::string tokenizer_note, data_note;
  std::string tokenizer_sum;   // "crc32:..." of the SentencePiece model used (none for pretokenized ids)
  bool own_tokenizer = false;  // the run folder's tokenizer.model, made by an earlier run into it
};

CorpusSetup load_corpus(const TrainOptions& o, const fs::path& out, bool lead, Communicator& comm) {
  CorpusSetup r;
  Corpus& corpus = r.corpus;
  std::string &tokenizer_note = r.tokenizer_note, &data_note = r.data_note, &tokenizer_sum = r.tokenizer_sum;
  bool& own_tokenizer = r.own_tokenizer;
  auto checksum = [](const std::string& path) {
    char b[24];
    std::snprintf(b, sizeof b, "crc32:%08x", tempo::train::file_crc32(path));
    return std::string(b);
  };
  const int64_t min_eval = o.seq * o.batch;  // at least one eval batch
  try {
    if (o.data.empty()) user_error("--data is required");
    if (is_pretokenized(o.data)) {
      corpus = load_pretokenized(o.data, 0.05, min_eval);
    } else {
      std::vector<std::string> binary;
      const auto files = text_files(o.data, &binary);
      if (!binary.empty())
        data_note = "left out " + std::to_string(binary.size()) + " binary file" + (binary.size() > 1 ? "s" : "") +
                    " under --data (" + binary.front() + (binary.size() > 1 ? ", ..." : "") + ")";
      const fs::path saved = out / "tokenizer.model";
      if (o.tokenizer != "train") {
        corpus = tokenize_corpus(files, Tokenizer::load(o.tokenizer), 0.05, min_eval);
        tokenizer_sum = checksum(o.tokenizer);
      } else if (fs::exists(saved)) {  // the run's own (a resumed run, or one re-run into the same folder)
        const auto saved_tokenizer = [&]() {
          try {
            return Tokenizer::load(saved.string());
          } catch (const c10::Error& e) {
            user_error(std::string(e.what_without_backtrace()) + " (the tokenizer of the run in " + out.string() +
                       "; delete it to train a new one, or give --tokenizer FILE.model)");
          }
        };
        corpus = tokenize_corpus(files, saved_tokenizer(), 0.05, min_eval);
        tokenizer_sum = checksum(saved.string());
        own_tokenizer = true;
      } else {
        if (lead) {
          try {
            Tokenizer::train(files, saved.string(), static_cast<int>(o.vocab), o.seed);
          } catch (const std::invalid_argument& e) {  // the text: bad input (exit 2)
            user_error(e.what());
          } catch (const c10::Error& e) {  // the model not written (a full disk): exit 1, as any failed write
            throw std::runtime_error(e.what_without_backtrace());
          }
        }
        comm.barrier();
        corpus = tokenize_corpus(files, Tokenizer::load(saved.string()), 0.05, min_eval);
        tokenizer_sum = checksum(saved.string());
        tokenizer_note =
            "trained a SentencePiece tokenizer (" + std::to_string(corpus.vocab_size) + " pieces): " + saved.string();
      }
    }
  } catch (const c10::Error& e) {
    user_error(e.what_without_backtrace());
  }

  return r;
}

// The model (a preset or a folder's), on the device, in training mode; refused when it cannot
// train in the memory there is.
TransformerModel build_model(const TrainOptions& o, const Plan& plan, const Corpus& corpus, const c10::Device& device) {
  const bool folder = plan.folder, mlm = plan.mlm;
  const ModelConfig& planned = plan.planned;
  const Method& method = plan.method;
  TransformerModel model{nullptr};
  torch::manual_seed(o.seed);  // fresh heads and weights, then dropout: the same under every method
  try {
    if (folder) {
      model = tempo::models::load_pretrained(o.model, method, nullptr, [&](ModelConfig& c) {
        if (o.dropout >= 0) c.dropout = c.attention_dropout = o.dropout;
      });
      if (model->config().vocab < corpus.vocab_size)
        user_error("the corpus has ids up to " + std::to_string(corpus.vocab_size) + " but " + o.model + " has " +
                   std::to_string(model->config().vocab) +
                   " embeddings (tokenize with the model's own tokenizer: "
                   "python -m tempo.pretokenize)");
    } else {
      ModelConfig c = planned;
      c.vocab = corpus.vocab_size;
      if (o.dropout >= 0) c.dropout = c.attention_dropout = o.dropout;
      if (device.is_cpu())  // parameters, gradients, AdamW's two moments: known before anything is built
        tempo::memory::check_host_fits(4 * c.parameter_count() * 4, training_what(o.model, c.parameter_count()));
      model = TransformerModel(c, method);
    }
  } catch (const c10::Error& e) {
    user_error(e.what_without_backtrace());
  }
  const ModelConfig& cfg = model->config();
  if (mlm && corpus.mask_id < 0) user_error("masked-LM training needs a [MASK] token; the tokenizer has none");
  try {
    model->to(device);
  } catch (const c10::OutOfMemoryError&) {
    user_error("the model's " + std::to_string(cfg.parameter_count()) + " parameters do not fit" +
               (o.budget ? " the budget" : " the device"));
  }
  model->train();
  if (device.is_cpu() && folder) {  // a preset was checked before it was built; a folder's
    // gradients and AdamW's two moments come at the first step: refused now, rather than the process killed then
    int64_t bytes = 0;
    for (const auto& p : model->parameters()) bytes += 3 * p.numel() * static_cast<int64_t>(p.element_size());
    try {
      tempo::memory::check_host_fits(bytes, training_what(o.model, cfg.parameter_count()));
    } catch (const c10::Error& e) {
      user_error(e.what_without_backtrace());
    }
  }

  return model;
}

// AdamW's parameter groups: no weight decay on biases and norms.
std::vector<torch::optim::OptimizerParamGroup> parameter_groups(TransformerModel& model, const TrainOptions& o) {
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& p : model->named_parameters()) (is_norm_or_bias(p.key()) ? no_decay : decay).push_back(p.value());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay).eps(1e-6)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(o.lr).weight_decay(0.0).eps(1e-6)));

  return groups;
}

// With --resume: the checkpoint's weights and optimizer state loaded, its step returned, what
// changed noted; the log started (or cut back to the checkpoint's step).
int64_t resume_run(const TrainOptions& o, const RunFolder& run, const CorpusSetup& setup, const std::string& settings,
                   TransformerModel& model, AdamW& opt, TrainSummary& summary) {
  const fs::path &out = run.out, &ckdir = run.ckdir, &log = run.log;
  const bool lead = run.lead, own_tokenizer = setup.own_tokenizer;
  const std::string& tokenizer_sum = setup.tokenizer_sum;
  int64_t start = 0;
  if (o.resume) {
    std::vector<std::string> skipped;
    std::string saved;
    const auto step = load_latest_checkpoint(ckdir.string(), *model, opt, &skipped, &saved);
    for (const auto& s : skipped) summary.notes.push_back("skipped a damaged checkpoint: " + s);
    if (!step) user_error("--resume, but no checkpoint in " + ckdir.string() + " verifies");
    start = *step;
    if (o.steps < start)
      user_error("--steps " + std::to_string(o.steps) + " is before the checkpoint's step " + std::to_string(start) +
                 " (give --steps " + std::to_string(start) + " or more)");
    // The run's own tokenizer is part of the run: one that is not the file its checkpoint was
    // trained with (a damaged copy still parses) would give other ids for the same text.
    const std::string trained_with = saved_setting(saved, "--tokenizer");
    if (own_tokenizer && !trained_with.empty() && trained_with != tokenizer_sum)
      user_error("the run's tokenizer " + (out / "tokenizer.model").string() +
                 " is not the one its checkpoint at step " + std::to_string(start) + " was trained with (" +
                 tokenizer_sum + ", the checkpoint's " + trained_with +
                 "): damaged? Restore it, or give the original with --tokenizer FILE.model");
    summary.notes.push_back("resumed from step " + std::to_string(start));
    if (o.steps == start)
      summary.notes.push_back("the run is complete: the checkpoint is at step " + std::to_string(start) +
                              " of --steps " + std::to_string(o.steps) + " (raise --steps to train on)");
    const std::string changed = changed_settings(saved, settings);
    if (!changed.empty()) {
      const std::string note = "resumed with " + changed + ": the run goes on from step " + std::to_string(start) +
                               ", but not as the uninterrupted run would have";
      summary.notes.push_back(note);
      if (lead && o.progress) std::fprintf(stderr, "tempo train: %s\n", note.c_str());  // now, not only at the end
    }
    if (lead && fs::exists(log)) truncate_log(log, start);
  }
  if (lead) {
    if (!fs::exists(log))
      tempo::models::write_file_atomically(log.string(), std::string(kHeader) + "\n", "tempo train");
  }

  return start;
}

}  // namespace

double learning_rate(int64_t step, int64_t warmup, int64_t steps, double lr) {
  if (warmup > 0 && step <= warmup) return lr * static_cast<double>(step) / static_cast<double>(warmup);
  if (steps <= warmup) return lr;
  return lr * std::max(0.0, static_cast<double>(steps - step) / static_cast<double>(steps - warmup));
}

TrainSummary train(const TrainOptions& o, Communicator& comm) {
  const c10::Device device = check_options(o);
  const bool lead = comm.rank() == 0;
  RunFolder run(o, lead);
  const Plan plan = plan_model(o);
  run.open();
  const CorpusSetup setup = load_corpus(o, run.out, lead, comm);
  TransformerModel model = build_model(o, plan, setup.corpus, device);
  AdamW opt(parameter_groups(model, o), torch::optim::AdamWOptions(o.lr));  // tempo's: the same bits on every run

  TrainSummary summary;
  if (!setup.data_note.empty()) summary.notes.push_back(setup.data_note);
  if (!setup.tokenizer_note.empty()) summary.notes.push_back(setup.tokenizer_note);
  const std::string settings = run_settings(o, plan.objective, comm.world(), setup.tokenizer_sum, setup.corpus);
  const int64_t start = resume_run(o, run, setup, settings, model, opt, summary);
  const Corpus& corpus = setup.corpus;
  const bool mlm = plan.mlm;
  const fs::path &ckdir = run.ckdir, &log = run.log;

  // ---- data ----
  Windows train_windows(corpus.train, o.seq, o.seed, /*shuffle=*/true);
  Windows eval_windows(corpus.eval, o.seq, o.seed, /*shuffle=*/false);
  const int world = comm.world(), rank = comm.rank();
  // The eval set: the first eval_batches x batch x world windows of the held-out ids (the same
  // for any split of the global batch), each rank evaluating its share, the sums combined.
  const int64_t eval_n = std::min<int64_t>(o.eval_batches * o.batch * world, eval_windows.count());
  // The eval batches are the same at every evaluation: made (masked, moved) once.
  std::vector<std::pair<tempo::models::Batch, int64_t>> eval_set;  // batch, its targets
  auto evaluate = [&]() {
    if (eval_set.empty())
      for (int64_t first = rank * o.batch; first < eval_n; first += o.batch * world) {
        const int64_t n = std::min(o.batch, eval_n - first);
        auto b = make_batch(eval_windows.batch(first, n), first, mlm, o.seed + 1, corpus.mask_id, corpus.vocab_size);
        to_device(b, device);
        eval_set.emplace_back(b, targets_of(b, mlm));
      }
    model->eval();
    at::Tensor acc = at::zeros({2}, at::kDouble);  // summed loss, targets
    {
      at::NoGradGuard no_grad;
      Autocast ac(o.dtype == "bf16", device.type());
      for (const auto& [b, t] : eval_set) {
        acc[0] += model->loss(b).item<double>() * static_cast<double>(t);
        acc[1] += static_cast<double>(t);
      }
    }
    std::vector<at::Tensor> a{acc};
    comm.allreduce_sum(a);
    model->train();
    return acc[0].item<double>() / std::max(acc[1].item<double>(), 1.0);
  };

  // ---- steps ----
  // Data parallel: the gradients summed over ranks in buckets, overlapped with the backward.
  std::unique_ptr<GradientReducer> reducer;
  if (comm.distributed())
    reducer = std::make_unique<GradientReducer>(model->parameters(), comm, o.bucket_bytes, o.overlap);
  const double t_start = now_s();
  int64_t tokens_done = 0;
  int64_t last_saved = start;  // the newest checkpoint's step (0: none)
  const auto diverged = [&](const char* what, int64_t step) {
    TORCH_CHECK(false, "tempo train: ", what, " is not finite at step ", step,
                " (the run diverged: a lower --lr or a --clip may help; ",
                last_saved > 0 ? "--resume goes on from the checkpoint of step " + std::to_string(last_saved)
                               : std::string("no checkpoint was written yet"),
                ")");
  };
  const Accepting accepting(o.stop);
  for (int64_t step = start + 1; step <= o.steps; ++step) {
    const double t0 = now_s();
    const double lr = learning_rate(step, o.warmup, o.steps, o.lr);
    for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    opt.zero_grad(true);
    // This rank's micro-batches; every count of targets summed over ranks first, so that the
    // gradient is that of the mean over the whole step's targets (as one process would have).
    std::vector<tempo::models::Batch> micro;
    at::Tensor counts = at::zeros({1}, at::kDouble);
    for (int64_t k = 0; k < o.accum; ++k) {
      const int64_t first = (((step - 1) * o.accum + k) * world + rank) * o.batch;
      micro.push_back(
          make_batch(train_windows.batch(first, o.batch), first, mlm, o.seed, corpus.mask_id, corpus.vocab_size));
      counts[0] += static_cast<double>(targets_of(micro.back(), mlm));
    }
    std::vector<at::Tensor> c{counts};
    comm.allreduce_sum(c);
    const double total = counts.item<double>();
    double loss_sum = 0;
    try {
      for (auto& b : micro) {
        if (reducer && &b == &micro.back()) reducer->prepare();
        to_device(b, device);
        const double t = static_cast<double>(targets_of(b, mlm));
        at::Tensor loss;
        {
          Autocast ac(o.dtype == "bf16", device.type());
          loss = model->loss(b);
        }
        if (!std::isfinite(loss.item<double>())) diverged("the loss", step);
        (loss * (t / total)).backward();
        loss_sum += loss.item<double>() * t;
      }
    } catch (const c10::OutOfMemoryError& e) {
      if (step == start + 1)
        user_error("a batch of " + std::to_string(o.batch) + " x " + std::to_string(o.seq) + " does not fit" +
                   (o.budget ? " the budget" : " the device") + " under method " + o.method +
                   " (lower --batch and raise --accum)");
      throw;
    }
    if (reducer) reducer->finish();
    // The loss, and whether any rank was asked to stop: every rank stops after the same step.
    at::Tensor ls = at::tensor({loss_sum, o.stop && o.stop->requested != 0 ? 1.0 : 0.0}, at::kDouble);
    std::vector<at::Tensor> l{ls};
    comm.allreduce_sum(l);
    const double loss = ls[0].item<double>() / total;
    const bool stop = ls[1].item<double>() > 0 && step < o.steps;
    // The norm is logged with or without clipping; one that is not finite stops the run before
    // the step, so that no checkpoint holds the weights it would have made.
    const double norm = o.clip > 0 ? torch::nn::utils::clip_grad_norm_(model->parameters(), o.clip)
                                   : gradient_norm(model->parameters());
    if (!std::isfinite(norm)) diverged("the gradient norm", step);
    try {
      opt.step();
    } catch (const c10::OutOfMemoryError&) {  // AdamW's two moments are made at the first step
      if (step == start + 1)
        user_error("the model's gradients and AdamW's state do not fit" +
                   std::string(o.budget ? " the budget" : " the device") + " beside its weights");
      throw;
    }
    if (device.is_cuda()) torch::cuda::synchronize();
    const double dt = now_s() - t0;
    const int64_t tokens = o.batch * o.seq * o.accum * world;
    tokens_done += tokens;
    double eval = std::nan("");
    if ((o.eval_every > 0 && step % o.eval_every == 0) || step == o.steps || step == 1) eval = evaluate();
    const auto mem = tempo::memory::stats(device);
    summary.peak_bytes = std::max(summary.peak_bytes, mem.peak);
    if (step == start + 1) summary.first_step = step, summary.first_loss = loss, summary.first_eval = eval;
    if (std::isnan(summary.first_eval) && !std::isnan(eval)) summary.first_eval = eval;
    summary.last_step = step, summary.last_loss = loss;
    if (!std::isnan(eval)) summary.last_eval = eval;
    if (lead) {
      char row[256];
      std::snprintf(row, sizeof row, "%lld,%.6f,%.6g,%.1f,%lld,%s,%.6f", static_cast<long long>(step), loss, lr,
                    tokens / dt, static_cast<long long>(mem.current),
                    std::isnan(eval) ? "" : std::to_string(eval).c_str(), norm);
      tempo::models::append_to_file(log.string(), std::string(row) + "\n", "tempo train");
    }
    if (o.progress && lead) {
      const double elapsed = now_s() - t_start;
      const double eta = elapsed / static_cast<double>(step - start) * static_cast<double>(o.steps - step);
      std::fprintf(stderr, "\r\033[Kstep %lld/%lld  loss %.4f  %.0f tokens/s  held %.1f MiB  ETA %.0fs",
                   static_cast<long long>(step), static_cast<long long>(o.steps), loss, tokens / dt,
                   mem.current / 1048576.0, eta);
      std::fflush(stderr);
    }
    if (o.save_every > 0 && (step % o.save_every == 0 || step == o.steps)) {
      if (lead) save_checkpoint(ckdir.string(), step, *model, opt, 2, settings);
      comm.barrier();
      last_saved = step;
    }
    if (stop) {
      if (o.save_every > 0 && last_saved != step) {
        if (lead) save_checkpoint(ckdir.string(), step, *model, opt, 2, settings);
        comm.barrier();
        last_saved = step;
      }
      summary.stopped = true;
      summary.notes.push_back(
          "stopped as asked after step " + std::to_string(step) + " of " + std::to_string(o.steps) + ": " +
          (last_saved == step ? "--resume goes on from its checkpoint" : "no checkpoint of it (--save-every 0)"));
      break;
    }
  }
  if (o.progress && lead) std::fprintf(stderr, "\r\033[K");
  if (reducer)
    summary.notes.push_back("gradients summed in " + std::to_string(reducer->buckets()) + " bucket(s) per step, " +
                            std::to_string(reducer->started_in_backward()) + " started during the backward" +
                            (o.overlap ? "" : " (--no-overlap)"));
  summary.tokens_per_s = tokens_done / std::max(now_s() - t_start, 1e-9);
  return summary;
}

}  // namespace tempo::train
