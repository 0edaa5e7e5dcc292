// SVG charts of the command line's results: bar charts (tempo bench, tempo slim) and line
// charts (tempo train's loss curves).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace tempo::tools {

// Bar charts side by side: one bar per label in each.
struct BarChart {
  std::string title;
  std::vector<double> values;
  std::vector<std::string> notes;  // written after a bar's value, in parentheses (may be empty)
};
void write_bar_charts(const std::string& path, const std::string& title, const std::vector<std::string>& labels,
                      const std::vector<BarChart>& charts);

// Line charts side by side, each with one or more named series of (x, y) points.
struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;
};
struct LineChart {
  std::string title, x_label;
  std::vector<Series> series;
};
void write_line_charts(const std::string& path, const std::string& title, const std::vector<LineChart>& charts);

}  // namespace tempo::tools
