#include "tempo/train/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include <fcntl.h>
#include <unistd.h>

#include "tempo/models/file_write.h"
#include "tempo/models/hf_files.h"
#include "tempo/train/manifest.h"

namespace tempo::train {

namespace {
namespace fs = std::filesystem;
const char* kOp = "tempo::train checkpoint";
const std::vector<std::string> kFiles = {"model.safetensors", "optimizer.pt", "state.safetensors"};

void fsync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%09lld", static_cast<long long>(step));
  return buf;
}

std::vector<std::pair<int64_t, fs::path>> checkpoints(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("step-", 0) == 0) {
      try {
        out.emplace_back(std::stoll(n.substr(5)), e.path());
      } catch (...) {}
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

// Named parameters and buffers of the model.
std::vector<std::pair<std::string, at::Tensor>> model_tensors(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> t;
  for (const auto& p : m.named_parameters()) t.emplace_back("param." + p.key(), p.value());
  for (const auto& b : m.named_buffers()) t.emplace_back("buffer." + b.key(), b.value());
  return t;
}

}  // namespace

namespace {
// The checkpoint's files, written into `tmp` (each fsynced).
void write_checkpoint_files(const fs::path& tmp, int64_t step, torch::nn::Module& model,
                            torch::optim::Optimizer& optimizer, const std::string& settings) {
  tempo::models::write_safetensors((tmp / "model.safetensors").string(), model_tensors(model));
  {
    // Streamed through an AtomicFile, whose write never throws: torch's archive writer must not
    // see an exception (its destructor finishes the file and would terminate the process); a
    // failure (a full disk) is raised by commit() instead.
    tempo::models::AtomicFile f((tmp / "optimizer.pt").string(), kOp);
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    archive.save_to([&f](const void* data, size_t n) {
      f.write(data, n);
      return n;
    });
    f.commit();
  }
  std::vector<std::pair<std::string, at::Tensor>> state{{"step", at::tensor({step}, at::kLong)}};
  if (!settings.empty()) {  // as bytes: the manifest's checksum covers them with the rest
    at::Tensor bytes = at::empty({static_cast<int64_t>(settings.size())}, at::kByte);
    std::copy(settings.begin(), settings.end(), bytes.data_ptr<uint8_t>());
    state.emplace_back("settings", bytes);
  }
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    state.emplace_back("rng.cpu", gen.get_state());
  }
  if (at::hasCUDA())
    for (int64_t d = 0; d < static_cast<int64_t>(at::getNumGPUs()); ++d) {
      auto gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d)));
      std::lock_guard<std::mutex> lock(gen.mutex());
      state.emplace_back("rng.cuda." + std::to_string(d), gen.get_state());
    }
  tempo::models::write_safetensors((tmp / "state.safetensors").string(), state);
  tempo::models::write_file_atomically((tmp / "MANIFEST").string(), make_manifest(tmp.string(), kFiles), kOp);
  fsync_path(tmp);
}
}  // namespace

std::string save_checkpoint(const std::string& dir, int64_t step, torch::nn::Module& model,
                            torch::optim::Optimizer& optimizer, int keep, const std::string& settings) {
  const fs::path root(dir), final_path = root / step_name(step), tmp = root / (".tmp-" + step_name(step));
  std::error_code ec;
  fs::create_directories(root, ec);
  TORCH_CHECK(!ec, kOp, ": cannot create ", root.string(), ": ", ec.message());
  // What a save cut short by a kill left behind (a failed one removes its own).
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.path().filename().string().rfind(".tmp-step-", 0) == 0) fs::remove_all(e.path(), ec);
  fs::create_directories(tmp, ec);
  TORCH_CHECK(!ec, kOp, ": cannot create ", tmp.string(), ": ", ec.message());
  try {
    write_checkpoint_files(tmp, step, model, optimizer, settings);
    fs::remove_all(final_path);
    fs::rename(tmp, final_path);
  } catch (const fs::filesystem_error& e) {
    fs::remove_all(tmp, ec);  // the previous checkpoints stay as they were
    TORCH_CHECK(false, kOp, ": ", e.what());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  fsync_path(root);
  const auto all = checkpoints(root);
  for (size_t i = static_cast<size_t>(std::max(keep, 1)); i < all.size(); ++i) fs::remove_all(all[i].second);
  return final_path.string();
}

std::optional<int64_t> load_latest_checkpoint(const std::string& dir, torch::nn::Module& model,
                                              torch::optim::Optimizer& optimizer, std::vector<std::string>* skipped,
                                              std::string* settings) {
  for (const auto& [step, path] : checkpoints(dir)) {
    const std::string why = verify_manifest(path.string(), kFiles);
    if (!why.empty()) {
      if (skipped) skipped->push_back(path.string() + ": " + why);
      continue;
    }
    auto tensors = tempo::models::read_safetensors((path / "model.safetensors").string());
    at::NoGradGuard no_grad;
    for (auto& [name, t] : model_tensors(model)) {
      const auto it = tensors.find(name);
      TORCH_CHECK(it != tensors.end() && it->second.sizes() == t.sizes(), kOp, ": ", path.string(), " does not hold ",
                  name, " of this model (a checkpoint of another model?)");
      t.copy_(it->second);
    }
    torch::load(optimizer, (path / "optimizer.pt").string());
    auto state = tempo::models::read_safetensors((path / "state.safetensors").string());
    TORCH_CHECK(state.at("step").item<int64_t>() == step, kOp, ": ", path.string(), " holds another step");
    if (settings) {
      const auto it = state.find("settings");
      settings->clear();
      if (it != state.end() && it->second.scalar_type() == at::kByte && it->second.dim() == 1) {
        const at::Tensor b = it->second.contiguous();
        settings->assign(reinterpret_cast<const char*>(b.data_ptr<uint8_t>()), static_cast<size_t>(b.numel()));
      }
    }
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state.at("rng.cpu"));
    }
    if (at::hasCUDA())
      for (int64_t d = 0; d < static_cast<int64_t>(at::getNumGPUs()); ++d) {
        const auto it = state.find("rng.cuda." + std::to_string(d));
        if (it == state.end()) continue;
        auto gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d)));
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(it->second);
      }
    return step;
  }
  return std::nullopt;
}

}  // namespace tempo::train
