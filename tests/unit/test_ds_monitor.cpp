// DeepSpeed's monitors: the TensorBoard event file read back here (TFRecord framing, CRCs,
// protobuf fields), the CSV files' exact bytes, nothing written when disabled, and errors that
// name the path. tests/monitor/read_tensorboard.py reads the same files with Python's tensorboard
// (DsMonitor.WritesForPythonReader writes them when TS_MONITOR_OUT is set).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <sstream>

#include "test_util.h"
#include "torchspeed/monitor/ds_monitor.h"

namespace fs = std::filesystem;
using torchspeed::monitor::CsvMonitor;
using torchspeed::monitor::Event;
using torchspeed::monitor::Monitor;
using torchspeed::monitor::MonitorConfig;
using torchspeed::monitor::MonitorTarget;
using torchspeed::monitor::TensorBoardWriter;

namespace {

// A fresh folder per test, removed afterwards.
struct TempDir {
  fs::path path;
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path = fs::temp_directory_path() /
           ("ts_ds_monitor_" + std::to_string(getpid()) + "_" + info->name());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string to_hex(const std::string& bytes) {
  std::string out;
  char b[3];
  for (unsigned char c : bytes) {
    std::snprintf(b, sizeof(b), "%02x", c);
    out += b;
  }
  return out;
}

// CRC-32C bit by bit, independent of the library's.
uint32_t crc32c_bitwise(const std::string& s) {
  uint32_t c = ~0u;
  for (unsigned char byte : s) {
    c ^= byte;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

uint64_t le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(static_cast<unsigned char>(s[at + i])) << (8 * i);
  return v;
}

// Splits a TFRecord file into its records, checking both CRCs of each.
std::vector<std::string> read_records(const std::string& file) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < file.size()) {
    EXPECT_LE(at + 12, file.size()) << "truncated record header";
    if (at + 12 > file.size()) break;
    const uint64_t n = le(file, at, 8);
    EXPECT_EQ(le(file, at + 8, 4), masked(crc32c_bitwise(file.substr(at, 8)))) << "length crc";
    EXPECT_LE(at + 12 + n + 4, file.size()) << "truncated record";
    if (at + 12 + n + 4 > file.size()) break;
    const std::string data = file.substr(at + 12, n);
    EXPECT_EQ(le(file, at + 12 + n, 4), masked(crc32c_bitwise(data))) << "data crc";
    out.push_back(data);
    at += 12 + n + 4;
  }
  return out;
}

// One protobuf field: number, wire type, and the varint/fixed value or the bytes.
struct Field {
  int number = 0, wire = 0;
  uint64_t num = 0;
  std::string bytes;
};

std::vector<Field> parse_proto(const std::string& s) {
  std::vector<Field> out;
  size_t at = 0;
  auto varint = [&]() {
    uint64_t v = 0;
    for (int shift = 0; at < s.size(); shift += 7) {
      const auto b = static_cast<unsigned char>(s[at++]);
      v |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) break;
    }
    return v;
  };
  while (at < s.size()) {
    Field f;
    const uint64_t key = varint();
    f.number = static_cast<int>(key >> 3);
    f.wire = static_cast<int>(key & 7);
    if (f.wire == 0) {
      f.num = varint();
    } else if (f.wire == 1 || f.wire == 5) {
      const int n = f.wire == 1 ? 8 : 4;
      f.num = le(s, at, n);
      at += n;
    } else if (f.wire == 2) {
      const uint64_t n = varint();
      f.bytes = s.substr(at, n);
      at += n;
    } else {
      ADD_FAILURE() << "unexpected wire type " << f.wire;
      break;
    }
    out.push_back(f);
  }
  return out;
}

const Field* field(const std::vector<Field>& fs, int number) {
  for (const Field& f : fs)
    if (f.number == number) return &f;
  return nullptr;
}

// A decoded Event record.
struct Decoded {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version, tag;
  bool has_value = false;
  float value = 0;
};

Decoded decode_event(const std::string& data) {
  Decoded d;
  const auto ev = parse_proto(data);
  if (const Field* f = field(ev, 1)) std::memcpy(&d.wall_time, &f->num, 8);
  if (const Field* f = field(ev, 2)) d.step = static_cast<int64_t>(f->num);
  if (const Field* f = field(ev, 3)) d.file_version = f->bytes;
  if (const Field* f = field(ev, 5)) {
    const auto summary = parse_proto(f->bytes);
    EXPECT_EQ(summary.size(), 1u) << "one value per event";
    const auto value = parse_proto(summary.at(0).bytes);
    if (const Field* t = field(value, 1)) d.tag = t->bytes;
    if (const Field* v = field(value, 2)) {
      EXPECT_EQ(v->wire, 5);
      const auto bits = static_cast<uint32_t>(v->num);
      std::memcpy(&d.value, &bits, 4);
      d.has_value = true;
    }
  }
  return d;
}

