// `torchspeed bench comm`: all_reduce, reduce_scatter and all_gather through Communicator beside
// the same raw MPI calls, interleaved in one run, 4 KiB to 256 MiB; bf16 all_reduce beside fp32
// in elements per second; the 1-bit compressed all-reduce beside fp32 from 1 MiB. The raw baseline is the only place outside comm/ that calls MPI.
#include <mpi.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <functional>

#include "bench_report.h"
#include "torchspeed/comm/communicator.h"
#include "torchspeed/comm/compressed.h"
#include "torchspeed/base/error.h"
#include "torchspeed/comm/runtime.h"

namespace torchspeed::bench {
namespace {

using Fn = std::function<void()>;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One timed call, started together on every rank; the collective's time is the slowest rank's.
double time_once(const Fn& fn) {
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = now();
  fn();
  return now() - t0;
}

// Runs two variants interleaved, alternating which goes first (a b, b a, a b, ...), so machine
// noise and cache warmth left by the previous call fall on both alike. Returns each variant's
// per-repetition times, max over ranks.
std::array<std::vector<double>, 2> measure_pair(const Fn& a, const Fn& b, bool quick) {
  double warm = std::max(time_once(a), time_once(b));
  MPI_Allreduce(MPI_IN_PLACE, &warm, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  const double budget = quick ? 0.02 : 0.25;
  const int reps = 2 * std::clamp(static_cast<int>(budget / 2 / std::max(warm, 1e-7)),
                                  quick ? 1 : 3, quick ? 3 : 100);
  std::array<std::vector<double>, 2> times{std::vector<double>(reps), std::vector<double>(reps)};
  for (int r = 0; r < reps; ++r) {
    const bool a_first = r % 2 == 0;
    times[a_first ? 0 : 1][r] = time_once(a_first ? a : b);
    times[a_first ? 1 : 0][r] = time_once(a_first ? b : a);
  }
  for (auto& t : times) {
    MPI_Allreduce(MPI_IN_PLACE, t.data(), static_cast<int>(t.size()), MPI_DOUBLE, MPI_MAX,
                  MPI_COMM_WORLD);
  }
  return times;
}

std::string human(int64_t bytes) {
  if (bytes >= (1 << 20)) return concat(bytes >> 20, " MiB");
  return concat(bytes >> 10, " KiB");
}

}  // namespace

int run_comm(const BenchArgs& args) {
  auto world = comm::Communicator::world();
  const int p = world->size();
  const bool root = world->rank() == 0;
  TS_CHECK(p >= 2, "bench comm needs at least 2 ranks (torchspeed bench comm -n 2)");
  BenchReport report("comm");
  report.machine() = describe_machine(p);
  report.machine()["chunk_bytes"] = world->options().chunk_bytes();

  std::vector<int64_t> sizes;
  for (int64_t s = 4 << 10; s <= (int64_t{256} << 20); s *= 4) sizes.push_back(s);
  if (args.quick) sizes = {4 << 10, 1 << 20, 4 << 20, 16 << 20};
  if (root) {
    std::printf("bench comm: %d ranks, chunk %s; times are medians, bus bandwidth in GB/s\n", p,
                human(world->options().chunk_bytes()).c_str());
    std::printf("%-15s %9s %12s %12s %9s %9s %7s\n", "op", "size", "torchspeed s", "raw MPI s",
                "ts busbw", "mpi busbw", "ratio");
  }
  double min_ratio_1m[3] = {1e9, 1e9, 1e9};
  const char* op_names[3] = {"all_reduce", "reduce_scatter", "all_gather"};
  for (int64_t bytes : sizes) {
    const int64_t n = bytes / 4;  // fp32 elements of the full buffer
    at::Tensor ar = at::randn({n}), ar_raw = ar.clone();
    at::Tensor ar16 = at::randn({n}).to(at::kBFloat16);
    at::Tensor rs_in = at::randn({n}), rs_out = at::empty({n / p});
    at::Tensor ag_in = at::randn({n / p}), ag_out = at::empty({(n / p) * p});
    const int cnt_p = static_cast<int>(n / p);
    std::vector<Fn> fns = {
        [&] { world->all_reduce(ar); },
        [&] { MPI_Allreduce(MPI_IN_PLACE, ar_raw.data_ptr(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); },
        [&] { world->reduce_scatter(rs_in, rs_out); },
        [&] { MPI_Reduce_scatter_block(rs_in.data_ptr(), rs_out.data_ptr(), cnt_p, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); },
        [&] { world->all_gather(ag_in, ag_out); },
        [&] { MPI_Allgather(ag_in.data_ptr(), cnt_p, MPI_FLOAT, ag_out.data_ptr(), cnt_p, MPI_FLOAT, MPI_COMM_WORLD); },
    };
    std::vector<std::vector<double>> times;
    for (int op = 0; op < 3; ++op) {
      auto t = measure_pair(fns[2 * op], fns[2 * op + 1], args.quick);
      times.push_back(t[0]);
      times.push_back(t[1]);
    }
    // bf16 beside fp32 (ours both), same element count.
    auto pair16 = measure_pair(fns[0], [&] { world->all_reduce(ar16); }, args.quick);
    times.push_back(pair16[1]);
    const std::vector<double> fp32_beside_bf16 = pair16[0];
    for (int op = 0; op < 3; ++op) {
      const double ours = median(times[2 * op]), raw = median(times[2 * op + 1]);
      const double factor = op == 0 ? 2.0 * (p - 1) / p : static_cast<double>(p - 1) / p;
      const int64_t op_bytes = op == 0 ? bytes : cnt_p * int64_t{4} * p;
      const double bus_ours = op_bytes / ours * factor / 1e9, bus_raw = op_bytes / raw * factor / 1e9;
      const double ratio = raw / ours;
      if (bytes >= (1 << 20)) min_ratio_1m[op] = std::min(min_ratio_1m[op], ratio);
      for (int impl = 0; impl < 2; ++impl) {
        report.add_result({{"op", op_names[op]}, {"dtype", "float32"}, {"bytes", op_bytes},
                           {"impl", impl == 0 ? "torchspeed" : "mpi"},
                           {"seconds_median", impl == 0 ? ours : raw},
                           {"seconds", times[2 * op + impl]},
                           {"busbw_GBps", impl == 0 ? bus_ours : bus_raw}});
      }
      if (root) {
        std::printf("%-15s %9s %12.6f %12.6f %9.2f %9.2f %7.2f\n", op_names[op], human(op_bytes).c_str(),
                    ours, raw, bus_ours, bus_raw, ratio);
      }
      if (op == 0 && bytes >= (int64_t{64} << 20)) {
        report.add_target(concat("all_reduce fp32 ", human(bytes), ": torchspeed / single raw MPI call"),
                          ratio, 2.0);
      }
    }
    const double t32 = median(fp32_beside_bf16), t16 = median(times[6]);
    report.add_result({{"op", "all_reduce"}, {"dtype", "bfloat16"}, {"bytes", bytes / 2},
                       {"elements", n}, {"impl", "torchspeed"}, {"seconds_median", t16},
                       {"seconds", times[6]}, {"busbw_GBps", bytes / 2 / t16 * 2.0 * (p - 1) / p / 1e9}});
    if (root) {
      std::printf("%-15s %9s %12.6f %12s %9.2f %9s %7.2f  (bf16 vs fp32 elements/s)\n",
                  "all_reduce bf16", human(bytes / 2).c_str(), t16, "-",
                  bytes / 2 / t16 * 2.0 * (p - 1) / p / 1e9, "-", t32 / t16);
    }
    if (bytes >= (int64_t{16} << 20)) {
      report.add_target(concat("all_reduce bf16 / fp32 elements per second, ", n, " elements"),
                        t32 / t16, 1.5);
    }
    // 1-bit Adam's compressed all-reduce (comm/compressed.h) beside the fp32 one, same elements:
    // time, and the bytes each rank sent as the communicator counts them.
    if (bytes >= (1 << 20)) {
      comm::OneBitAllReduce onebit(world, n);
      at::Tensor cb = at::randn({n});
      const auto s0 = world->stats();
      onebit.run(cb);
      const auto s1 = world->stats();
      world->all_reduce(ar);
      const auto s2 = world->stats();
      auto sent = [](const comm::CommStats& a, const comm::CommStats& b) {
        int64_t d = 0;
        for (const auto& [op, st] : b) d += st.sent - (a.count(op) ? a.at(op).sent : 0);
        return d;
      };
      const int64_t sent_1bit = sent(s0, s1), sent_fp32 = sent(s1, s2);
      auto pair1 = measure_pair(fns[0], [&] { onebit.run(cb); }, args.quick);
      const double tf = median(pair1[0]), tc = median(pair1[1]);
      report.add_result({{"op", "all_reduce"}, {"dtype", "1-bit"}, {"bytes", bytes}, {"elements", n},
                         {"impl", "torchspeed"}, {"seconds_median", tc}, {"seconds", pair1[1]},
                         {"fp32_seconds_median", tf}, {"bytes_sent", sent_1bit}, {"fp32_bytes_sent", sent_fp32}});
      if (root) {
        std::printf("%-15s %9s %12.6f %12s %9s %9s %7.2f  (1-bit vs fp32 time; sent %s vs %s per rank)\n",
                    "all_reduce 1bit", human(bytes).c_str(), tc, "-", "-", "-", tf / tc,
                    concat(sent_1bit >> 10, " KiB").c_str(), concat(sent_fp32 >> 10, " KiB").c_str());
      }
    }
  }
  for (int op = 0; op < 3; ++op) {
    report.add_target(concat(op_names[op], " fp32: min over sizes >= 1 MiB of torchspeed / raw MPI"),
                      min_ratio_1m[op], 0.95);
  }
  if (root) report.finish(args);
  return 0;
}

}  // namespace torchspeed::bench
