#include "args.h"

#include <algorithm>
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
  } catch (...) {
  }
  if (!ok || x < min)
    throw std::invalid_argument(command + ": " + flag + " must be " +
                                (min == 1 ? std::string("a positive integer") : "an integer >= " + std::to_string(min)) +
                                ", got '" + value + "'");
  return x;
}

}  // namespace tempo::tools