std::vector<fs::path> files_in(const fs::path& dir) {
  std::vector<fs::path> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

MonitorTarget target(const fs::path& output_path, const std::string& job = "job") {
  MonitorTarget t;
  t.enabled = true;
  t.output_path = output_path.string();
  t.job_name = job;
  return t;
}

}  // namespace

TEST(DsMonitor, DefaultsAndLogDirAreDeepSpeeds) {
  MonitorTarget t;
  EXPECT_FALSE(t.enabled);
  EXPECT_EQ(t.job_name, "DeepSpeedJobName");
  EXPECT_EQ(t.log_dir(), "DeepSpeedJobName");  // os.path.join("", job_name): the working dir
  t.output_path = "/logs/tb";
  EXPECT_EQ(t.log_dir(), "/logs/tb/DeepSpeedJobName");
  t.output_path = "/logs/tb/";
  EXPECT_EQ(t.log_dir(), "/logs/tb/DeepSpeedJobName");
  t.output_path = "";
  t.job_name = "";
  EXPECT_EQ(t.log_dir(), ".");
  EXPECT_FALSE(Monitor(MonitorConfig{}).enabled());
}

TEST(DsMonitor, EventBytesMatchPythonProtobuf) {
  // Golden bytes from tensorboard's event_pb2 (protobuf's SerializeToString).
  EXPECT_EQ(to_hex(TensorBoardWriter::encode_scalar_event(1.5, 0, "a", 0.0f)),
            "09000000000000f83f2a0a0a080a01611500000000");
  EXPECT_EQ(to_hex(TensorBoardWriter::encode_scalar_event(1.5, -1, "a", 0.0f)),
            "09000000000000f83f10ffffffffffffffffff012a0a0a080a01611500000000");
  EXPECT_EQ(
      to_hex(TensorBoardWriter::encode_scalar_event(1700000000.25, 300, "Train/Samples/lr", 1e-4f)),
      "0900001040fc54d94110ac022a190a170a10547261696e2f53616d706c65732f6c721517b7d138");
  const std::string fv = TensorBoardWriter::encode_file_version_event(1700000000.25);
  EXPECT_EQ(to_hex(fv),
            "0900001040fc54d9411a0d627261696e2e4576656e743a32520c0a0a746f7263687370656564");
  // And tensorboard's RecordWriter frames it so.
  EXPECT_EQ(to_hex(TensorBoardWriter::frame_record(fv)),
            "2600000000000000734fe300" + to_hex(fv) + "aad0e1b1");
  EXPECT_EQ(TensorBoardWriter::masked_crc32c("123456789", 9), 0xc78ab0e5u);
  EXPECT_EQ(TensorBoardWriter::masked_crc32c("123456789", 9), masked(crc32c_bitwise("123456789")));
}

TEST(DsMonitor, TensorBoardFileReadsBack) {
  TempDir tmp;
  MonitorConfig cfg;
  cfg.tensorboard = target(tmp.path / "tb", "run1");
  Monitor m(cfg);
  ASSERT_TRUE(m.enabled());
  ASSERT_NE(m.tensorboard(), nullptr);
  EXPECT_EQ(m.csv(), nullptr);
  EXPECT_FALSE(fs::exists(tmp.path / "tb")) << "nothing is created before the first write";

  const double t0 =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  m.write_events({{"Train/Samples/train_loss", 10.5, 0}, {"Train/Samples/lr", 1e-4, 32}});
  const std::string path = m.tensorboard()->file_path();
  ASSERT_FALSE(path.empty());
  const size_t after_first = fs::file_size(path);  // flushed: on disk without closing
  EXPECT_GT(after_first, 0u);
  m.write_events({{"Train/Samples/loss_scale", 65536.0, 32}, {"Train/Samples/lr", 2e-4, 64}});
  m.write_events({});
  EXPECT_GT(fs::file_size(path), after_first);

  const auto files = files_in(tmp.path / "tb" / "run1");
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].string(), path);
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const std::regex name("events\\.out\\.tfevents\\.[0-9]{10}\\.(.+)\\.([0-9]+)\\.[0-9]+");
  std::smatch match;
  const std::string fname = files[0].filename().string();
  ASSERT_TRUE(std::regex_match(fname, match, name)) << fname;
  EXPECT_EQ(match[1].str(), host);
  EXPECT_EQ(match[2].str(), std::to_string(getpid()));

  const auto records = read_records(read_file(path));
  ASSERT_EQ(records.size(), 5u);
  const Decoded first = decode_event(records[0]);
  EXPECT_EQ(first.file_version, "brain.Event:2");
  EXPECT_FALSE(first.has_value);
  struct Want {
    std::string tag;
    int64_t step;
    float value;
  };
  const std::vector<Want> want = {{"Train/Samples/train_loss", 0, 10.5f},
                                  {"Train/Samples/lr", 32, 1e-4f},
                                  {"Train/Samples/loss_scale", 32, 65536.0f},
                                  {"Train/Samples/lr", 64, 2e-4f}};
  for (size_t i = 0; i < want.size(); ++i) {
    const Decoded d = decode_event(records[i + 1]);
    EXPECT_EQ(d.tag, want[i].tag) << i;
    EXPECT_EQ(d.step, want[i].step) << i;
    ASSERT_TRUE(d.has_value) << i;
    EXPECT_EQ(d.value, want[i].value) << i;
    EXPECT_GE(d.wall_time, t0 - 1) << i;
    EXPECT_LE(d.wall_time, t0 + 120) << i;
    EXPECT_TRUE(d.file_version.empty());
  }
}

