// Command-line values shared by the `tempo` commands: comma lists and checked integers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tempo::tools {

// "a,b,,c" -> {"a", "b", "c"}.
std::vector<std::string> split_list(const std::string& s);
// `value` as an integer >= min, else std::invalid_argument "<command>: <flag> must be ...".
int64_t parse_int(const std::string& command, const std::string& flag, const std::string& value, int64_t min = 1);

}  // namespace tempo::tools
