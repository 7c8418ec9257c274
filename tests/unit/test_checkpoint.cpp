// Checkpoint building blocks without MPI: CRC-32C, safetensors round trips and damage
// detection, and the partition layout's pieces (what resharding relies on); the save protocol
// on a communicator of one rank: keep_last and readers, a failed `latest`, durable folders, and
// names read from files.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/syscall.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <tuple>
#include <unistd.h>
#include <vector>

#include "test_util.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/checkpoint/io_names.h"
#include "torchspeed/checkpoint/hf_gpt2.h"
#include "torchspeed/checkpoint/reshard.h"
#include "torchspeed/checkpoint/sharded.h"
#include "torchspeed/comm/communicator.h"
#include "torchspeed/zero/partition_layout.h"

// fsync(2) for the whole test binary: the library's calls resolve here first (an executable's
// definition comes before libc's). It records the folders fsynced, then does the real fsync.
namespace {
std::mutex g_fsync_mu;
std::set<std::string> g_fsynced_folders;
}  // namespace
extern "C" int fsync(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    char link[64], path[4096];
    std::snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    const ssize_t n = ::readlink(link, path, sizeof(path) - 1);
    if (n > 0) {
      std::lock_guard<std::mutex> lock(g_fsync_mu);
      g_fsynced_folders.insert(std::string(path, static_cast<size_t>(n)));
    }
  }
  return static_cast<int>(::syscall(SYS_fsync, fd));
}

namespace ck = torchspeed::checkpoint;
namespace fs = std::filesystem;

namespace {
std::string temp_dir() {
  auto d = fs::temp_directory_path() / ("ts-unit-ckpt-" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d.string();
}
std::string read_all(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// A communicator of one rank: the collective save/load protocol without MPI. Every collective
// is a copy (or nothing).
class SoloComm final : public torchspeed::comm::Communicator {
  using WorkPtr = torchspeed::comm::WorkPtr;
  class Done final : public torchspeed::comm::Work {
   public:
    using Work::Work;
    void wait() override {}
    bool is_completed() override { return true; }
    std::exception_ptr exception() const override { return nullptr; }
  };
  static WorkPtr done(std::vector<at::Tensor> result = {}) { return std::make_shared<Done>(std::move(result)); }

 public:
  using Communicator::split;
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& world_ranks() const override { return ranks_; }
  const torchspeed::comm::CommOptions& options() const override { return options_; }
  torchspeed::comm::CommStats stats() const override { return {}; }
  std::shared_ptr<Communicator> split(int, int, const std::string&, const torchspeed::comm::CommOptions&) override {
    return std::make_shared<SoloComm>();
  }

 protected:
  WorkPtr do_all_reduce(const at::Tensor& t, torchspeed::comm::ReduceOp, Mode) override { return done({t}); }
  WorkPtr do_reduce_scatter(const at::Tensor& in, const at::Tensor& out, torchspeed::comm::ReduceOp, Mode) override {
    out.copy_(in.reshape(out.sizes()));
    return done({out});
  }
  WorkPtr do_all_gather(const at::Tensor& in, const at::Tensor& out, Mode) override {
    out.copy_(in.reshape(out.sizes()));
    return done({out});
  }
  WorkPtr do_broadcast(const at::Tensor& t, int, Mode) override { return done({t}); }
  WorkPtr do_send(const at::Tensor&, int, int) override { TS_CHECK(false, "SoloComm has no peer"); }
  WorkPtr do_recv(const at::Tensor&, int, int) override { TS_CHECK(false, "SoloComm has no peer"); }
  WorkPtr do_barrier(Mode) override { return done(); }

 private:
  std::string name_ = "solo";
  std::vector<int> ranks_{0};
  torchspeed::comm::CommOptions options_;
};

// A save of tag `tag` into `dir` by one rank: one shard, and the manifest keys loading checks.
std::string save_tag(torchspeed::comm::Communicator& comm, const std::string& dir, const std::string& tag,
                     int keep_last = 0) {
  ck::SaveSpec spec;
  spec.dir = dir;
  spec.tag = tag;
  spec.keep_last = keep_last;
  spec.manifest = {{"params", nlohmann::json::array()}, {"zero", nlohmann::json::object()},
                   {"engine", nlohmann::json::object()}, {"grid", nlohmann::json::object()}};
  spec.tensors = {{"x", at::arange(4, at::kFloat)}};
  spec.file = "rank00000.safetensors";
  return ck::save(comm, spec);
}

// The entries of `dir`, hidden ones included, sorted, space-separated.
std::string entries(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : " ") + n;
  return out;
}

// Sets an environment variable for the scope.
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name_); }
  const char* name_;
};
}  // namespace

