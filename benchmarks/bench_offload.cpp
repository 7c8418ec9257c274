// `torchspeed bench offload`: NVMe offload of the optimizer state against its peers, same run,
// alternating: swap-file throughput vs fio (sequential O_DIRECT, io_uring, same block size,
// queue depth and directory); the step time of an offloaded GPT vs max(the I/O time of its swap
// bytes at fio's bandwidth, the in-memory step time); peak RSS offloaded vs in memory vs the
// buffer-pool formula; and the largest GPT that trains under one memory budget (a cgroup
// memory limit where the machine allows one, and peak RSS) in memory (ZeRO-1) and with the
// optimizer state and parameters offloaded (ZeRO-3).
// The GPT runs are child processes (`bench offload --engine-part --spec JSON`), so each has its
// own peak RSS. The swap directory is $TORCHSPEED_NVME_PATH, default <tmp>/torchspeed-bench-offload.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "bench_report.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/offload/aio.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/memory_cgroup.h"
#include "torchspeed/comm/runtime.h"

namespace torchspeed::bench {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string run_capture(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  TS_CHECK(p, "bench offload: cannot run ", cmd);
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  *status = ::pclose(p);
  return out;
}

// fio's sequential O_DIRECT bandwidth in bytes/s.
double fio_bandwidth(const std::string& file, bool write, int64_t bytes, int64_t block, int depth) {
  const std::string cmd = concat("fio --name=ts --filename=", shell_quote(file), " --rw=", write ? "write" : "read",
                                 " --bs=", block, " --iodepth=", depth, " --ioengine=io_uring --direct=1 --size=", bytes,
                                 " --output-format=json 2>&1");
  int st = 0;
  const std::string out = run_capture(cmd, &st);
  TS_CHECK(st == 0, "bench offload: fio failed (apt-get install fio): ", out.substr(0, 400));
  const json j = json::parse(out.substr(out.find('{')));
  return j["jobs"][0][write ? "write" : "read"]["bw_bytes"].get<double>();
}

// Our swap file's bandwidth over the same bytes, block size and queue depth.
double swap_bandwidth(offload::SwapFile& f, bool write, int64_t bytes, offload::AlignedBuffer& buf) {
  const auto chunk = static_cast<int64_t>(buf.size());
  auto t = Clock::now();
  std::vector<offload::SwapFile::Ticket> tickets;
  for (int64_t off = 0; off < bytes; off += chunk) {
    tickets.push_back(write ? f.write(off, buf.data(), std::min(chunk, bytes - off))
                            : f.read(off, buf.data(), std::min(chunk, bytes - off)));
  }
  f.wait_all();
  return static_cast<double>(bytes) / since(t);
}

int64_t peak_rss_bytes() {
  std::ifstream s("/proc/self/status");
  std::string line;
  while (std::getline(s, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

struct PartResult {
  bool ok = false;
  json j;
};

PartResult run_part(const std::string& self, const json& spec, const MemoryCgroup* cg) {
  std::string cmd = concat("exec ", shell_quote(self), " bench offload --engine-part --spec ", shell_quote(spec.dump()));
  if (cg && cg->available()) cmd = concat("echo $$ > ", cg->procs_file(), " && ", cmd);
  int st = 0;
  const std::string out = run_capture("sh -c " + shell_quote(cmd) + " 2>&1", &st);
  PartResult r;
  const auto at = out.rfind("OFFLOAD_PART ");
  r.ok = st == 0 && at != std::string::npos;
  if (r.ok) r.j = json::parse(out.substr(at + 13, out.find('\n', at) - at - 13));
  return r;
}

// offload: "none", "optimizer" (ZeRO-1, optimizer state on disk) or "all" (ZeRO-3, optimizer
// state and parameters on disk).
json gpt_spec_json(int64_t d, int64_t layers, const std::string& offload, const std::string& nvme, int steps, bool quick) {
  return {{"d_model", d}, {"n_layer", layers}, {"offload", offload}, {"nvme", nvme}, {"steps", steps},
          {"seq", quick ? 32 : 64}, {"micro", 2}};
}

}  // namespace

int run_offload_part(const BenchArgs& args) {
  const json s = json::parse(args.spec);
  models::GPTConfig g;
  g.d_model = s["d_model"];
  g.n_layer = s["n_layer"];
  g.n_head = g.d_model / 64;
  g.seq_len = s["seq"];
  const int64_t micro = s["micro"];
  const std::string offload = s["offload"];
  json zero = {{"stage", offload == "all" ? 3 : 1}, {"sub_group_size", 4000000}, {"reduce_bucket_size", 20000000},
               {"overlap_comm", false}, {"stage3_param_persistence_threshold", 0}};
  if (offload != "none") {
    zero["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", s["nvme"]}, {"buffer_count", 4},
                                 {"pipeline_read", true}, {"pipeline_write", true}};
  }
  if (offload == "all") {
    zero["offload_param"] = {{"device", "nvme"}, {"nvme_path", s["nvme"]}, {"buffer_count", 4},
                             {"buffer_size", 8000000}, {"max_in_cpu", 0}};
  }
  config::WorldShape shape;
  shape.world_size = 1;
  config::Config cfg = config::Config::parse(
      {{"train_micro_batch_size_per_gpu", micro}, {"bf16", {{"enabled", true}}},
       {"data_types", {{"grad_accum_dtype", "bf16"}}},
       {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-4}}}}}, {"zero_optimization", zero}},
      shape);
  const Runtime& rt = runtime();
  // Each layer built in fp32 and cast to bf16 at once: the whole model never exists in fp32.
  nn::StackSpec spec = models::gpt_spec(g, 1);
  for (auto& l : spec.layers) {
    l.build = [inner = l.build](const nn::TiedTensors& tied) {
      torch::nn::AnyModule m = inner(tied);
      m.ptr()->to(at::kBFloat16);
      return m;
    };
  }
  auto engine = initialize(rt, spec, cfg);
  std::vector<double> times;
  for (int i = 0; i < s["steps"].get<int>(); ++i) {
    at::Tensor t = at::randint(0, 256, {micro, g.seq_len + 1}, at::kLong);
    auto t0 = Clock::now();
    engine->train_batch([&] { return std::make_pair(t.narrow(1, 0, g.seq_len).contiguous(), t.narrow(1, 1, g.seq_len).contiguous()); });
    times.push_back(since(t0));
  }
  const auto m = engine->memory();
  json out = {{"params", engine->num_parameters()}, {"step_s", times}, {"peak_rss", peak_rss_bytes()},
              {"params_bytes", m.params}, {"grad_bytes", m.gradients}, {"master_bytes", m.master},
              {"optimizer_bytes", m.optimizer_state}, {"offloaded_bytes", m.offloaded}};
  std::printf("OFFLOAD_PART %s\n", out.dump().c_str());
  return 0;
}

