#include "tempo/models/file_write.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <fcntl.h>
#include <unistd.h>

namespace tempo::models {

namespace {
namespace fs = std::filesystem;

// Writes all n bytes (a write may take fewer, or be interrupted); 0 or the errno.
int write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (w == 0) return EIO;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return 0;
}
}  // namespace

std::string free_space_note(const std::string& path) {
  std::error_code ec;
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  const auto space = fs::space(dir, ec);
  if (ec) return "";
  char text[64];
  std::snprintf(text, sizeof text, "%.1f MiB free on that filesystem",
                static_cast<double>(space.available) / 1048576.0);
  return text;
}

std::string write_failure(const std::string& op, const std::string& path, int err) {
  const std::string space = free_space_note(path);
  return op + ": writing " + path + " failed: " + std::strerror(err) + (space.empty() ? "" : " (" + space + ")");
}

AtomicFile::AtomicFile(std::string path, std::string op) : path_(std::move(path)), op_(std::move(op)) {
  std::error_code ec;
  fs::path target(path_);
  for (int links = 0; links < 40 && fs::is_symlink(target, ec);
       ++links) {  // the file a link names is written, not the link
    const fs::path to = fs::read_symlink(target, ec);
    if (ec) break;
    target = to.is_absolute() ? to : target.parent_path() / to;
  }
  if (fs::exists(target, ec) && !fs::is_regular_file(target, ec)) {
    // /dev/stdout, a pipe, a device: written in place (nothing to rename over)
    fd_ = ::open(target.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  } else {
    tmp_ = target.string() + ".tmp";
    target_ = target.string();
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);  // less the umask, as a stream
  }
  if (fd_ < 0) error_ = errno;
}

AtomicFile::~AtomicFile() {
  if (committed_) return;
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

void AtomicFile::write(const void* data, size_t n) {
  if (error_ == 0 && fd_ >= 0) error_ = write_all(fd_, data, n);
}

void AtomicFile::commit() {
  TORCH_CHECK(!committed_, op_, ": ", path_, " was already written");
  // fsync: EINVAL where the file cannot be synced (a pipe, some filesystems), not a failure
  if (error_ == 0 && ::fsync(fd_) != 0 && errno != EINVAL && errno != EROFS) error_ = errno;
  if (fd_ >= 0) {
    if (::close(fd_) != 0 && error_ == 0) error_ = errno;
    fd_ = -1;
  }
  if (error_ == 0 && !tmp_.empty() && ::rename(tmp_.c_str(), target_.c_str()) != 0) error_ = errno;
  if (error_ != 0) {
    const std::string why = write_failure(op_, path_, error_);  // the free space as it was at the failure
    if (!tmp_.empty()) ::unlink(tmp_.c_str());
    committed_ = true;  // nothing left to clean up
    TORCH_CHECK(false, why);
  }
  committed_ = true;
}

void write_file_atomically(const std::string& path, std::string_view bytes, const std::string& op) {
  AtomicFile f(path, op);
  f.write(bytes);
  f.commit();
}

void append_to_file(const std::string& path, std::string_view bytes, const std::string& op) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0666);
  TORCH_CHECK(fd >= 0, write_failure(op, path, errno));
  int err = write_all(fd, bytes.data(), bytes.size());
  if (::close(fd) != 0 && err == 0) err = errno;
  TORCH_CHECK(err == 0, write_failure(op, path, err));
}

}  // namespace tempo::models
