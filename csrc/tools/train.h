// `tempo train` (the trainer of tempo/train/trainer.h on the command line) and `tempo plot`
// (loss curves of runs' logs).
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "tempo/train/trainer.h"

namespace tempo::tools {

struct TrainCommand {
  tempo::train::TrainOptions options;
  std::string plot;               // an SVG of this run's loss curves, written at the end
  int nproc = 1;                  // data-parallel processes started on this machine
  std::vector<std::string> args;  // as given (the children of --nproc get them without --nproc)
};

TrainCommand parse_train_args(const std::vector<std::string>& args);  // std::invalid_argument on bad input
int run_train(const TrainCommand& command);
void print_train_usage(FILE* out);
// `tempo plot OUT.svg RUN_DIR...`: train and eval loss of each run's log.csv, side by side.
int run_plot(const std::vector<std::string>& args);

}  // namespace tempo::tools