TEST(Checkpoint, Crc32cMatchesTheStandardCheckValue) {
  EXPECT_EQ(ck::crc32c(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(ck::crc32c(0, "", 0), 0u);
  // Streaming in pieces (any split, unaligned) equals one pass.
  std::string s(1000, '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 37 + 11);
  const uint32_t whole = ck::crc32c(0, s.data(), s.size());
  for (size_t cut : {1, 7, 8, 9, 500, 999}) {
    EXPECT_EQ(ck::crc32c(ck::crc32c(0, s.data(), cut), s.data() + cut, s.size() - cut), whole) << cut;
  }
}

TEST(Checkpoint, SafetensorsRoundTripsByteExactAndReportsItsDigest) {
  const std::string dir = temp_dir(), path = dir + "/a.safetensors";
  ck::NamedTensors t{{"w", at::randn({3, 5})}, {"b", at::randn({7}).to(at::kBFloat16)},
                     {"i", at::arange(4, at::kLong)}, {"empty", at::empty({0, 3})}};
  const auto d = ck::save_safetensors(path, t, {{"k", "v"}});
  const std::string bytes = read_all(path);
  EXPECT_EQ(d.bytes, static_cast<int64_t>(bytes.size()));
  EXPECT_EQ(d.crc32c, ck::crc32c(0, bytes.data(), bytes.size()));
  const auto f = ck::load_safetensors(path, &d);
  ASSERT_EQ(f.tensors.size(), t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(f.tensors[i].first, t[i].first);
    EXPECT_TRUE(f.tensors[i].second.equal(t[i].second)) << t[i].first;
  }
  EXPECT_EQ(f.metadata.at("k"), "v");
  // Saving what was loaded gives the same bytes.
  ck::save_safetensors(dir + "/b.safetensors", f.tensors, f.metadata);
  EXPECT_EQ(read_all(dir + "/b.safetensors"), bytes);
  fs::remove_all(dir);
}

TEST(Checkpoint, Crc32cCombinesPartsWrittenApart) {
  std::string s(70000, '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>((i * 131 + 7) ^ (i >> 8));
  const uint32_t whole = ck::crc32c(0, s.data(), s.size());
  for (size_t cut : {0, 1, 8, 999, 4096, 65537, 69999, 70000}) {
    const uint32_t a = ck::crc32c(0, s.data(), cut), b = ck::crc32c(0, s.data() + cut, s.size() - cut);
    EXPECT_EQ(ck::crc32c_combine(a, b, s.size() - cut), whole) << cut;
  }
  // Three parts, combined left to right.
  const uint32_t a = ck::crc32c(0, s.data(), 100), b = ck::crc32c(0, s.data() + 100, 30000),
                 c = ck::crc32c(0, s.data() + 30100, s.size() - 30100);
  EXPECT_EQ(ck::crc32c_combine(ck::crc32c_combine(a, b, 30000), c, s.size() - 30100), whole);
}

// A shard whose optimizer state streams from disk (Note [Streamed partitions]) is the same file,
// byte for byte and checksum, as one written from whole tensors; the reader returns any range of
// it and refuses a damaged file before returning anything.
TEST(Checkpoint, StreamedTensorsWriteTheSameFileAndReadBackInRanges) {
  const std::string dir = temp_dir();
  const at::Tensor m = at::randn({1000}), a = at::randn({1000}), b = at::randn({1000});
  const at::Tensor head = at::arange(5, at::kLong);
  const std::map<std::string, std::string> meta{{"format", "pt"}};
  const auto whole = ck::save_safetensors(dir + "/whole.safetensors", {{"head", head}, {"master", m}, {"exp_avg", a},
                                                                       {"exp_avg_sq", b}}, meta);
  ck::StreamedTensors st;
  for (const char* n : {"master", "exp_avg", "exp_avg_sq"}) st.tensors.push_back({n, at::kFloat, {1000}});
  st.produce = [&](const ck::StreamSink& sink) {  // pieces of 1, 7, 300, ... elements, the kinds interleaved
    int64_t at = 0;
    for (int64_t len : {1, 7, 300, 92, 600}) {
      const at::Tensor* kinds[] = {&m, &a, &b};
      for (size_t k = 0; k < 3; ++k) sink(k, kinds[k]->data_ptr<float>() + at, static_cast<size_t>(len) * 4);
      at += len;
    }
  };
  const auto streamed = ck::save_safetensors_streamed(dir + "/streamed.safetensors", {{"head", head}}, st, meta);
  EXPECT_EQ(read_all(dir + "/streamed.safetensors"), read_all(dir + "/whole.safetensors"));
  EXPECT_EQ(streamed.bytes, whole.bytes);
  EXPECT_EQ(streamed.crc32c, whole.crc32c);

  ck::SafetensorsReader r(dir + "/streamed.safetensors", &streamed);
  std::vector<float> got(250);
  r.read("exp_avg", 4 * 333, 4 * 250, got.data());
  EXPECT_TRUE(at::equal(at::from_blob(got.data(), {250}), a.narrow(0, 333, 250)));
  EXPECT_TRUE(at::equal(r.tensor("exp_avg_sq"), b));
  EXPECT_TRUE(at::equal(r.tensor("head"), head));
  ts_test::expect_error([&] { r.read("master", 3996, 8, got.data()); }, "it has 4000");
  ts_test::expect_error([&] { r.entry("momentum"); }, "no tensor 'momentum'");

  // A producer that leaves a tensor short fails the save and leaves no file.
  st.produce = [&](const ck::StreamSink& sink) { sink(0, m.data_ptr<float>(), 400); };
  ts_test::expect_error([&] { ck::save_safetensors_streamed(dir + "/short.safetensors", {}, st); },
                        "streamed tensor 'master' got 400 of its 4000 bytes");
  EXPECT_FALSE(fs::exists(dir + "/short.safetensors"));

  // Damage is found before the reader returns.
  std::string bytes = read_all(dir + "/streamed.safetensors");
  bytes[bytes.size() - 100] ^= 0x10;
  std::ofstream(dir + "/streamed.safetensors", std::ios::binary | std::ios::trunc) << bytes;
  ts_test::expect_error([&] { ck::SafetensorsReader(dir + "/streamed.safetensors", &streamed); }, "checksum mismatch");
  fs::remove_all(dir);
}

TEST(Checkpoint, DamagedFilesAreRefusedWithTheirName) {
  const std::string dir = temp_dir(), path = dir + "/s.safetensors";
  const auto d = ck::save_safetensors(path, {{"x", at::randn({1000})}});
  std::string bytes = read_all(path);
  {  // one flipped bit in the data
    std::string b = bytes;
    b[b.size() / 2] ^= 0x04;
    std::ofstream(path, std::ios::binary | std::ios::trunc) << b;
    ts_test::expect_error([&] { ck::load_safetensors(path, &d); }, path + ": checksum mismatch");
  }
  {  // truncated: caught by the size before reading, and without a manifest by the header
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 10);
    ts_test::expect_error([&] { ck::load_safetensors(path, &d); }, path + ": truncated");
    ts_test::expect_error([&] { ck::load_safetensors(path); }, "truncated");
  }
  {  // a header length past the end
    std::string b = bytes;
    b[5] = 0x7f;
    std::ofstream(path, std::ios::binary | std::ios::trunc) << b;
    ts_test::expect_error([&] { ck::load_safetensors(path); }, "exceeds the file size");
  }
  fs::remove_all(dir);
}

// Headers found by fuzzing (fuzz/fuzz_safetensors.cpp) that escaped as json or c10 exceptions or
// overflowed int64 (undefined behaviour) before the entries were checked one by one: every one
// is now a torchspeed::Error naming the file and the entry.
TEST(Checkpoint, MalformedSafetensorsHeadersAreRefusedWithTheEntry) {
  const std::string dir = temp_dir(), path = dir + "/h.safetensors";
  auto write = [&](const std::string& header, size_t data_bytes) {
    std::string b(8, '\0');
    for (int i = 0; i < 8; ++i)
      b[static_cast<size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        << b << header << std::string(data_bytes, '\0');
  };
  const std::vector<std::tuple<std::string, size_t, std::string>> cases = {
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4,
       "data_offsets must be a list [begin, end]"},
      {R"({"x":{"dtype":"F32","shape":[-1,-1],"data_offsets":[0,4]}})", 4,
       "each size of shape must be an integer"},
      {R"({"x":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0,
       "holds 2^63 bytes or more"},
      {R"({"x":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", 0,
       "holds 2^63 bytes or more"},
      {R"({"x":{"dtype":5,"shape":[1],"data_offsets":[0,4]}})", 4, "dtype must be a string"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[1e300,4]}})", 4,
       "data_offsets[0] must be an integer"},
      {R"({"x":{"dtype":"U8","shape":[1e300],"data_offsets":[0,1]}})", 1,
       "each size of shape must be an integer"},
      {R"({"x":{"dtype":"U8","shape":3,"data_offsets":[0,3]}})", 3, "shape must be a list"},
      {R"({"x":{"dtype":"U8","shape":[3],"data_offsets":[0,2]}})", 3, "do not span the 3 bytes"},
  };
  for (const auto& [header, data_bytes, needle] : cases) {
    SCOPED_TRACE(header);
    write(header, data_bytes);
    ts_test::expect_error([&] { ck::load_safetensors(path); }, path + ": header entry 'x'");
    ts_test::expect_error([&] { ck::load_safetensors(path); }, needle);
  }
  fs::remove_all(dir);
}

