// CSV, SVG and the progress line.
#include "torchspeed/monitor/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "torchspeed/io/safetensors.h"
#include "torchspeed/base/error.h"

namespace torchspeed::monitor {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return concat(t / 3600, "h", (t % 3600) / 60, "m");
  if (t >= 60) return concat(t / 60, "m", t % 60, "s");
  return concat(t, "s");
}

namespace {
constexpr const char* kCsvHeader = "step,samples,loss,val_loss,lr,loss_scale,grad_norm,tokens_per_s,mfu";
}

MetricsCsv::MetricsCsv(const std::string& path) : out_(path), path_(path) {
  TS_CHECK(out_.good(), "cannot write metrics to '", path, "'");
  out_ << kCsvHeader << "\n";
}

MetricsCsv::MetricsCsv(const std::string& path, int64_t resume_after_step) : path_(path) {
  std::vector<std::string> kept;
  {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line == kCsvHeader) continue;
      std::vector<std::string> f;
      std::stringstream ss(line);
      for (std::string x; std::getline(ss, x, ',');) f.push_back(x);
      if (f.size() < 9) continue;
      StepMetrics m;
      try {
        m.step = std::stoll(f[0]);
        m.samples = std::stoll(f[1]);
        m.loss = std::stod(f[2]);
        if (!f[3].empty()) m.val_loss = std::stod(f[3]);
        m.lr = std::stod(f[4]);
        m.loss_scale = std::stod(f[5]);
        m.grad_norm = std::stod(f[6]);
        m.tokens_per_s = std::stod(f[7]);
        m.mfu = std::stod(f[8]);
      } catch (const std::exception&) {
        continue;  // a damaged row (the run was killed while writing it)
      }
      if (m.step > resume_after_step) continue;
      previous_.push_back(m);
      kept.push_back(line);
    }
  }
  out_.open(path, std::ios::trunc);
  TS_CHECK(out_.good(), "cannot write metrics to '", path, "'");
  out_ << kCsvHeader << "\n";
  for (const auto& l : kept) out_ << l << "\n";
  out_.flush();
}

void MetricsCsv::write(const StepMetrics& m) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%ld,%ld,%.6f,%s,%.6g,%.6g,%.6g,%.1f,%.4f\n", static_cast<long>(m.step),
                static_cast<long>(m.samples), m.loss, m.val_loss ? concat(*m.val_loss).c_str() : "",
                m.lr, m.loss_scale, m.grad_norm, m.tokens_per_s, m.mfu);
  out_ << buf;
  out_.flush();
}

