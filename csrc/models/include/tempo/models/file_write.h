// Writing files so that a full disk, a missing permission or a kill mid-write never leaves a
// part of a file where a whole one is expected, and never passes silently: checkpoints,
// safetensors, config.json, the trainer's log and tempo bench's outputs all go through here.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tempo::models {

// A file written under a temporary name (path + ".tmp") and renamed over `path` by commit(),
// after an fsync: `path` holds either what it held before or the whole new content (a
// symbolic link: the file it names; something other than a file, such as /dev/stdout or a
// pipe: written in place). write() never throws (so it can sit behind a serialiser that must
// not see an exception); the first failure is kept, and commit() raises it as a c10::Error
// naming `op`, the path, the system's reason and the space left on that filesystem. Destroyed
// without a commit (an exception on the way), the temporary file is removed.
class AtomicFile {
 public:
  AtomicFile(std::string path, std::string op);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();
  void write(const void* data, size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  void commit();

 private:
  std::string path_, op_;
  std::string tmp_, target_;  // empty where written in place
  int fd_ = -1;
  int error_ = 0;  // errno of the first failure
  bool committed_ = false;
};

// The whole of `bytes` as the file at `path`, through an AtomicFile.
void write_file_atomically(const std::string& path, std::string_view bytes, const std::string& op);

// Appends `bytes` to `path` (created if missing), flushed to the file before returning;
// a failure raises as AtomicFile::commit does. For logs that grow by a line at a time.
void append_to_file(const std::string& path, std::string_view bytes, const std::string& op);

// "<op>: writing <path> failed: <strerror(err)> (<N> MiB free on that filesystem)".
std::string write_failure(const std::string& op, const std::string& path, int err);
// "<N> MiB free on that filesystem" for the folder of `path`, or "" where it cannot be read.
std::string free_space_note(const std::string& path);

}  // namespace tempo::models