// Manifests found by fuzzing (fuzz/fuzz_manifest.cpp): a number beyond double's range and
// fields of the wrong type escaped as json exceptions, without the file's name.
TEST(Checkpoint, MalformedManifestsAreRefusedWithTheFile) {
  const std::string dir = temp_dir(), manifest = dir + "/manifest.json";
  const std::string rest = R"("files":{},"ranks":[],"params":[],"zero":{},"engine":{},"grid":{})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"format":"torchspeed-checkpoint","global_step":1e999,)" + rest + "}",
       "corrupt manifest"},
      {R"({"format":5,)" + rest + "}", "not a torchspeed checkpoint manifest"},
      {R"({"format":"torchspeed-checkpoint","format_version":"1",)" + rest + "}",
       "format_version must be an integer"},
      {R"({"format":"torchspeed-checkpoint","format_version":2,)" + rest + "}",
       "format version 2 is newer"},
  };
  for (const auto& [text, needle] : cases) {
    SCOPED_TRACE(text);
    std::ofstream(manifest, std::ios::trunc) << text;
    ts_test::expect_error([&] { ck::open_local(dir); }, manifest + ": " + needle);
  }
  std::ofstream(manifest, std::ios::trunc)
      << R"({"format":"torchspeed-checkpoint","format_version":1,)" + rest + "}";
  EXPECT_EQ(ck::open_local(dir).manifest.at("format_version"), 1);
  fs::remove_all(dir);
}

