// offload/: direct-I/O swap files (every aio setting round-trips bytes exactly; truncated,
// unwritable, full and shared files are errors naming the file) and the optimizer swapper
// (pieces streamed through the buffer pool keep exactly what was written, whatever the
// pipelining; a stale file of a dead run is replaced).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "test_util.h"
#include "torchspeed/config/config.h"
#include "torchspeed/engine/wiring.h"
#include "torchspeed/offload/aio.h"
#include "torchspeed/offload/optimizer_swapper.h"
#include "torchspeed/offload/param_swapper.h"

namespace fs = std::filesystem;
using torchspeed::offload::AioOptions;
using torchspeed::offload::AlignedBuffer;
using torchspeed::offload::OptimizerSwapper;
using torchspeed::offload::SwapFile;
using torchspeed::offload::SwapperOptions;
using ts_test::expect_error;

namespace {
std::string temp_dir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("ts-offload-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

void fill(void* p, size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  auto* b = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>(g());
}
}  // namespace

TEST(Offload, SwapFilesRoundTripBytesExactlyUnderEveryAioSetting) {
  const std::string dir = temp_dir("roundtrip");
  const int64_t bytes = 3 << 20;
  AlignedBuffer out(bytes, 4096), in(bytes, 4096);
  fill(out.data(), bytes, 7);
  for (int64_t block : {4096L, 65536L, 1L << 20})
    for (int depth : {1, 4, 32})
      for (bool single : {false, true})
        for (bool overlap : {false, true}) {
          SCOPED_TRACE(testing::Message() << "block " << block << " depth " << depth << " single " << single
                                          << " overlap " << overlap);
          SwapFile f(dir + "/f.swap", bytes, AioOptions().block_size(block).queue_depth(depth)
                                                 .single_submit(single).overlap_events(overlap));
          // Two writes in flight at once, then the reads of both halves.
          auto w1 = f.write(0, out.data(), bytes / 2);
          auto w2 = f.write(bytes / 2, static_cast<char*>(out.data()) + bytes / 2, bytes / 2);
          f.wait(w2);
          f.wait(w1);
          std::memset(in.data(), 0, bytes);
          auto r = f.read(0, in.data(), bytes);
          f.wait(r);
          ASSERT_EQ(std::memcmp(in.data(), out.data(), bytes), 0);
          EXPECT_EQ(f.bytes_written(), bytes);
          EXPECT_EQ(f.bytes_read(), bytes);
        }
  EXPECT_TRUE(fs::is_empty(dir));  // swap files are removed with their owner
  fs::remove_all(dir);
}

TEST(Offload, ATruncatedSwapFileIsAShortReadNamingTheFileAndOffset) {
  const std::string dir = temp_dir("truncated");
  const int64_t bytes = 1 << 20;
  AlignedBuffer buf(bytes, 4096);
  fill(buf.data(), bytes, 3);
  SwapFile f(dir + "/t.swap", bytes, AioOptions().block_size(262144));
  f.wait(f.write(0, buf.data(), bytes));
  fs::resize_file(dir + "/t.swap", 300000);  // someone cuts the file between steps
  expect_error([&] { f.wait(f.read(0, buf.data(), bytes)); },
               "short read at offset 262144 of swap file '" + dir + "/t.swap': 37856 of 262144 bytes");
  // The failure sticks: the state is not trusted again.
  expect_error([&] { f.wait(f.read(0, buf.data(), 4096)); }, "short read at offset 262144");
  fs::remove_all(dir);
}

TEST(Offload, UnusablePathsAreErrorsNamingThem) {
  expect_error([] { SwapFile f("/nonexistent-ts-dir/x.swap", 4096, AioOptions()); },
               "nvme_path '/nonexistent-ts-dir' does not exist");
  // /proc refuses new files even to root.
  expect_error([] { SwapFile f("/proc/x.swap", 4096, AioOptions()); },
               "cannot create files in nvme_path '/proc'");
  const std::string dir = temp_dir("notdir");
  std::ofstream(dir + "/file") << "x";
  expect_error([&] { SwapFile f(dir + "/file/x.swap", 4096, AioOptions()); }, "is not a directory");
  // A second job on the same file.
  SwapFile a(dir + "/shared.swap", 4096, AioOptions());
  expect_error([&] { SwapFile b(dir + "/shared.swap", 4096, AioOptions()); }, "is in use by another process");
  fs::remove_all(dir);
}

TEST(Offload, AFullFilesystemIsFoundWhenTheFileIsCreated) {
  const std::string dir = temp_dir("full");
  // A 1 MiB filesystem where the machine lets us mount one; else a 1 MiB file-size limit on
  // this process (the same failure to reserve, as EFBIG).
  const bool mounted = ::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") == 0;
  rlimit old{};
  if (!mounted) {
    ::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &old);
    rlimit lim = old;
    lim.rlim_cur = 1 << 20;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  }
  std::ofstream(dir + "/keep") << "the previous checkpoint";
  expect_error([&] { SwapFile f(dir + "/big.swap", 8 << 20, AioOptions()); },
               "cannot reserve 8388608 bytes for swap file '" + dir + "/big.swap'");
  EXPECT_FALSE(fs::exists(dir + "/big.swap"));  // nothing half-made is left
  {
    std::ifstream keep(dir + "/keep");
    std::string s;
    std::getline(keep, s);
    EXPECT_EQ(s, "the previous checkpoint");
  }
  if (mounted) {
    EXPECT_EQ(::umount(dir.c_str()), 0) << std::strerror(errno);
  } else {
    ::setrlimit(RLIMIT_FSIZE, &old);
  }
  fs::remove_all(dir);
}

