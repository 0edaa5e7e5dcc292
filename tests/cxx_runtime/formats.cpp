// Formats a number into a message, as every argument check of tempo's ops does.
#include <sstream>
#include <string>

std::string tempo_format(long x) {
  std::ostringstream s;
  s << "must have shape [" << x << "]";
  return s.str();
}
