// DeepSpeed's TensorBoard and CSV monitors: the event file's protobuf and TFRecord bytes, the
// CSV rows as Python's csv module writes them, and the monitor that feeds both.
#include "torchspeed/monitor/ds_monitor.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "torchspeed/io/crc32c.h"
#include "torchspeed/base/error.h"

// Note [DeepSpeed's monitors]
// What deepspeed/monitor/{monitor,tensorboard,csv_monitor,config}.py do, and we with them:
// - Sections "tensorboard" and "csv_monitor": enabled (false), output_path (""), job_name
//   ("DeepSpeedJobName"). The folder is os.path.join(output_path, job_name), so the default is
//   ./DeepSpeedJobName/ in the working directory, for both monitors (their fallback to
//   ~/tensorboard/<DLWS_JOB_ID>/logs needs output_path None, which the config cannot give).
// - MonitorMaster writes on global rank 0 only; TensorBoardMonitor flushes after every
//   write_events call. A flush reaches the OS, so a killed process keeps its events (no fsync:
//   DeepSpeed does not either, and a step's few records are not worth one).
// - TensorBoard: torch.utils.tensorboard's SummaryWriter(log_dir) names its file
//   events.out.tfevents.%010d.<hostname>.<pid>.<n> (n counts writers in the process), opens it
//   with Event{wall_time, file_version "brain.Event:2", source_metadata} and gives each
//   add_scalar(tag, value, step) an Event{wall_time, step, summary{value{tag, simple_value}}}:
//   the value is a float32. DeepSpeed makes the file when the engine starts; we make it on the
//   first write, so that ranks which never write leave nothing behind.
// - CSV: one file per event name, log_dir + "/" + name with '/' and ' ' replaced by '_' +
//   ".csv", opened for appending per event; the header ["step", last '/'-component of the name]
//   is written the first time the process writes that file (a resumed run appends a second
//   header row, as DeepSpeed's does), then [step, value]. Python's csv.writer ends rows with
//   "\r\n" and writes a float as repr(): shortest round-trip digits, "65536.0", "1e-05". An int
//   value (DeepSpeed's initial fp16 loss scale can be one) would print as "65536" there; our
//   values are doubles and always print like floats.

namespace torchspeed::monitor {
namespace fs = std::filesystem;

namespace {

// Makes `dir` and its parents; `section` names the config section for the message.
void make_dir(const std::string& dir, const char* section) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  TS_CHECK(!ec && fs::is_directory(dir), section, ": cannot create the folder '", dir, "' (",
           ec ? ec.message() : "a file of that name is in the way", "); set ", section,
           ".output_path and ", section, ".job_name to a writable folder");
}

double unix_time_s() {
  using namespace std::chrono;
  return duration_cast<duration<double>>(system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

// Protobuf wire format: varints, tags (field << 3 | wire type), little-endian fixed widths.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

void put_tag(std::string& out, int field, int wire_type) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type));
}

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_tag(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

void put_double(std::string& out, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if (bits == 0) return;  // proto3 leaves a zero scalar out
  put_tag(out, field, kFixed64);
  put_le(out, bits, 8);
}

// Event (tensorboard/compat/proto/event.proto) fields.
constexpr int kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5,
              kEventSourceMetadata = 10;
constexpr int kSourceMetadataWriter = 1;
constexpr int kSummaryValue = 1;                              // Summary.value (repeated)
constexpr int kSummaryValueTag = 1, kSummaryValueSimple = 2;  // Summary.Value.tag, simple_value

std::atomic<int> next_writer_uid{0};  // SummaryWriter's _global_uid

// One CSV field as Python's csv.writer (QUOTE_MINIMAL) writes it.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) {
    if (c == '"') q += '"';
    q += c;
  }
  return q + "\"";
}

void write_all(std::FILE* f, const std::string& bytes, const std::string& path, const char* what) {
  const bool ok =
      std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size() && std::fflush(f) == 0;
  TS_CHECK(ok, what, ": cannot write '", path, "' (", std::strerror(errno), ")");
}

}  // namespace

std::string MonitorTarget::log_dir() const {
  const std::string dir = (fs::path(output_path) / job_name).string();
  return dir.empty() ? "." : dir;
}

// ---- TensorBoardWriter ----------------------------------------------------------------------

TensorBoardWriter::TensorBoardWriter(std::string log_dir) : log_dir_(std::move(log_dir)) {}

