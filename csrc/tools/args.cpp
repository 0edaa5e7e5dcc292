#include "args.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <stdexcept>

namespace tempo::tools {

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= s.size()) {
    const size_t j = std::min(s.find(',', i), s.size());
    if (j > i) out.push_back(s.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

int64_t parse_int(const std::string& command, const std::string& flag, const std::string& value, int64_t min) {
  int64_t x = 0;
  bool ok = false;
  try {
    size_t pos = 0;
    x = std::stoll(value, &pos);
    ok = pos == value.size();
  } catch (...) {}
  if (!ok || x < min)
    throw std::invalid_argument(
        command + ": " + flag + " must be " +
        (min == 1 ? std::string("a positive integer") : "an integer >= " + std::to_string(min)) + ", got '" + value +
        "'");
  return x;
}

void check_output(const std::string& command, const std::string& flag, const std::string& path, bool svg) {
  if (svg && (path.size() < 4 || path.substr(path.size() - 4) != ".svg"))
    throw std::invalid_argument(command + ": " + flag + " writes SVG; give a file name ending in .svg, got '" + path +
                                "'");
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  if (!folder.empty() && !std::filesystem::is_directory(folder))
    throw std::invalid_argument(command + ": cannot write " + flag + " " + path + ": " + folder.string() +
                                " is not a folder");
}

std::string current_flag(const std::string& command, const std::string& flag) {
  const std::string now = flag == "--policies" ? "--methods" : flag == "--policy" ? "--method" : flag;
  if (now != flag)
    std::fprintf(stderr, "%s: %s is deprecated; it is spelled %s (a method, as the rest of tempo says)\n",
                 command.c_str(), flag.c_str(), now.c_str());
  return now;
}

}  // namespace tempo::tools