int run_offload(const BenchArgs& args, const std::string& self) {
  const char* env = std::getenv("TORCHSPEED_NVME_PATH");
  const std::string dir = env && *env ? env : (fs::temp_directory_path() / "torchspeed-bench-offload").string();
  fs::create_directories(dir);
  BenchReport report("offload");
  report.machine() = describe_machine(1);
  report.machine()["nvme_path"] = dir;

  // 1. Throughput: fio and our swap file, alternating, same bytes, block size and depth.
  const int64_t block = 1 << 20, bytes = args.quick ? (256LL << 20) : (2LL << 30);
  const int depth = 8, rounds = args.quick ? 1 : 3;
  std::vector<double> rw, ww;  // ratios
  double fio_r = 0, fio_w = 0;
  {
    offload::SwapFile f(dir + "/bench.swap", bytes, offload::AioOptions().block_size(block).queue_depth(depth));
    offload::AlignedBuffer buf(64 << 20, 4096);
    std::memset(buf.data(), 1, buf.size());
    report.machine()["swap_io"] = f.describe();
    // Both files laid out before timing: fio's first write allocates, our file is preallocated.
    fio_bandwidth(dir + "/fio.dat", true, bytes, block, depth);
    for (int r = 0; r < rounds; ++r) {
      const double fw = fio_bandwidth(dir + "/fio.dat", true, bytes, block, depth);
      const double sw = swap_bandwidth(f, true, bytes, buf);
      const double fr = fio_bandwidth(dir + "/fio.dat", false, bytes, block, depth);
      const double sr = swap_bandwidth(f, false, bytes, buf);
      ww.push_back(sw / fw);
      rw.push_back(sr / fr);
      fio_r += fr / rounds;
      fio_w += fw / rounds;
      report.add_result({{"round", r}, {"fio_write_MBps", fw / 1e6}, {"swap_write_MBps", sw / 1e6},
                         {"fio_read_MBps", fr / 1e6}, {"swap_read_MBps", sr / 1e6}});
      std::printf("round %d: write fio %.0f MB/s swap %.0f MB/s (%.2fx); read fio %.0f MB/s swap %.0f MB/s (%.2fx)\n",
                  r, fw / 1e6, sw / 1e6, sw / fw, fr / 1e6, sr / 1e6, sr / fr);
      std::fflush(stdout);
    }
    fs::remove(dir + "/fio.dat");
  }
  report.add_target("swap write throughput / fio (median)", median(ww), 0.8);
  report.add_target("swap read throughput / fio (median)", median(rw), 0.8);

  // 2. One GPT in memory and offloaded, alternating: step time and peak RSS.
  const int64_t d = args.quick ? 256 : 768, layers = args.quick ? 2 : 6;
  const int steps = args.quick ? 3 : 5;
  std::vector<double> mem_t, off_t, io_t, step_ratio;
  json mem_j, off_j;
  for (int r = 0; r < (args.quick ? 1 : 2); ++r) {
    auto mem = run_part(self, gpt_spec_json(d, layers, "none", dir, steps, args.quick), nullptr);
    auto off = run_part(self, gpt_spec_json(d, layers, "optimizer", dir, steps, args.quick), nullptr);
    TS_CHECK(mem.ok && off.ok, "bench offload: a GPT run failed");
    auto med_after_first = [](const json& j) {
      std::vector<double> v = j["step_s"].get<std::vector<double>>();
      v.erase(v.begin());
      return median(v);
    };
    const double tm = med_after_first(mem.j), to = med_after_first(off.j);
    const double swap = off.j["offloaded_bytes"].get<double>();
    const double io = swap / fio_r + swap / fio_w;  // every step reads and writes the whole state
    mem_t.push_back(tm);
    off_t.push_back(to);
    io_t.push_back(io);
    step_ratio.push_back(to / std::max(io, tm));
    mem_j = mem.j;
    off_j = off.j;
    report.add_result({{"gpt_d", d}, {"gpt_layers", layers}, {"params", mem.j["params"]}, {"memory_step_s", tm},
                       {"offload_step_s", to}, {"io_time_at_fio_s", io}, {"memory_run", mem.j}, {"offload_run", off.j}});
    std::printf("GPT d%lld x %lld (%lld params): step in memory %.3f s, offloaded %.3f s, swap I/O at fio's "
                "bandwidth %.3f s: %.2fx of the larger\n", static_cast<long long>(d), static_cast<long long>(layers),
                mem.j["params"].get<long long>(), tm, to, io, to / std::max(io, tm));
    std::fflush(stdout);
  }
  report.add_target("offloaded step / max(swap I/O at fio bandwidth, in-memory step)", median(step_ratio), 1.25, false);
  // Peak RSS: offloaded vs in memory, and vs the formula (in-memory peak - the state that moved + the pool).
  const double rss_mem = mem_j["peak_rss"], rss_off = off_j["peak_rss"];
  const double moved = mem_j["master_bytes"].get<double>() + mem_j["optimizer_bytes"].get<double>();
  const double predicted = rss_mem - moved + off_j["optimizer_bytes"].get<double>();
  std::printf("peak RSS: in memory %.0f MB, offloaded %.0f MB (%.2fx); formula %.0f MB (state %.0f MB moved to disk, "
              "pool %.0f MB): measured/formula %.3f\n", rss_mem / 1e6, rss_off / 1e6, rss_off / rss_mem, predicted / 1e6,
              moved / 1e6, off_j["optimizer_bytes"].get<double>() / 1e6, rss_off / predicted);
  report.add_result({{"peak_rss_memory", rss_mem}, {"peak_rss_offload", rss_off}, {"peak_rss_formula", predicted}});
  report.add_target("offloaded peak RSS / formula (in-memory peak - moved state + pool)", rss_off / predicted, 1.10, false);

  // 3. The largest GPT (d_model d, layers searched) that trains within one memory budget.
  if (!args.quick) {
    const int64_t budget = 1LL << 30;
    MemoryCgroup cg(budget + (256LL << 20));  // the cgroup kills what the RSS check would refuse anyway
    report.machine()["memory_budget"] = budget;
    report.machine()["budget_enforced_by"] = cg.available() ? "cgroup " + cg.dir() + " and peak RSS" : "peak RSS";
    for (bool offload : {false, true}) {
      auto fits = [&](int64_t l) {
        auto r = run_part(self, gpt_spec_json(d, l, offload ? "all" : "none", dir, 2, false), &cg);
        const bool ok = r.ok && r.j["peak_rss"].get<double>() <= static_cast<double>(budget);
        std::printf("  %s, %lld layers: %s%s\n", offload ? "ZeRO-3, optimizer and parameters offloaded" : "ZeRO-1 in memory", static_cast<long long>(l),
                    ok ? "trains" : "does not fit",
                    r.ok ? concat(" (peak RSS ", r.j["peak_rss"].get<int64_t>() / 1000000, " MB)").c_str() : "");
        std::fflush(stdout);
        return std::make_pair(ok, r.j);
      };
      int64_t lo = 1, hi = 2;
      json best;
      while (true) {
        auto [ok, j] = fits(hi);
        if (!ok) break;
        best = j;
        lo = hi;
        hi *= 2;
        if (hi > 256) break;
      }
      while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        auto [ok, j] = fits(mid);
        if (ok) {
          lo = mid;
          best = j;
        } else {
          hi = mid;
        }
      }
      const double params = best.is_null() ? 0.0 : best["params"].get<double>();
      std::printf("largest GPT d%lld under %.1f GB %s: %lld layers, %.1fM parameters\n", static_cast<long long>(d),
                  budget / 1e9, offload ? "offloaded" : "in memory", static_cast<long long>(lo), params / 1e6);
      report.add_result({{"budget_bytes", budget}, {"offload", offload}, {"largest_layers", lo}, {"params", params},
                         {"run", best}});
    }
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  report.finish(args);
  return report.all_met() ? 0 : 1;
}

}  // namespace torchspeed::bench
