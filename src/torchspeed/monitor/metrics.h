// Training metrics: a CSV file with one row per logged step, an SVG plot of train and validation
// loss, and a progress display (a live line on a terminal, plain periodic lines otherwise).
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace torchspeed::monitor {

struct StepMetrics {
  int64_t step = 0, samples = 0;
  double loss = 0;
  std::optional<double> val_loss;
  double lr = 0, loss_scale = 1, grad_norm = 0, tokens_per_s = 0, mfu = 0;
};

class MetricsCsv {
 public:
  explicit MetricsCsv(const std::string& path);
  // Continues a resumed run's file: keeps the rows up to `step` (later ones were trained again
  // from the checkpoint), available as previous().
  MetricsCsv(const std::string& path, int64_t resume_after_step);
  void write(const StepMetrics& m);
  const std::vector<StepMetrics>& previous() const { return previous_; }

 private:
  std::ofstream out_;
  std::string path_;
  std::vector<StepMetrics> previous_;
};

// Writes an SVG line plot of the loss curves (validation as points with a line).
void write_loss_svg(const std::string& path, const std::vector<StepMetrics>& history,
                    std::optional<double> baseline, const std::string& title);

class Progress {
 public:
  // first_step: the step a resumed run starts after (the ETA counts only this run's steps).
  Progress(int64_t total_steps, int64_t log_interval, int64_t first_step = 0);
  void update(const StepMetrics& m, double elapsed_s);
  void finish();

 private:
  int64_t total_, interval_, first_;
  bool tty_;
  std::optional<double> last_val_;
};

std::string format_duration(double seconds);

}  // namespace torchspeed::monitor