TEST(DsMonitor, CsvFilesAreDeepSpeedsBytes) {
  TempDir tmp;
  MonitorConfig cfg;
  cfg.csv = target(tmp.path / "csv", "job");
  {
    Monitor m(cfg);
    m.write_events({{"Train/Samples/train_loss", 2.5, 0}, {"Train/Samples/lr", 0.0001, 32}});
    m.write_events({{"Train/Samples/train_loss", 0.1 + 0.2, 32}, {"Train/Samples/lr", 1e-05, 64}});
    m.write_events({{"Eval loss", 65536.0, 64}, {"Train/Samples/a,b", 1e16, 64}});
  }
  const fs::path dir = tmp.path / "csv" / "job";
  const auto files = files_in(dir);
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(read_file(dir / "Train_Samples_train_loss.csv"),
            "step,train_loss\r\n0,2.5\r\n32,0.30000000000000004\r\n");
  EXPECT_EQ(read_file(dir / "Train_Samples_lr.csv"), "step,lr\r\n32,0.0001\r\n64,1e-05\r\n");
  EXPECT_EQ(read_file(dir / "Eval_loss.csv"), "step,Eval loss\r\n64,65536.0\r\n");
  EXPECT_EQ(read_file(dir / "Train_Samples_a,b.csv"), "step,\"a,b\"\r\n64,1e+16\r\n");

  // A new process (a resumed run) appends, and writes the header again as DeepSpeed does.
  Monitor again(cfg);
  again.write_events({{"Train/Samples/lr", 3e-4, 96}});
  EXPECT_EQ(read_file(dir / "Train_Samples_lr.csv"),
            "step,lr\r\n32,0.0001\r\n64,1e-05\r\nstep,lr\r\n96,0.0003\r\n");
}

TEST(DsMonitor, ValuesFormatLikePythonRepr) {
  // Each right-hand side is Python 3's repr() of the same double.
  const std::vector<std::pair<double, std::string>> cases = {
      {0.0, "0.0"},
      {-0.0, "-0.0"},
      {1.0, "1.0"},
      {-2.5, "-2.5"},
      {65536.0, "65536.0"},
      {0.1, "0.1"},
      {1.0 / 3, "0.3333333333333333"},
      {0.0001, "0.0001"},
      {0.00012345, "0.00012345"},
      {1e-05, "1e-05"},
      {1.5e-07, "1.5e-07"},
      {1e15, "1000000000000000.0"},
      {1234567890123456.0, "1234567890123456.0"},
      {1e16, "1e+16"},
      {12345678901234567890.0, "1.2345678901234567e+19"},
      {123456789.125, "123456789.125"},
      {5e-324, "5e-324"},
      {1.7976931348623157e308, "1.7976931348623157e+308"},
      {std::numeric_limits<double>::infinity(), "inf"},
      {-std::numeric_limits<double>::infinity(), "-inf"},
      {std::numeric_limits<double>::quiet_NaN(), "nan"},
  };
  for (const auto& [v, s] : cases) EXPECT_EQ(CsvMonitor::format_value(v), s) << s;
  EXPECT_EQ(CsvMonitor::file_name("Train/Samples/elapsed_time_ms_forward"),
            "Train_Samples_elapsed_time_ms_forward.csv");
  EXPECT_EQ(CsvMonitor::file_name("my metric/x y"), "my_metric_x_y.csv");
}

