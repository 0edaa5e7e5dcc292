// Command-line values shared by the `tempo` commands: comma lists, checked integers, output files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tempo::tools {

// "a,b,,c" -> {"a", "b", "c"}.
std::vector<std::string> split_list(const std::string& s);
// `value` as an integer >= min, else std::invalid_argument "<command>: <flag> must be ...".
int64_t parse_int(const std::string& command, const std::string& flag, const std::string& value, int64_t min = 1);
// An output file named by `flag`, checked before any work is done: its folder must exist, and
// with svg its name must end in .svg. Else std::invalid_argument "<command>: ...".
void check_output(const std::string& command, const std::string& flag, const std::string& path, bool svg = false);
// `flag` as the command line spells it now: an earlier spelling (--policies, --policy) is
// taken with a warning on stderr naming the new one (docs/architecture.md's glossary: a method).
std::string current_flag(const std::string& command, const std::string& flag);

}  // namespace tempo::tools
