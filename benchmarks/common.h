// Helpers shared by the benchmarks: argument lists, timing two implementations side by side,
// and CSV / JSON output.
#pragma once

#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace bench {

// The non-empty items of a comma-separated list.
inline std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

inline std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> out;
  for (const auto& item : split(s)) out.push_back(std::stoll(item));
  return out;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Milliseconds of f(), synchronising the device around it.
inline double time_ms(const std::function<void()>& f, bool cuda) {
  if (cuda) torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  f();
  if (cuda) torch::cuda::synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Medians of `reps` runs of a and b, alternated (a, b, a, b, ...) after one warm-up each, so
// that both see the same machine state.
inline std::pair<double, double> time_pair(const std::function<void()>& a, const std::function<void()>& b, int reps,
                                           bool cuda) {
  time_ms(a, cuda);
  time_ms(b, cuda);
  std::vector<double> ta, tb;
  for (int r = 0; r < reps; ++r) {
    ta.push_back(time_ms(a, cuda));
    tb.push_back(time_ms(b, cuda));
  }
  return {median(ta), median(tb)};
}

// Rows of named values written as CSV and as a JSON list of objects.
class Records {
 public:
  void add(std::vector<std::pair<std::string, std::string>> fields) { rows_.push_back(std::move(fields)); }
  static std::string str(const std::string& s) { return "\"" + s + "\""; }
  template <typename T>
  static std::string num(T v) {
    std::ostringstream o;
    o << v;
    return o.str();
  }
  void write_csv(const std::string& path) const {
    if (path.empty() || rows_.empty()) return;
    std::ofstream f(path);
    for (size_t i = 0; i < rows_[0].size(); ++i) f << (i ? "," : "") << rows_[0][i].first;
    f << "\n";
    for (const auto& r : rows_) {
      for (size_t i = 0; i < r.size(); ++i) {
        std::string v = r[i].second;
        if (!v.empty() && v.front() == '"') v = v.substr(1, v.size() - 2);
        f << (i ? "," : "") << v;
      }
      f << "\n";
    }
  }
  void write_json(const std::string& path) const {
    if (path.empty()) return;
    std::ofstream f(path);
    f << "[";
    for (size_t k = 0; k < rows_.size(); ++k) {
      f << (k ? "," : "") << "\n  {";
      for (size_t i = 0; i < rows_[k].size(); ++i)
        f << (i ? ", " : "") << "\"" << rows_[k][i].first << "\": " << rows_[k][i].second;
      f << "}";
    }
    f << "\n]\n";
  }

 private:
  std::vector<std::vector<std::pair<std::string, std::string>>> rows_;
};

}  // namespace bench