void write_loss_svg(const std::string& path, const std::vector<StepMetrics>& h,
                    std::optional<double> baseline, const std::string& title) {
  const double W = 720, H = 400, L = 60, R = 20, T = 40, B = 50;
  double max_step = 1, lo = 1e30, hi = -1e30;
  for (const auto& m : h) {
    max_step = std::max<double>(max_step, m.step);
    lo = std::min(lo, m.loss);
    hi = std::max(hi, m.loss);
    if (m.val_loss) {
      lo = std::min(lo, *m.val_loss);
      hi = std::max(hi, *m.val_loss);
    }
  }
  if (baseline) {
    lo = std::min(lo, *baseline);
    hi = std::max(hi, *baseline);
  }
  if (!(hi > lo)) {
    hi = lo + 1;
  }
  const double pad = (hi - lo) * 0.05;
  lo -= pad;
  hi += pad;
  auto X = [&](double s) { return L + (W - L - R) * s / max_step; };
  auto Y = [&](double v) { return T + (H - T - B) * (hi - v) / (hi - lo); };
  std::ostringstream o;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
    << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n"
    << "<text x='" << W / 2 << "' y='22' text-anchor='middle' font-size='15'>" << title << "</text>\n"
    << "<line x1='" << L << "' y1='" << H - B << "' x2='" << W - R << "' y2='" << H - B << "' stroke='black'/>\n"
    << "<line x1='" << L << "' y1='" << T << "' x2='" << L << "' y2='" << H - B << "' stroke='black'/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double v = lo + (hi - lo) * i / 4, s = max_step * i / 4;
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.2f", v);
    o << "<text x='" << L - 6 << "' y='" << Y(v) + 4 << "' text-anchor='end'>" << buf << "</text>\n"
      << "<line x1='" << L << "' y1='" << Y(v) << "' x2='" << W - R << "' y2='" << Y(v) << "' stroke='#eee'/>\n"
      << "<text x='" << X(s) << "' y='" << H - B + 18 << "' text-anchor='middle'>" << static_cast<int64_t>(s) << "</text>\n";
  }
  o << "<text x='" << (L + W - R) / 2 << "' y='" << H - 10 << "' text-anchor='middle'>step</text>\n";
  o << "<text x='16' y='" << (T + H - B) / 2 << "' transform='rotate(-90 16 " << (T + H - B) / 2
    << ")' text-anchor='middle'>loss (nats/token)</text>\n";
  o << "<polyline fill='none' stroke='#1f77b4' stroke-width='1.5' points='";
  for (const auto& m : h) o << X(m.step) << "," << Y(m.loss) << " ";
  o << "'/>\n<polyline fill='none' stroke='#d62728' stroke-width='2' points='";
  for (const auto& m : h)
    if (m.val_loss) o << X(m.step) << "," << Y(*m.val_loss) << " ";
  o << "'/>\n";
  for (const auto& m : h)
    if (m.val_loss) o << "<circle cx='" << X(m.step) << "' cy='" << Y(*m.val_loss) << "' r='3' fill='#d62728'/>\n";
  if (baseline) {
    o << "<line x1='" << L << "' y1='" << Y(*baseline) << "' x2='" << W - R << "' y2='" << Y(*baseline)
      << "' stroke='gray' stroke-dasharray='5,4'/>\n";
  }
  o << "<text x='" << W - R - 170 << "' y='" << T + 14 << "' fill='#1f77b4'>train loss</text>\n"
    << "<text x='" << W - R - 170 << "' y='" << T + 30 << "' fill='#d62728'>validation loss</text>\n";
  if (baseline) o << "<text x='" << W - R - 170 << "' y='" << T + 46 << "' fill='gray'>bigram baseline</text>\n";
  o << "</svg>\n";
  io::write_file_atomic(path, o.str());
}

Progress::Progress(int64_t total, int64_t interval, int64_t first_step)
    : total_(total), interval_(std::max<int64_t>(1, interval)), first_(first_step), tty_(::isatty(1) != 0) {
  // Under mpirun the ranks' stdout is a pseudo-terminal even when the user's is a pipe or file;
  // `torchspeed train` passes on what the user's stdout is.
  if (const char* v = std::getenv("TORCHSPEED_STDOUT_TTY")) tty_ = std::string(v) == "1";
}

void Progress::update(const StepMetrics& m, double elapsed) {
  if (m.val_loss) last_val_ = m.val_loss;
  const bool log_line = m.step % interval_ == 0 || m.step == total_ || m.val_loss;
  if (!tty_ && !log_line) return;
  const double eta = m.step > first_ ? elapsed / static_cast<double>(m.step - first_) * (total_ - m.step) : 0;
  char buf[512];
  const int width = 24;
  const int filled = static_cast<int>(width * m.step / std::max<int64_t>(1, total_));
  std::string bar(static_cast<size_t>(filled), '#');
  bar.append(static_cast<size_t>(width - filled), '.');
  std::snprintf(buf, sizeof(buf),
                "[%s] step %ld/%ld | loss %.4f | val %s | lr %.2e | scale %g | %.1fk tok/s | MFU %.1f%% | ETA %s",
                bar.c_str(), static_cast<long>(m.step), static_cast<long>(total_), m.loss,
                last_val_ ? concat(std::round(*last_val_ * 10000) / 10000).c_str() : "-", m.lr, m.loss_scale,
                m.tokens_per_s / 1000, 100 * m.mfu, format_duration(eta).c_str());
  if (tty_) {
    std::printf("\r%s\033[K", buf);
    if (log_line && m.val_loss) std::printf("\n");
  } else {
    std::printf("%s\n", buf);
  }
  std::fflush(stdout);
}

void Progress::finish() {
  if (tty_) std::printf("\n");
  std::fflush(stdout);
}

}  // namespace torchspeed::monitor
