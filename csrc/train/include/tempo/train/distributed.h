// Data parallelism on torch.distributed's c10d: a Communicator over ProcessGroupGloo (CPU),
// with the rendezvous of torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
// through c10d's TCPStore. Built when Gloo's headers are present (Debian: libgloo-dev; torch's
// wheels ship its library but not its headers); otherwise creating one raises.
#pragma once

#include <memory>
#include <string>

#include "tempo/train/trainer.h"

namespace tempo::train {

bool gloo_available();
// Joins the group `world` processes form at addr:port (rank 0 serves the store).
std::unique_ptr<Communicator> make_gloo_communicator(int rank, int world, const std::string& addr, int port);

}  // namespace tempo::train