// Partition layouts found by fuzzing: values whose products or sums overflowed int64 in the
// consistency checks (undefined behaviour that could let a layout through and send reads past a
// partition), floats beyond int's range, and negative sizes are refused.
TEST(Checkpoint, MalformedPartitionLayoutsAreRefused) {
  using nlohmann::json;
  auto unit = [](int64_t padded, int64_t shard, int64_t part_offset, int64_t part_size,
                 json params = json::array()) {
    return json{{"padded", padded},
                {"shard", shard},
                {"part_offset", part_offset},
                {"part_size", part_size},
                {"params", std::move(params)}};
  };
  auto layout = [](json dp, json u) {
    return json{
        {"stage", 1}, {"dp", std::move(dp)}, {"part_numel", 4}, {"units", json::array({u})}};
  };
  const json ok_unit = unit(8, 4, 0, 4, {{"w", 0, 8}});
  EXPECT_EQ(torchspeed::zero::PartitionLayout::from_json(layout(2, ok_unit), "m").units.size(), 1u);
  const int64_t kMax = INT64_MAX;
  // shard * dp, part_offset + part_size and offset + numel overflowed; get<int>() of 1e300 was
  // undefined and of 2^32 + 2 gave 2; negative sizes passed.
  const std::vector<std::pair<json, std::string>> cases = {
      {layout(2, unit(0, int64_t{1} << 62, 0, int64_t{1} << 62)), "inconsistent unit"},
      {layout(1, unit(4, 4, kMax, 4)), "inconsistent unit"},
      {layout(1, unit(4, 4, 0, 4, {{"w", kMax, 4}})), "parameter 'w' lies outside its unit"},
      {layout(1e300, ok_unit), "dp must be an integer in [1, 2147483647]"},
      {layout(int64_t{4294967298}, ok_unit), "dp must be an integer in [1, 2147483647]"},
      {layout(0, ok_unit), "dp must be an integer in [1, 2147483647]"},
      {layout(2, unit(-8, -4, 0, -4)), "padded must be an integer in [0, "},
  };
  for (const auto& [j, needle] : cases) {
    SCOPED_TRACE(j.dump());
    auto read = [&, &j = j] { torchspeed::zero::PartitionLayout::from_json(j, "m.json"); };
    ts_test::expect_error(read, "m.json: ");
    ts_test::expect_error(read, needle);
  }
}

