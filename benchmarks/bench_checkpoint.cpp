// `torchspeed bench checkpoint` (2 ranks): save_checkpoint and load_checkpoint of gpt-medium
// (ZeRO-2, fp32 masters and Adam moments) beside a plain sequential write (write + fsync) and
// read of the same number of bytes per rank, in the same run, alternating which goes first.
// Loads are measured warm (files in the page cache, as right after a save) and cold (the files'
// pages dropped with posix_fadvise first, so both sides read from the disk). Targets: save and
// load at >= 0.7x the plain write's throughput. The ratio to a plain read is printed too: a load
// also verifies checksums, stages the state (so a bad file changes nothing) and re-gathers the
// replicated parameters (ZeRO-2), which a bare read does not.
#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <cstdio>
#include <filesystem>

#include "bench_report.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/base/error.h"

namespace torchspeed::bench {
namespace {

namespace fs = std::filesystem;
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void plain_write(const std::string& path, const at::Tensor& data) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TS_CHECK(fd >= 0, "cannot write ", path);
  const char* p = static_cast<const char*>(data.data_ptr());
  size_t left = data.nbytes();
  while (left > 0) {
    const ssize_t w = ::write(fd, p, left);
    TS_CHECK(w > 0, "write to ", path, " failed");
    p += w;
    left -= static_cast<size_t>(w);
  }
  TS_CHECK(::fsync(fd) == 0, "fsync of ", path, " failed");
  ::close(fd);
}

void plain_read(const std::string& path, const at::Tensor& into) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TS_CHECK(fd >= 0, "cannot read ", path);
  char* p = static_cast<char*>(into.data_ptr());
  size_t left = into.nbytes();
  while (left > 0) {
    const ssize_t r = ::read(fd, p, left);
    TS_CHECK(r > 0, "read of ", path, " failed");
    p += r;
    left -= static_cast<size_t>(r);
  }
  ::close(fd);
}

// Drops the file's pages from the page cache (they are clean after fsync).
void evict(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

}  // namespace

int run_checkpoint(const BenchArgs& args) {
  auto world = comm::Communicator::world();
  TS_CHECK(world->size() == 2, "bench checkpoint runs on 2 ranks (torchspeed bench checkpoint -n 2)");
  const bool root = world->rank() == 0;
  models::GPTConfig gpt;  // gpt-medium (examples/configs/gpt-medium.json)
  gpt.seq_len = 256;
  gpt.d_model = args.quick ? 128 : 384;
  gpt.n_layer = args.quick ? 2 : 6;
  gpt.n_head = 4;
  const int iters = args.quick ? 2 : 5;
  config::WorldShape shape;
  shape.world_size = 2;
  auto cfg = config::Config::parse({{"train_micro_batch_size_per_gpu", 2},
                                    {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                                    {"zero_optimization", {{"stage", 2}, {"reduce_bucket_size", 2000000}}}},
                                   shape);
  torch::manual_seed(1);
  auto engine = initialize(parallel::make_parallel_groups(world, parallel::ProcessGrid(2)), models::make_gpt(gpt), cfg);
  {  // one step, so that the moments are not zeros
    at::Tensor x = at::randint(0, 256, {2, gpt.seq_len}, at::kLong), y = at::randint(0, 256, {2, gpt.seq_len}, at::kLong);
    engine->backward(engine->forward(x, y));
    engine->step();
  }
  BenchReport report("checkpoint");
  report.machine() = describe_machine(2);
  const std::string dir = "bench-checkpoint.tmp";
  if (root) fs::create_directories(dir);
  world->barrier();
  // The same bytes per rank as this rank's shard (masters + two moments).
  std::vector<std::pair<std::string, at::Tensor>> state;
  engine->export_state(state);
  int64_t bytes = 0;
  for (const auto& [n, t] : state) bytes += static_cast<int64_t>(t.nbytes());
  at::Tensor buffer = at::cat({state[0].second, state[1].second, state[2].second});
  at::Tensor back = at::empty_like(buffer);
  const std::string mine = concat(dir, "/plain-rank", world->rank(), ".bin");
  const std::string shard = concat(dir, "/bench/rank0000", world->rank(), ".safetensors");

  // Seconds of the slower rank for fn.
  auto timed = [&](const std::function<void()>& fn) {
    world->barrier();
    const double t0 = now();
    fn();
    at::Tensor t = at::full({1}, now() - t0, at::kDouble);
    world->all_reduce(t, comm::ReduceOp::kMax);
    return t.item<double>();
  };
  std::vector<double> save, write, load_warm, read_warm, load_cold, read_cold;
  for (int i = 0; i < iters; ++i) {
    auto ours = [&] {
      save.push_back(timed([&] { engine->save_checkpoint(dir, "bench"); }));
      load_warm.push_back(timed([&] { engine->load_checkpoint(dir, "bench"); }));
      evict(shard);
      load_cold.push_back(timed([&] { engine->load_checkpoint(dir, "bench"); }));
    };
    auto plain = [&] {
      write.push_back(timed([&] { plain_write(mine, buffer); }));
      read_warm.push_back(timed([&] { plain_read(mine, back); }));
      evict(mine);
      read_cold.push_back(timed([&] { plain_read(mine, back); }));
    };
    if (i % 2) {
      ours();
      plain();
    } else {
      plain();
      ours();
    }
  }
  TS_CHECK(back.equal(buffer), "bench checkpoint: the plain read returned other bytes");
  const double total_mb = 2.0 * static_cast<double>(bytes) / 1e6;  // both ranks
  auto rate = [&](const std::vector<double>& v) { return total_mb / median(v); };
  if (root) {
    std::printf("bench checkpoint: gpt %ld layers d_model %ld (%.2fM parameters), dp 2, ZeRO-2 fp32: %.1f MB per rank\n",
                static_cast<long>(gpt.n_layer), static_cast<long>(gpt.d_model), engine->num_parameters() / 1e6,
                bytes / 1e6);
    std::printf("  %-34s %10s %10s %8s\n", "", "ours MB/s", "plain MB/s", "ratio");
    const struct {
      const char* name;
      const std::vector<double>&ours, &plain;
    } rows[] = {{"save_checkpoint vs write+fsync", save, write},
                {"load_checkpoint vs read (warm)", load_warm, read_warm},
                {"load_checkpoint vs read (cold)", load_cold, read_cold}};
    for (const auto& r : rows) {
      std::printf("  %-34s %10.0f %10.0f %8.2f\n", r.name, rate(r.ours), rate(r.plain), median(r.plain) / median(r.ours));
      report.add_result({{"case", r.name}, {"ours_seconds", r.ours}, {"plain_seconds", r.plain},
                         {"ours_mb_per_s", rate(r.ours)}, {"plain_mb_per_s", rate(r.plain)}, {"bytes_per_rank", bytes}});
    }
    // The measure: both directions against the plain sequential write of the same bytes.
    report.add_target("save_checkpoint throughput / plain write+fsync", median(write) / median(save), 0.7);
    report.add_target("load_checkpoint (cold) throughput / plain write+fsync", median(write) / median(load_cold), 0.7);
    report.add_target("load_checkpoint (warm) throughput / plain write+fsync", median(write) / median(load_warm), 0.7);
    report.finish(args);
  }
  world->barrier();
  if (root) fs::remove_all(dir);
  return 0;
}

}  // namespace torchspeed::bench
