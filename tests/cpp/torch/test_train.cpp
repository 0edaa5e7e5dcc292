// The trainer's library API (tempo::train::train), as a C++ user calls it: a StopRequest ends a
// run after the step in progress, with a checkpoint from which a resumed run gives the losses of
// a run never stopped; a run folder locked by another run is refused and left as it was.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tempo/models/hf_files.h"
#include "tempo/train/trainer.h"

namespace {

namespace fs = std::filesystem;
using tempo::train::StopRequest;
using tempo::train::TrainOptions;

fs::path scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("tempo_train_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// Pretokenized ids (no tokenizer needed): a repeating pattern with noise, 100 ids.
fs::path corpus(const fs::path& dir) {
  torch::manual_seed(1);
  const at::Tensor ids = (at::arange(4000, at::kLong) % 37 + at::randint(0, 3, {4000}, at::kLong)) % 100;
  const fs::path p = dir / "ids.safetensors";
  tempo::models::write_safetensors(p.string(), {{"ids", ids}, {"meta", at::tensor({100, -1, 0}, at::kLong)}});
  return p;
}

TrainOptions tiny(const fs::path& data, const fs::path& out) {
  TrainOptions o;
  o.model = "gpt2", o.hidden = 32, o.layers = 2, o.heads = 2, o.intermediate = 64, o.positions = 64;
  o.data = data.string(), o.out = out.string();
  o.seq = 16, o.batch = 2, o.steps = 6, o.warmup = 2, o.eval_every = 0, o.eval_batches = 1, o.save_every = 0;
  return o;
}

// The log's (step, loss) cells as printed.
std::vector<std::string> logged_losses(const fs::path& out) {
  std::ifstream in(out / "log.csv");
  std::string line;
  std::getline(in, line);  // the header
  std::vector<std::string> rows;
  while (std::getline(in, line)) rows.push_back(line.substr(0, line.find(',', line.find(',') + 1)));
  return rows;
}

TEST(Trainer, AStopRequestEndsTheRunAfterTheStepAndResumingGivesTheUninterruptedLosses) {
  const fs::path dir = scratch("stop"), data = corpus(dir);
  tempo::train::Communicator one;  // a single process
  const auto whole = tempo::train::train(tiny(data, dir / "whole"), one);
  EXPECT_FALSE(whole.stopped);
  const auto reference = logged_losses(dir / "whole");
  ASSERT_EQ(reference.size(), 6u);

  // Asked before the first step: that step ends, is checkpointed (between --save-every's), and the run returns.
  StopRequest stop;
  stop.requested = 15;
  TrainOptions o = tiny(data, dir / "stopped");
  o.save_every = 4, o.stop = &stop;
  const auto s = tempo::train::train(o, one);
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.last_step, 1);
  EXPECT_FALSE(stop.accepting) << "accepting is only true while the steps run";
  EXPECT_TRUE(fs::exists(dir / "stopped" / "checkpoints" / "step-000000001" / "MANIFEST"));
  ASSERT_FALSE(s.notes.empty());
  EXPECT_NE(s.notes.back().find("stopped as asked after step 1 of 6: --resume goes on from its checkpoint"),
            std::string::npos)
      << s.notes.back();
  o.stop = nullptr, o.resume = true;
  const auto resumed = tempo::train::train(o, one);
  EXPECT_FALSE(resumed.stopped);
  EXPECT_EQ(resumed.last_step, 6);
  EXPECT_EQ(logged_losses(dir / "stopped"), reference);

  // Without checkpoints (save_every 0): it stops all the same, and says there is none.
  StopRequest again;
  again.requested = 2;
  TrainOptions n = tiny(data, dir / "unsaved");
  n.stop = &again;
  const auto u = tempo::train::train(n, one);
  EXPECT_TRUE(u.stopped);
  EXPECT_NE(u.notes.back().find("no checkpoint of it (--save-every 0)"), std::string::npos) << u.notes.back();
  EXPECT_FALSE(fs::exists(dir / "unsaved" / "checkpoints"));
  EXPECT_EQ(logged_losses(dir / "unsaved").size(), 1u);
  fs::remove_all(dir);
}

TEST(Trainer, ARunFolderLockedByAnotherRunIsRefusedAndLeftAsItWas) {
  const fs::path dir = scratch("lock"), data = corpus(dir), out = dir / "run";
  tempo::train::Communicator one;
  TrainOptions o = tiny(data, out);
  o.steps = 2, o.save_every = 2;
  tempo::train::train(o, one);
  const auto before = logged_losses(out);
  // Another run holds the folder (as tempo train does: flock on the folder itself).
  const int fd = ::open(out.c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  for (const bool resume : {true, false}) {
    TrainOptions r = o;
    r.resume = resume, r.steps = 4;
    try {
      tempo::train::train(r, one);
      ADD_FAILURE() << "a locked folder was trained into (resume " << resume << ")";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("another tempo train is running in " + out.string()), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(logged_losses(out), before);
  ::close(fd);  // the other run ends: the folder is free again
  TrainOptions r = o;
  r.resume = true, r.steps = 4;
  EXPECT_EQ(tempo::train::train(r, one).last_step, 4);
  fs::remove_all(dir);
}

}  // namespace