// For random units and data-parallel sizes, the pieces of all ranks cover every element of every
// parameter exactly once (stage >= 1), or completely on every rank (stage 0), inside the rank's
// partition.
TEST(Checkpoint, LayoutPiecesCoverEveryParameterOnce) {
  std::mt19937 gen(3);
  for (int trial = 0; trial < 200; ++trial) {
    torchspeed::zero::PartitionLayout l;
    l.stage = static_cast<int>(gen() % 4);
    l.dp = 1 + static_cast<int>(gen() % 5);
    std::map<std::string, int64_t> numel;
    const int units = 1 + static_cast<int>(gen() % 4);
    for (int u = 0; u < units; ++u) {
      torchspeed::zero::UnitLayout ul;
      int64_t off = 0;
      const int params = 1 + static_cast<int>(gen() % 4);
      for (int p = 0; p < params; ++p) {
        const std::string name = "u" + std::to_string(u) + "p" + std::to_string(p);
        const int64_t n = static_cast<int64_t>(gen() % 50);
        ul.params.push_back({name, off, n});
        numel[name] = n;
        off += n + static_cast<int64_t>(gen() % 3);  // alignment gaps
      }
      ul.padded = ((std::max<int64_t>(off, 1) + l.dp - 1) / l.dp) * l.dp;
      ul.shard = ul.padded / l.dp;
      ul.part_size = l.stage == 0 ? ul.padded : ul.shard;
      ul.part_offset = l.part_numel;
      l.part_numel += ul.part_size;
      l.units.push_back(ul);
    }
    const auto round = torchspeed::zero::PartitionLayout::from_json(l.to_json(), "test");
    ASSERT_EQ(round.to_json(), l.to_json());
    std::map<std::string, std::vector<int>> hits;
    for (const auto& [name, n] : numel) hits[name].assign(static_cast<size_t>(n), 0);
    for (int r = 0; r < l.dp; ++r) {
      for (const auto& p : torchspeed::zero::pieces(l, r)) {
        ASSERT_GE(p.part_offset, 0);
        ASSERT_LE(p.part_offset + p.length, l.part_numel);
        for (int64_t i = 0; i < p.length; ++i) ++hits[p.name][static_cast<size_t>(p.begin + i)];
      }
    }
    const int expected = l.stage == 0 ? l.dp : 1;
    for (const auto& [name, h] : hits)
      for (size_t i = 0; i < h.size(); ++i) ASSERT_EQ(h[i], expected) << name << "[" << i << "] stage " << l.stage;
  }
}

