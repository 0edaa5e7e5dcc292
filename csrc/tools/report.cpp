// Output of the command line: `tempo bench`'s table, JSON and CSV rows, and the SVG charts.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "bench.h"
#include "tempo/models/file_write.h"

namespace tempo::tools {

namespace {
double mib(int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }
const BenchResult* eager_of(const std::vector<BenchResult>& rs) {
  for (const auto& r : rs)
    if (r.method == "eager") return &r;
  return nullptr;
}
std::string ratio(double a, double b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", b > 0 ? a / b : 0.0);
  return buf;
}
// A measured ratio and its spread: "1.03x ±2%".
std::string ratio_spread(double r, double spread) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.2fx ±%.0f%%", r, 100.0 * spread);
  return buf;
}
// Text for an SVG element: a run's folder name may hold &, < or >.
std::string xml_text(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (c == '&')
      out += "&amp;";
    else if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else
      out += c;
  }
  return out;
}
}  // namespace

void print_table(const std::vector<BenchResult>& rs, bool budget) {
  if (rs.empty()) return;
  const BenchResult* e = eager_of(rs);
  std::printf(
      "%s, seq %lld, batch %lld, %s, %s; time: %d interleaved rounds, ratios the median of the rounds' "
      "(± half their interquartile range)\n",
      rs[0].model.c_str(), (long long)rs[0].seq, (long long)rs[0].batch, rs[0].dtype.c_str(), rs[0].device.c_str(),
      rs[0].rounds);
  // Beyond what the step starts with (weights, optimizer state), the peak of forward +
  // backward (where the methods differ) apart from the optimizer step's (the same for all).
  std::printf("%-22s %14s %8s %14s %8s %13s %10s %11s %12s", "method", "activations", "vs eager", "fwd+bwd peak",
              "vs eager", "optim peak", "step ms", "tokens/s", "vs eager");
  if (budget) std::printf(" %9s %8s %14s %12s", "max batch", "vs eager", "tokens/s @max", "vs eager");
  std::printf("\n");
  for (const auto& r : rs) {
    std::printf("%-22s %10.1f MiB %8s %10.1f MiB %8s %9.1f MiB %10.1f %11.1f %12s", r.method.c_str(),
                mib(r.activation_bytes), e ? ratio(r.activation_bytes, e->activation_bytes).c_str() : "-",
                mib(r.train_peak_bytes), e ? ratio(r.train_peak_bytes, e->train_peak_bytes).c_str() : "-",
                mib(r.optimizer_peak_bytes), r.step_ms, r.tokens_per_s,
                e ? ratio_spread(r.speedup, r.speedup_spread).c_str() : "-");
    if (budget)
      std::printf(" %9lld %8s %14.1f %12s", (long long)r.max_batch.value_or(0),
                  e && e->max_batch ? ratio(r.max_batch.value_or(0), *e->max_batch).c_str() : "-",
                  r.max_batch_tokens_per_s,
                  e ? ratio_spread(r.max_batch_speedup, r.max_batch_speedup_spread).c_str() : "-");
    std::printf("\n");
  }
}

void print_json(const std::vector<BenchResult>& rs) {
  std::printf("[");
  for (size_t i = 0; i < rs.size(); ++i) {
    const auto& r = rs[i];
    std::printf(
        "%s\n  {\"model\": \"%s\", \"seq\": %lld, \"dtype\": \"%s\", \"device\": \"%s\", \"method\": \"%s\", "
        "\"batch\": %lld, \"activation_bytes\": %lld, \"peak_bytes\": %lld, \"train_peak_bytes\": %lld, "
        "\"optimizer_peak_bytes\": %lld, \"rounds\": %d, \"step_ms\": %.3f, "
        "\"tokens_per_s\": %.3f, \"speedup\": %.4f, \"speedup_spread\": %.4f, \"max_batch\": %s, "
        "\"max_batch_tokens_per_s\": %s, \"max_batch_spread\": %s, \"max_batch_speedup\": %s, "
        "\"max_batch_speedup_spread\": %s, \"layer_bytes_moved\": %lld}",
        i ? "," : "", r.model.c_str(), (long long)r.seq, r.dtype.c_str(), r.device.c_str(), r.method.c_str(),
        (long long)r.batch, (long long)r.activation_bytes, (long long)r.peak_bytes, (long long)r.train_peak_bytes,
        (long long)r.optimizer_peak_bytes, r.rounds, r.step_ms, r.tokens_per_s, r.speedup, r.speedup_spread,
        r.max_batch ? std::to_string(*r.max_batch).c_str() : "null",
        r.max_batch ? std::to_string(r.max_batch_tokens_per_s).c_str() : "null",
        r.max_batch ? std::to_string(r.max_batch_spread).c_str() : "null",
        r.max_batch ? std::to_string(r.max_batch_speedup).c_str() : "null",
        r.max_batch ? std::to_string(r.max_batch_speedup_spread).c_str() : "null", (long long)r.layer_bytes_moved);
  }
  std::printf("\n]\n");
}

