// DeepSpeed's training monitors (its `tensorboard` and `csv_monitor` config sections): scalar
// events (name, value, step) become records of a TensorBoard event file and rows of one CSV file
// per event name, both under output_path/job_name/. Plain C++17 without LibTorch; nothing is
// created on disk before the first write. See Note [DeepSpeed's monitors] in ds_monitor.cpp.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace torchspeed::monitor {

// One monitor's config section: {"enabled": true, "output_path": "logs/", "job_name": "run1"}.
struct MonitorTarget {
  bool enabled = false;
  // "" (DeepSpeed's default) puts the job's folder in the working directory, as DeepSpeed's
  // os.path.join("", job_name) does.
  std::string output_path;
  std::string job_name = "DeepSpeedJobName";  // a folder inside output_path

  // output_path/job_name ("." when both are empty).
  std::string log_dir() const;
};

struct MonitorConfig {
  MonitorTarget tensorboard;  // section "tensorboard"
  MonitorTarget csv;          // section "csv_monitor"
};

// DeepSpeed's event tuple (log_name, value, step).
struct Event {
  std::string name;  // "Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale"
  double value = 0;
  int64_t step = 0;  // DeepSpeed's engine passes the global sample count
};

namespace detail {
struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
}  // namespace detail

// A TensorBoard event file, log_dir/events.out.tfevents.<unix time>.<host>.<pid>.<n> (the name
// torch.utils.tensorboard's SummaryWriter gives it), readable by TensorBoard's EventAccumulator.
// The folder and the file are made on the first write_events call.
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(std::string log_dir);

  // Appends one scalar summary per event (value as float32, TensorBoard's simple_value) and
  // flushes, so that a job killed later keeps what was written.
  void write_events(const std::vector<Event>& events);

  const std::string& log_dir() const { return log_dir_; }
  // The event file; "" until the first write_events call.
  const std::string& file_path() const { return path_; }

  // The bytes, public for tests. An Event protobuf: {wall_time, file_version "brain.Event:2",
  // source_metadata} opens every file; {wall_time, step, summary {value {tag, simple_value}}}
  // carries a scalar.
  static std::string encode_file_version_event(double wall_time);
  static std::string encode_scalar_event(double wall_time, int64_t step, const std::string& tag,
                                         float value);
  // One TFRecord: uint64 length, masked crc32c of the length bytes, data, masked crc32c of data
  // (all little-endian).
  static std::string frame_record(const std::string& data);
  // TFRecord's masked CRC-32C: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
  static uint32_t masked_crc32c(const void* data, size_t n);

 private:
  void open();

  std::string log_dir_;
  std::string path_;
  std::unique_ptr<std::FILE, detail::FileCloser> file_;
};

// DeepSpeed's csvMonitor: each event name gets log_dir/<name with '/' and ' ' as '_'>.csv, a
// header row "step,<last '/'-component of the name>" the first time this process writes that
// file, then one "step,value" row per event, appended (a resumed run continues the file).
// Rows end in "\r\n" and values are formatted as Python's repr(float) — what Python's csv
// module writes for DeepSpeed, byte for byte.
class CsvMonitor {
 public:
  explicit CsvMonitor(std::string log_dir);

  void write_events(const std::vector<Event>& events);

  const std::string& log_dir() const { return log_dir_; }
  // "Train/Samples/lr" -> "Train_Samples_lr.csv".
  static std::string file_name(const std::string& event_name);
  // Python's repr(float): shortest digits that read back to v, "65536.0", "1e-05", "nan".
  static std::string format_value(double v);

 private:
  std::string log_dir_;
  bool dir_made_ = false;
  std::set<std::string> headed_;  // files whose header row this process wrote
};

// DeepSpeed's MonitorMaster for the TensorBoard and CSV monitors. DeepSpeed writes from global
// rank 0 only: construct it with the real config there and with a default (disabled) one on the
// other ranks — or on every rank, since nothing touches the disk before write_events.
class Monitor {
 public:
  explicit Monitor(MonitorConfig config);

  // Any monitor enabled: the engine builds events only then, as DeepSpeed checks monitor.enabled.
  bool enabled() const { return tensorboard_ || csv_; }
  // Writes every event to each enabled monitor; a no-op when none is.
  void write_events(const std::vector<Event>& events);
  // DeepSpeed's engine's events of one optimizer step, at step `samples` (the global sample
  // count): the loss when known, the lr (the schedule's after the step), the loss scale (fp16).
  void write_step(int64_t samples, std::optional<double> train_loss, double lr, std::optional<double> loss_scale);

  const MonitorConfig& config() const { return config_; }
  const TensorBoardWriter* tensorboard() const { return tensorboard_.get(); }  // null when disabled
  const CsvMonitor* csv() const { return csv_.get(); }                         // null when disabled

 private:
  MonitorConfig config_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<CsvMonitor> csv_;
};

}  // namespace torchspeed::monitor