TEST(Checkpoint, Gpt2FoldersRoundTripWithTransformersNamesAndConv1DLayout) {
  namespace hf = ck::hf;
  const std::string dir = (std::filesystem::temp_directory_path() / ("ts-hf-" + std::to_string(::getpid()))).string();
  const nlohmann::json section = {{"vocab", 11}, {"seq_len", 6},  {"d_model", 4},          {"n_layer", 1},
                                  {"n_head", 2}, {"dropout", 0.0}, {"tie_embeddings", true}, {"activation", "gelu_tanh"},
                                  {"layer_norm_eps", 1e-5}};
  ck::NamedTensors ours;
  auto add = [&](const std::string& n, std::vector<int64_t> shape) { ours.emplace_back(n, at::randn(shape)); };
  add("embed.tok.weight", {11, 4});
  add("embed.pos.weight", {6, 4});
  for (const char* ln : {"ln1", "ln2"}) {
    add(std::string("block0.") + ln + ".weight", {4});
    add(std::string("block0.") + ln + ".bias", {4});
  }
  add("block0.qkv.weight", {12, 4});
  add("block0.qkv.bias", {12});
  add("block0.attn_proj.weight", {4, 4});
  add("block0.attn_proj.bias", {4});
  add("block0.fc.weight", {16, 4});
  add("block0.fc.bias", {16});
  add("block0.mlp_proj.weight", {4, 16});
  add("block0.mlp_proj.bias", {4});
  add("head.ln_f.weight", {4});
  add("head.ln_f.bias", {4});
  hf::save_gpt2(dir, ours, section, at::kFloat);
  // transformers' names and layout on disk.
  const auto file = ck::load_safetensors(dir + "/model.safetensors");
  EXPECT_EQ(file.metadata.at("format"), "pt");
  EXPECT_TRUE(at::equal(file.at("transformer.h.0.mlp.c_fc.weight"), ours[10].second.t()));  // [d, 4d]
  EXPECT_TRUE(at::equal(file.at("transformer.h.0.attn.c_attn.bias"), ours[7].second));
  const auto cfg = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
  EXPECT_EQ(cfg.at("model_type"), "gpt2");
  EXPECT_EQ(cfg.at("activation_function"), "gelu_new");
  EXPECT_EQ(cfg.at("n_embd"), 4);
  EXPECT_TRUE(cfg.at("eos_token_id").is_null());
  EXPECT_TRUE(hf::is_hf_folder(dir));
  // And back, by load_model: every tensor bit-equal under its own name; the same section.
  const auto back = ck::load_model(dir);
  EXPECT_EQ(back.config.at("model"), section);
  ASSERT_EQ(back.params.size(), ours.size());
  for (const auto& [name, t] : ours) {
    bool found = false;
    for (const auto& [n, b] : back.params) found = found || (n == name && at::equal(b, t));
    EXPECT_TRUE(found) << name;
  }
  // What our GPT cannot compute is refused naming config.json's key.
  auto refused = [&](const char* key, nlohmann::json value, const std::string& needle) {
    nlohmann::json c = cfg;
    c[key] = value;
    ts_test::expect_error([&] { hf::model_section_from_gpt2(c, "x/config.json"); }, needle);
  };
  refused("model_type", "llama", "x/config.json: \"model_type\" is \"llama\"");
  refused("activation_function", "relu", "\"activation_function\" is \"relu\"");
  refused("n_inner", 8, "\"n_inner\" is 8");
  refused("scale_attn_by_inverse_layer_idx", true, "\"scale_attn_by_inverse_layer_idx\": true is not supported");
  refused("attn_pdrop", 0.3, "\"attn_pdrop\" differs from \"resid_pdrop\"");
  // An unknown tensor in the file is named with the file.
  ck::save_safetensors(dir + "/model.safetensors", {{"transformer.h.0.attn.q_proj.weight", at::zeros({4, 4})}});
  ts_test::expect_error([&] { ck::load_model(dir); }, "tensor \"transformer.h.0.attn.q_proj.weight\" is not part of a GPT-2");
  std::filesystem::remove_all(dir);
}