TEST(Offload, TheSwapperKeepsEveryPieceWhateverThePipelining) {
  const std::string dir = temp_dir("swapper");
  // Pieces of uneven sizes, as the step cuts them; groups of at most 3000 elements.
  std::vector<torchspeed::zero::PieceRange> pieces;
  int64_t n = 0;
  for (int64_t len : {1000L, 1L, 2500L, 17L, 3000L, 640L, 999L, 5L}) {
    pieces.push_back({n, len});
    n += len;
  }
  for (int buffers : {2, 3, 8})
    for (bool pr : {false, true})
      for (bool pw : {false, true}) {
        SCOPED_TRACE(testing::Message() << "buffers " << buffers << " read ahead " << pr << " write behind " << pw);
        // A stale file of a dead run sits where ours goes: it is replaced, never read.
        { std::ofstream(dir + "/opt.swap") << std::string(100000, 'z'); }
        OptimizerSwapper s(SwapperOptions().path(dir + "/opt.swap").buffer_count(buffers).group_numel(3000)
                               .pipeline_read(pr).pipeline_write(pw).aio(AioOptions().block_size(8192).queue_depth(4)));
        s.open({"master", "exp_avg", "exp_avg_sq"}, n, pieces);
        auto value = [](size_t k, int64_t i, int round) { return static_cast<float>(k * 1000000 + i) + 0.5f * round; };
        s.visit([&](size_t p, float* const* st) {
          for (size_t k = 0; k < 3; ++k)
            for (int64_t j = 0; j < pieces[p].length; ++j) st[k][j] = value(k, pieces[p].begin + j, 0);
        }, /*read=*/false, /*write=*/true);
        for (int round = 1; round <= 3; ++round) {  // three "steps": read, check, update, write
          s.visit([&](size_t p, float* const* st) {
            for (size_t k = 0; k < 3; ++k)
              for (int64_t j = 0; j < pieces[p].length; ++j) {
                ASSERT_EQ(st[k][j], value(k, pieces[p].begin + j, round - 1)) << "piece " << p << " kind " << k;
                st[k][j] = value(k, pieces[p].begin + j, round);
              }
          }, true, true);
        }
        // Groups: [1000+1], [2500+17], [3000], [640+999+5] -> the largest record is 3 x 3000 floats,
        // padded; the pool is min(buffers, 4 groups) of them.
        s.flush();
        const int64_t record = 3 * ((3000 * 4 + 4095) / 4096 * 4096);
        EXPECT_EQ(s.resident_bytes(), std::min(buffers, 4) * record);
        const auto st = s.stats();
        EXPECT_EQ(st.bytes_read, 3 * s.offloaded_bytes());
        EXPECT_EQ(st.bytes_written, 4 * s.offloaded_bytes());
      }
  fs::remove_all(dir);
}