void append_csv(const std::string& path, const std::vector<BenchResult>& rs) {
  const bool fresh = !std::ifstream(path).good();
  std::ostringstream f;
  if (fresh)
    f << "model,seq,dtype,device,method,batch,activation_bytes,peak_bytes,train_peak_bytes,optimizer_peak_bytes,"
         "rounds,step_ms,tokens_per_s,speedup,speedup_spread,max_batch,max_batch_tokens_per_s,max_batch_spread,"
         "max_batch_speedup,max_batch_speedup_spread,layer_bytes_moved\n";
  for (const auto& r : rs)
    f << r.model << "," << r.seq << "," << r.dtype << "," << r.device << "," << r.method << "," << r.batch << ","
      << r.activation_bytes << "," << r.peak_bytes << "," << r.train_peak_bytes << "," << r.optimizer_peak_bytes << ","
      << r.rounds << "," << r.step_ms << "," << r.tokens_per_s << "," << r.speedup << "," << r.speedup_spread << ","
      << (r.max_batch ? std::to_string(*r.max_batch) : "") << ","
      << (r.max_batch ? std::to_string(r.max_batch_tokens_per_s) : "") << ","
      << (r.max_batch ? std::to_string(r.max_batch_spread) : "") << ","
      << (r.max_batch ? std::to_string(r.max_batch_speedup) : "") << ","
      << (r.max_batch ? std::to_string(r.max_batch_speedup_spread) : "") << "," << r.layer_bytes_moved << "\n";
  tempo::models::append_to_file(path, f.str(), "tempo bench: --csv");
}

// Bar charts side by side, one bar per label, each bar's value (and note) written beside it.
void write_bar_charts(const std::string& path, const std::string& title, const std::vector<std::string>& labels,
                      const std::vector<BarChart>& charts) {
  std::ostringstream f;
  const int bar = 26, gap = 10, left = 150, width = 360, top = 70, pitch = left + width + 80;
  const int chart_h = static_cast<int>(labels.size()) * (bar + gap);
  const int W = pitch * static_cast<int>(charts.size()), H = top + chart_h + 60;
  f << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"13\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  f << "<text x=\"20\" y=\"28\" font-size=\"17\" font-weight=\"bold\">" << title << "</text>\n";
  const char* colors[] = {"#7f7f7f", "#bcbd22", "#1f77b4", "#d62728", "#9467bd", "#2ca02c", "#ff7f0e", "#17becf"};
  for (size_t c = 0; c < charts.size(); ++c) {
    const auto& chart = charts[c];
    const int x0 = left + pitch * static_cast<int>(c);
    double vmax = 0;
    for (double v : chart.values) vmax = std::max(vmax, v);
    f << "<text x=\"" << x0 - left + 20 << "\" y=\"" << top - 14 << "\" font-weight=\"bold\">" << chart.title
      << "</text>\n";
    for (size_t i = 0; i < labels.size() && i < chart.values.size(); ++i) {
      const double v = chart.values[i];
      const int y = top + static_cast<int>(i) * (bar + gap);
      const int w = vmax > 0 ? static_cast<int>(width * v / vmax) : 0;
      f << "<text x=\"" << x0 - 8 << "\" y=\"" << y + bar * 0.7 << "\" text-anchor=\"end\">" << labels[i]
        << "</text>\n";
      f << "<rect x=\"" << x0 << "\" y=\"" << y << "\" width=\"" << std::max(w, 1) << "\" height=\"" << bar
        << "\" fill=\"" << colors[i % 8] << "\"/>\n";
      std::ostringstream label;
      label.precision(1);
      label << std::fixed << v;
      if (i < chart.notes.size() && !chart.notes[i].empty()) label << " (" << chart.notes[i] << ")";
      f << "<text x=\"" << x0 + w + 6 << "\" y=\"" << y + bar * 0.7 << "\">" << label.str() << "</text>\n";
    }
  }
  f << "</svg>\n";
  tempo::models::write_file_atomically(path, f.str(), "tempo: the plot");
}