// keep_last never deletes a tag a reader holds (an Opened from open() or open_local()): the save
// keeps it with a warning, and a later save removes it once the reader let go. Nothing of the
// locking stays behind in the folder.
TEST(Checkpoint, PruningSkipsATagAReaderHoldsAndRemovesItLater) {
  SoloComm comm;
  const std::string dir = temp_dir() + "/prune";
  fs::remove_all(dir);
  save_tag(comm, dir, "t1", 2);
  save_tag(comm, dir, "t2", 2);
  auto reading_t1 = ck::open(comm, dir, "t1");  // as Engine::load_checkpoint holds it
  ASSERT_TRUE(reading_t1 && reading_t1->hold);
  save_tag(comm, dir, "t3", 2);  // would prune t1
  EXPECT_EQ(entries(dir), "latest t1 t2 t3");
  EXPECT_EQ(ck::load_safetensors(reading_t1->path + "/rank00000.safetensors").at("x").sum().item<float>(), 6.0f);
  auto reading_t2 = ck::open_local(dir + "/t2");  // as consolidate() holds it
  reading_t1.reset();
  save_tag(comm, dir, "t4", 2);  // t1 is free now; t2 is held
  EXPECT_EQ(entries(dir), "latest t2 t3 t4");
  reading_t2 = {};
  save_tag(comm, dir, "t5", 2);
  EXPECT_EQ(entries(dir), "latest t4 t5");
  EXPECT_EQ(entries(dir + "/t5"), "manifest.json rank00000.safetensors");
  fs::remove_all(dir);
}

// A save whose `latest` cannot be written after the tag was renamed into place says so: the
// tag is complete and published, and `latest` names what it named before (or nothing).
TEST(Checkpoint, AFailedLatestSaysTheTagIsPublishedAndWhatLatestNames) {
  SoloComm comm;
  const std::string dir = temp_dir() + "/latest-fails";
  fs::remove_all(dir);
  {
    ScopedEnv fault("TORCHSPEED_CHECKPOINT_FAULT", "publish-fail:latest");
    ts_test::expect_error([&] { save_tag(comm, dir, "t0"); },
                          "The checkpoint is complete and published at " + dir + "/t0, but " + dir +
                              "/latest was not written: there is no latest tag");
  }
  EXPECT_FALSE(fs::exists(dir + "/latest"));
  EXPECT_EQ(ck::open_local(dir + "/t0").manifest.at("tag"), "t0");
  save_tag(comm, dir, "t1");
  {
    ScopedEnv fault("TORCHSPEED_CHECKPOINT_FAULT", "publish-fail:latest");
    ts_test::expect_error([&] { save_tag(comm, dir, "t2"); }, "injected failure of step 'latest'");
    ts_test::expect_error([&] { save_tag(comm, dir, "t3"); },
                          "The checkpoint is complete and published at " + dir + "/t3, but " + dir +
                              "/latest still names the previous tag 't1'");
  }
  EXPECT_EQ(read_all(dir + "/latest"), "t1\n");
  EXPECT_EQ(ck::open_local(dir + "/t3").manifest.at("tag"), "t3");
  EXPECT_EQ(ck::open(comm, dir, "")->manifest.at("tag"), "t1");
  // A failure before the rename still publishes nothing.
  {
    ScopedEnv fault("TORCHSPEED_CHECKPOINT_FAULT", "publish-fail:rename");
    ts_test::expect_error([&] { save_tag(comm, dir, "t4"); },
                          "Nothing was published: " + dir + "/latest and the checkpoints already there are untouched");
  }
  EXPECT_EQ(read_all(dir + "/latest"), "t1\n");
  EXPECT_EQ(entries(dir), "latest t0 t1 t2 t3");  // no t4, no temporary
  fs::remove_all(dir);
}

// The folders a save creates are fsynced in their parents, so a crash cannot lose the folder
// holding a checkpoint that was reported saved.
TEST(Checkpoint, SaveFsyncsTheFoldersItCreatesInTheirParents) {
  SoloComm comm;
  const std::string base = fs::canonical(temp_dir()).string() + "/durable";
  fs::remove_all(base);
  fs::create_directories(base);
  {
    std::lock_guard<std::mutex> lock(g_fsync_mu);
    g_fsynced_folders.clear();
  }
  save_tag(comm, base + "/runs/ckpt", "t1");
  std::lock_guard<std::mutex> lock(g_fsync_mu);
  for (const std::string& folder : {base, base + "/runs", base + "/runs/ckpt"})
    EXPECT_TRUE(g_fsynced_folders.count(folder)) << folder << " was not fsynced";
  fs::remove_all(base);
}

