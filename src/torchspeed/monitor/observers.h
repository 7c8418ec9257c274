// Step observers: what a training loop (the Trainer, engine/trainer.h) tells after each optimizer
// step, and the observers that write it down: metrics.csv with the run's history, the progress
// line, and any callback. An observer runs on the ranks it is added on (the CSV and the progress
// line on world rank 0).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "torchspeed/monitor/metrics.h"

namespace torchspeed::monitor {

// One optimizer step: its number, samples so far, the batch's mean loss, the lr it used, the
// loss scale and gradient norm after it, tokens/s over the current logging window, MFU, and the
// validation loss when the step was evaluated.
using StepReport = StepMetrics;

class StepObserver {
 public:
  virtual ~StepObserver() = default;
  // After each optimizer step; elapsed_s since this run's loop began.
  virtual void on_step(const StepReport& r, double elapsed_s) = 0;
  // After a checkpoint of step `step` was saved at `path` (every rank).
  virtual void on_checkpoint(int64_t step, const std::string& path) {}
  // The loop ended after `step`; `interrupted`: a stop was agreed before the last step.
  virtual void on_end(int64_t step, bool interrupted) {}
};
using StepObserverPtr = std::shared_ptr<StepObserver>;

// metrics.csv: every log_interval-th step, every evaluated step and the last one. A resumed run
// keeps the file's rows up to its first step; history() is those rows and every step since.
class CsvObserver final : public StepObserver {
 public:
  CsvObserver(const std::string& path, int64_t resume_after_step, int64_t log_interval, int64_t last_step);
  void on_step(const StepReport& r, double elapsed_s) override;
  const std::vector<StepReport>& history() const { return history_; }

 private:
  MetricsCsv csv_;
  int64_t interval_, last_;
  std::vector<StepReport> history_;
};

// The progress display (Progress): a live line on a terminal, periodic lines otherwise.
class ProgressObserver final : public StepObserver {
 public:
  ProgressObserver(int64_t total_steps, int64_t log_interval, int64_t first_step)
      : progress_(total_steps, log_interval, first_step) {}
  void on_step(const StepReport& r, double elapsed_s) override { progress_.update(r, elapsed_s); }
  void on_end(int64_t, bool) override { progress_.finish(); }

 private:
  Progress progress_;
};

// fn(report) after each step.
class StepCallback final : public StepObserver {
 public:
  explicit StepCallback(std::function<void(const StepReport&)> fn) : fn_(std::move(fn)) {}
  void on_step(const StepReport& r, double) override { fn_(r); }

 private:
  std::function<void(const StepReport&)> fn_;
};

}  // namespace torchspeed::monitor