uint32_t TensorBoardWriter::masked_crc32c(const void* data, size_t n) {
  const uint32_t crc = io::crc32c(0, data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string TensorBoardWriter::frame_record(const std::string& data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_le(out, data.size(), 8);
  put_le(out, masked_crc32c(out.data(), 8), 4);
  out += data;
  put_le(out, masked_crc32c(data.data(), data.size()), 4);
  return out;
}

std::string TensorBoardWriter::encode_file_version_event(double wall_time) {
  std::string source;
  put_bytes(source, kSourceMetadataWriter, "torchspeed");
  std::string ev;
  put_double(ev, kEventWallTime, wall_time);
  put_bytes(ev, kEventFileVersion, "brain.Event:2");
  put_bytes(ev, kEventSourceMetadata, source);
  return ev;
}

std::string TensorBoardWriter::encode_scalar_event(double wall_time, int64_t step,
                                                   const std::string& tag, float value) {
  std::string val;
  if (!tag.empty()) put_bytes(val, kSummaryValueTag, tag);
  put_tag(val, kSummaryValueSimple, kFixed32);  // in a oneof: written even when 0
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  put_le(val, bits, 4);
  std::string summary;
  put_bytes(summary, kSummaryValue, val);

  std::string ev;
  put_double(ev, kEventWallTime, wall_time);
  if (step != 0) {
    put_tag(ev, kEventStep, kVarint);
    put_varint(ev, static_cast<uint64_t>(step));  // negative: ten bytes, two's complement
  }
  put_bytes(ev, kEventSummary, summary);
  return ev;
}

void TensorBoardWriter::open() {
  make_dir(log_dir_, "tensorboard");
  const double now = unix_time_s();
  char name[64];
  std::snprintf(name, sizeof(name), "%010lld", static_cast<long long>(now));
  path_ = (fs::path(log_dir_) / concat("events.out.tfevents.", name, ".", host_name(), ".",
                                       static_cast<long long>(getpid()), ".", next_writer_uid++))
              .string();
  file_.reset(std::fopen(path_.c_str(), "wb"));
  TS_CHECK(file_ != nullptr, "tensorboard: cannot create the event file '", path_, "' (",
           std::strerror(errno), ")");
  write_all(file_.get(), frame_record(encode_file_version_event(now)), path_, "tensorboard");
}

void TensorBoardWriter::write_events(const std::vector<Event>& events) {
  if (events.empty()) return;
  if (!file_) open();
  const double now = unix_time_s();
  std::string bytes;
  for (const Event& e : events)
    bytes += frame_record(encode_scalar_event(now, e.step, e.name, static_cast<float>(e.value)));
  write_all(file_.get(), bytes, path_, "tensorboard");
}

// ---- CsvMonitor -----------------------------------------------------------------------------

CsvMonitor::CsvMonitor(std::string log_dir) : log_dir_(std::move(log_dir)) {}

std::string CsvMonitor::file_name(const std::string& event_name) {
  std::string f = event_name;
  for (char& c : f)
    if (c == '/' || c == ' ') c = '_';
  return f + ".csv";
}

std::string CsvMonitor::format_value(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  // Shortest round-trip digits (what Python's repr picks too), as d.ddde±XX.
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  TS_INTERNAL_ASSERT(res.ec == std::errc(), "to_chars failed for ", v);
  const std::string s(buf, res.ptr);
  const size_t e = s.find('e');
  TS_INTERNAL_ASSERT(e != std::string::npos, "no exponent in '", s, "'");
  std::string out = s[0] == '-' ? "-" : "";
  std::string digits;
  for (size_t i = out.size(); i < e; ++i)
    if (s[i] != '.') digits += s[i];
  const int exp = std::stoi(s.substr(e + 1));
  const int decpt = exp + 1;  // digits are 0.DIGITS x 10^decpt
  const int n = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {  // repr's fixed-point range
    if (decpt <= 0) return out + "0." + std::string(-decpt, '0') + digits;
    if (decpt >= n) return out + digits + std::string(decpt - n, '0') + ".0";
    return out + digits.substr(0, decpt) + "." + digits.substr(decpt);
  }
  out += digits.substr(0, 1);
  if (n > 1) out += "." + digits.substr(1);
  const int a = exp < 0 ? -exp : exp;
  return out + (exp < 0 ? "e-" : "e+") + (a < 10 ? "0" : "") + std::to_string(a);
}

void CsvMonitor::write_events(const std::vector<Event>& events) {
  if (events.empty()) return;
  if (!dir_made_) {
    make_dir(log_dir_, "csv_monitor");
    dir_made_ = true;
  }
  for (const Event& e : events) {
    const std::string fname = file_name(e.name);
    const std::string path = (fs::path(log_dir_) / fname).string();
    std::string text;
    if (headed_.count(fname) == 0) {
      const size_t slash = e.name.rfind('/');
      const std::string header = slash == std::string::npos ? e.name : e.name.substr(slash + 1);
      text += "step," + csv_field(header) + "\r\n";
    }
    text += concat(e.step, ",", format_value(e.value), "\r\n");
    std::unique_ptr<std::FILE, detail::FileCloser> f(std::fopen(path.c_str(), "ab"));
    TS_CHECK(f != nullptr, "csv_monitor: cannot open '", path, "' for appending (",
             std::strerror(errno), ")");
    write_all(f.get(), text, path, "csv_monitor");
    TS_CHECK(std::fclose(f.release()) == 0, "csv_monitor: cannot write '", path, "' (",
             std::strerror(errno), ")");
    headed_.insert(fname);
  }
}

// ---- Monitor --------------------------------------------------------------------------------

Monitor::Monitor(MonitorConfig config) : config_(std::move(config)) {
  if (config_.tensorboard.enabled)
    tensorboard_ = std::make_unique<TensorBoardWriter>(config_.tensorboard.log_dir());
  if (config_.csv.enabled) csv_ = std::make_unique<CsvMonitor>(config_.csv.log_dir());
}

void Monitor::write_events(const std::vector<Event>& events) {
  if (tensorboard_) tensorboard_->write_events(events);
  if (csv_) csv_->write_events(events);
}

void Monitor::write_step(int64_t samples, std::optional<double> train_loss, double lr,
                         std::optional<double> loss_scale) {
  std::vector<Event> events;
  if (train_loss) events.push_back({"Train/Samples/train_loss", *train_loss, samples});
  events.push_back({"Train/Samples/lr", lr, samples});
  if (loss_scale) events.push_back({"Train/Samples/loss_scale", *loss_scale, samples});
  write_events(events);
}

}  // namespace torchspeed::monitor