// Names read from files are joined into paths only when they are plain names: the tag in
// `latest`, shard files in manifest.json and in a Hugging Face index.
TEST(Checkpoint, NamesReadFromFilesMustBePlainNames) {
  SoloComm comm;
  const std::string dir = temp_dir() + "/names";
  fs::remove_all(dir);
  save_tag(comm, dir, "t1");
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"../t1", "\"../t1\""}, {"/etc", "\"/etc\""}, {"t1/../../x", "\"t1/../../x\""},
      {"..", "\"..\""},       {std::string("t1\0x", 4), "\"t1\\u0000x\""}};
  for (const auto& [name, shown] : bad) {
    SCOPED_TRACE(shown);
    std::ofstream(dir + "/latest", std::ios::trunc) << name << "\n";
    const std::string needle = dir + "/latest: tag " + shown + " is not a plain file name";
    ts_test::expect_error([&] { ck::open(comm, dir, ""); }, needle);
    ts_test::expect_error([&] { ck::open_local(dir); }, needle);
  }
  // manifest.json's shard files.
  std::ofstream(dir + "/latest", std::ios::trunc) << "t1\n";
  const std::string mpath = dir + "/t1/manifest.json";
  auto m = nlohmann::json::parse(read_all(mpath));
  m["files"]["../../escape.safetensors"] = m["files"]["rank00000.safetensors"];
  std::ofstream(mpath, std::ios::trunc) << m.dump();
  ts_test::expect_error([&] { ck::open_local(dir); },
                        mpath + ": shard file \"../../escape.safetensors\" is not a plain file name");
  // The shard files a slice lists (joined by ShardSource).
  const auto layout = torchspeed::zero::PartitionLayout::from_json(
      {{"stage", 1},
       {"dp", 1},
       {"part_numel", 4},
       {"units", {{{"padded", 4}, {"shard", 4}, {"part_offset", 0}, {"part_size", 4}, {"params", {{"w", 0, 4}}}}}}},
      "test");
  ts_test::expect_error([&] { ck::ShardSource(dir + "/t1", layout, {"/etc/passwd"}, {}); },
                        dir + "/t1/manifest.json: shard file \"/etc/passwd\" is not a plain file name");
  // A Hugging Face index's shard files.
  const std::string hf = temp_dir() + "/hf-index";
  fs::remove_all(hf);
  fs::create_directories(hf);
  for (const std::string name : {"../model.safetensors", "/tmp/model.safetensors", "sub/model.safetensors", ""}) {
    SCOPED_TRACE(name);
    std::ofstream(hf + "/model.safetensors.index.json", std::ios::trunc)
        << nlohmann::json{{"weight_map", {{"w", name}}}}.dump();
    ts_test::expect_error([&] { ck::hf::safetensors_files(hf); },
                          hf + "/model.safetensors.index.json: weight_map[\"w\"]: shard file \"" + name +
                              "\" is not a plain file name");
  }
  std::ofstream(hf + "/model.safetensors.index.json", std::ios::trunc)
      << R"({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors", "c": "model-1.safetensors"}})";
  EXPECT_EQ(ck::hf::safetensors_files(hf),
            (std::vector<std::string>{hf + "/model-1.safetensors", hf + "/model-2.safetensors"}));
  fs::remove_all(hf);
  fs::remove_all(dir);
}

// A header length beyond safetensors' 100 MB limit is refused before anything is allocated or
// read, even when the file is that large (here a sparse one).
TEST(Checkpoint, SafetensorsHeadersOver100MBAreRefused) {
  const std::string dir = temp_dir(), path = dir + "/huge-header.safetensors";
  const uint64_t n = 150'000'000;
  {
    std::string len(8, '\0');
    for (int i = 0; i < 8; ++i) len[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xFF);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << len;
  }
  fs::resize_file(path, 8 + n);
  const std::string needle = path + ": header length 150000000 at offset 0 exceeds the 100000000 bytes safetensors allows";
  ts_test::expect_error([&] { ck::load_safetensors(path); }, needle);
  ts_test::expect_error([&] { ck::SafetensorsReader reader(path); }, needle);
  fs::remove(path);
}