void write_line_charts(const std::string& path, const std::string& title, const std::vector<LineChart>& charts) {
  std::ostringstream f;
  const int left = 70, width = 420, height = 260, top = 60, pitch = left + width + 40;
  const int W = pitch * static_cast<int>(std::max<size_t>(charts.size(), 1)), H = top + height + 90;
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#7f7f7f", "#bcbd22", "#17becf"};
  f << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  f << "<text x=\"20\" y=\"26\" font-size=\"16\" font-weight=\"bold\">" << title << "</text>\n";
  for (size_t c = 0; c < charts.size(); ++c) {
    const auto& ch = charts[c];
    const int x0 = left + pitch * static_cast<int>(c);
    double xmin = 1e300, xmax = -1e300, ymin = 1e300, ymax = -1e300;
    for (const auto& s : ch.series)
      for (const auto& [x, y] : s.points) {
        xmin = std::min(xmin, x), xmax = std::max(xmax, x), ymin = std::min(ymin, y), ymax = std::max(ymax, y);
      }
    if (xmin > xmax) xmin = 0, xmax = 1, ymin = 0, ymax = 1;
    if (xmax == xmin) xmax = xmin + 1;
    if (ymax == ymin) ymax = ymin + 1;
    const auto X = [&](double x) { return x0 + (x - xmin) / (xmax - xmin) * width; };
    const auto Y = [&](double y) { return top + height - (y - ymin) / (ymax - ymin) * height; };
    f << "<text x=\"" << x0 << "\" y=\"" << top - 12 << "\" font-weight=\"bold\">" << ch.title << "</text>\n";
    f << "<rect x=\"" << x0 << "\" y=\"" << top << "\" width=\"" << width << "\" height=\"" << height
      << "\" fill=\"none\" stroke=\"#999\"/>\n";
    for (int k = 0; k <= 4; ++k) {  // y ticks
      const double y = ymin + (ymax - ymin) * k / 4.0;
      char label[32];
      std::snprintf(label, sizeof label, "%.3g", y);
      f << "<text x=\"" << x0 - 6 << "\" y=\"" << Y(y) + 4 << "\" text-anchor=\"end\">" << label << "</text>\n";
    }
    char xl[64];
    std::snprintf(xl, sizeof xl, "%.0f", xmin);
    f << "<text x=\"" << x0 << "\" y=\"" << top + height + 16 << "\">" << xl << "</text>\n";
    std::snprintf(xl, sizeof xl, "%.0f", xmax);
    f << "<text x=\"" << x0 + width << "\" y=\"" << top + height + 16 << "\" text-anchor=\"end\">" << xl
      << "</text>\n<text x=\"" << x0 + width / 2 << "\" y=\"" << top + height + 32 << "\" text-anchor=\"middle\">"
      << ch.x_label << "</text>\n";
    for (size_t s = 0; s < ch.series.size(); ++s) {
      const auto& se = ch.series[s];
      f << "<polyline fill=\"none\" stroke-width=\"1.5\" stroke=\"" << colors[s % 8] << "\" points=\"";
      for (const auto& [x, y] : se.points) f << X(x) << "," << Y(y) << " ";
      f << "\"/>\n";
      f << "<text x=\"" << x0 + 10 << "\" y=\"" << top + height + 50 + 14 * static_cast<int>(s) << "\" fill=\""
        << colors[s % 8] << "\">" << xml_text(se.name) << "</text>\n";
    }
  }
  f << "</svg>\n";
  tempo::models::write_file_atomically(path, f.str(), "tempo: the plot");
}

// Activation memory per method, and throughput per method (at the largest batch when there
// is a budget, else at the given batch).
void write_svg(const std::string& path, const std::vector<BenchResult>& rs, const std::string& title) {
  const bool budget = !rs.empty() && rs[0].max_batch.has_value();
  std::vector<std::string> labels;
  BarChart act{"activation memory after forward (MiB, lower is better)", {}, {}};
  BarChart tps{
      budget ? "tokens/s at the largest batch in budget (higher is better)" : "tokens/s (higher is better)", {}, {}};
  for (const auto& r : rs) {
    labels.push_back(r.method);
    act.values.push_back(mib(r.activation_bytes));
    tps.values.push_back(budget ? r.max_batch_tokens_per_s : r.tokens_per_s);
    tps.notes.push_back(budget ? "batch " + std::to_string(r.max_batch.value_or(0)) : "");
  }
  write_bar_charts(path, title, labels, {act, tps});
}

}  // namespace tempo::tools