TEST(DsMonitor, DisabledMonitorWritesNothing) {
  TempDir tmp;
  MonitorConfig cfg;
  cfg.tensorboard = target(tmp.path / "tb");
  cfg.csv = target(tmp.path / "csv");
  cfg.tensorboard.enabled = false;
  cfg.csv.enabled = false;
  Monitor m(cfg);
  EXPECT_FALSE(m.enabled());
  EXPECT_EQ(m.tensorboard(), nullptr);
  EXPECT_EQ(m.csv(), nullptr);
  m.write_events({{"Train/Samples/lr", 1e-4, 32}});
  EXPECT_TRUE(files_in(tmp.path).empty());

  // Enabled but never written to (a rank that does not log): still nothing on disk.
  cfg.tensorboard.enabled = cfg.csv.enabled = true;
  { Monitor quiet(cfg); }
  EXPECT_TRUE(files_in(tmp.path).empty());
}

TEST(DsMonitor, UnwritablePathsAreNamed) {
  TempDir tmp;
  // A regular file where the output folder should be (root can't write there either).
  const fs::path blocker = tmp.path / "not_a_folder";
  std::ofstream(blocker) << "x";
  MonitorConfig tb_cfg;
  tb_cfg.tensorboard = target(blocker, "job");
  Monitor tb(tb_cfg);
  ts_test::expect_error(
      [&] {
        tb.write_events({{"Train/Samples/lr", 1.0, 1}});
      },
      (blocker / "job").string());
  ts_test::expect_error(
      [&] {
        tb.write_events({{"Train/Samples/lr", 1.0, 1}});
      },
      "tensorboard.output_path");
  MonitorConfig csv_cfg;
  csv_cfg.csv = target(blocker, "job");
  Monitor csv(csv_cfg);
  ts_test::expect_error(
      [&] {
        csv.write_events({{"Train/Samples/lr", 1.0, 1}});
      },
      "csv_monitor: cannot create the folder '" + (blocker / "job").string());

  // The CSV file's name taken by a folder.
  MonitorConfig ok_cfg;
  ok_cfg.csv = target(tmp.path / "out", "job");
  fs::create_directories(tmp.path / "out" / "job" / "Train_Samples_lr.csv");
  Monitor ok(ok_cfg);
  ts_test::expect_error(
      [&] {
        ok.write_events({{"Train/Samples/lr", 1.0, 1}});
      },
      (tmp.path / "out" / "job" / "Train_Samples_lr.csv").string());
}

// Writes the files that tests/monitor/read_tensorboard.py checks with Python's tensorboard and
// csv modules, plus expected.txt: one "name<TAB>step<TAB>value as C99 hex float" line per event.
TEST(DsMonitor, WritesForPythonReader) {
  const char* out = std::getenv("TS_MONITOR_OUT");
  if (out == nullptr || *out == '\0') GTEST_SKIP() << "TS_MONITOR_OUT not set";
  MonitorConfig cfg;
  cfg.tensorboard = target(out, "DeepSpeedJobName");
  cfg.csv = target(out, "DeepSpeedJobName");
  Monitor m(cfg);
  std::vector<Event> all;
  const int64_t batch = 32;
  for (int step = 0; step < 20; ++step) {
    // As DeepSpeed's pipeline engine: train_loss after the batch, lr and loss_scale after step().
    const int64_t samples = (step + 1) * batch;
    const double scale = step < 10 ? 65536.0 : 32768.0;
    std::vector<Event> events = {{"Train/Samples/train_loss", 10.0 / (step + 1), samples},
                                 {"Train/Samples/lr", 1e-4 * (step + 1), samples},
                                 {"Train/Samples/loss_scale", scale, samples}};
    if (step == 7) events.push_back({"Train/Samples/odd values", 1e-05, samples});
    if (step == 8) events.push_back({"Train/Samples/odd values", 1e16, samples});
    if (step == 9) events.push_back({"Train/Samples/odd values", -0.0, samples});
    m.write_events(events);
    all.insert(all.end(), events.begin(), events.end());
  }
  std::ofstream expected(fs::path(out) / "expected.txt");
  for (const Event& e : all) {
    char v[64];
    std::snprintf(v, sizeof(v), "%a", e.value);
    expected << e.name << '\t' << e.step << '\t' << v << '\n';
  }
  ASSERT_TRUE(expected.good());
}