TEST(Offload, TheParameterSwapperReturnsTheLastWrittenShardPrefetchedOrInPieces) {
  const std::string dir = temp_dir("params");
  using torchspeed::offload::ParamSwapper;
  using torchspeed::offload::ParamSwapperOptions;
  // Unit 0 stays in RAM (max_in_cpu); unit 2 is larger than a buffer (read in pieces); unit 3 has
  // no shard (a persistent unit).
  const std::vector<int64_t> sizes = {4000, 10000, 50000, 0, 6000, 12000};
  ParamSwapper s(ParamSwapperOptions().path(dir + "/p.swap").buffer_count(3).buffer_bytes(16384)
                     .max_in_cpu_bytes(4000).aio(AioOptions().block_size(4096).queue_depth(4)));
  s.open(sizes);
  EXPECT_FALSE(s.holds(0));
  EXPECT_TRUE(s.holds(1));
  EXPECT_FALSE(s.holds(3));
  EXPECT_EQ(s.resident_bytes(), 3 * 16384);
  std::vector<std::vector<char>> data(sizes.size());
  auto put = [&](size_t u, uint32_t seed) {
    data[u].resize(static_cast<size_t>(sizes[u]));
    fill(data[u].data(), data[u].size(), seed);
    s.write(u, data[u].data());
  };
  auto check = [&](size_t u) {
    std::vector<char> got(static_cast<size_t>(sizes[u]), 0);
    s.read(u, got.data());
    EXPECT_EQ(got, data[u]) << "unit " << u;
  };
  for (size_t u : {1, 2, 4, 5}) put(u, static_cast<uint32_t>(u));
  for (size_t u : {1, 2, 4, 5}) check(u);  // read right behind the writes (waits for them)
  // Prefetch ahead as the gatherer does: the pool keeps one buffer free, so only two fit.
  EXPECT_TRUE(s.prefetch(1));
  EXPECT_TRUE(s.prefetch(2));  // too large to prefetch: fine, read in pieces later
  EXPECT_TRUE(s.prefetch(4));
  EXPECT_FALSE(s.prefetch(5));
  put(4, 44);  // a write after its prefetch: the prefetched copy is stale and dropped
  for (size_t u : {1, 2, 4, 5}) check(u);
  EXPECT_EQ(s.prefetch_hits(), 1);  // unit 1
  s.flush();
  fs::remove_all(dir);
}

// DeepSpeed's aio runs intra_op_parallelism threads with queue_depth requests each: the one
// io_uring ring keeps all of them in flight.
TEST(Offload, IntraOpParallelismMultipliesTheRequestsInFlight) {
  torchspeed::config::WorldShape w;
  auto cfg = torchspeed::config::Config::parse(
      {{"train_batch_size", 8}, {"aio", {{"queue_depth", 8}, {"intra_op_parallelism", 4}}}}, w);
  EXPECT_EQ(torchspeed::wiring::aio_options_of(cfg).queue_depth(), 32);
  auto old_name = torchspeed::config::Config::parse({{"train_batch_size", 8}, {"aio", {{"thread_count", 2}}}}, w);
  EXPECT_EQ(torchspeed::wiring::aio_options_of(old_name).queue_depth(), 16);
}
