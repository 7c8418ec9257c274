// The step observers that write a run down (observers.h).
#include "torchspeed/monitor/observers.h"

namespace torchspeed::monitor {

namespace {
MetricsCsv open_csv(const std::string& path, int64_t resume_after_step) {
  return resume_after_step > 0 ? MetricsCsv(path, resume_after_step) : MetricsCsv(path);
}
}  // namespace

CsvObserver::CsvObserver(const std::string& path, int64_t resume_after_step, int64_t log_interval, int64_t last_step)
    : csv_(open_csv(path, resume_after_step)), interval_(log_interval), last_(last_step), history_(csv_.previous()) {}

void CsvObserver::on_step(const StepReport& r, double) {
  if (r.step % interval_ == 0 || r.val_loss || r.step == last_) csv_.write(r);
  history_.push_back(r);
}

}  // namespace torchspeed::monitor
