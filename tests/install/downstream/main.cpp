// A user's program built against the installed torchspeed.
#include <ATen/ATen.h>
#include <torchspeed/torchspeed.h>

#include <cstdio>

int main() {
  const auto& rt = torchspeed::init();
  auto cfg = torchspeed::config::Config::parse({{"train_micro_batch_size_per_gpu", 4}},
                                               torchspeed::config::WorldShape{4, 2, 1});
  torchspeed::parallel::ProcessGrid grid(4, 2, 1);
  auto world = torchspeed::comm::Communicator::world();
  at::Tensor t = at::ones({8});
  world->all_reduce(t);
  std::printf("downstream ok: dp %d, micro batch %lld, world %d\n", grid.dp(),
              static_cast<long long>(cfg.train_micro_batch_size_per_gpu), rt.world_size);
  const bool ok = t[0].item<float>() == 1.0f;  // one rank: the sum is the value itself
  world.reset();
  torchspeed::shutdown();
  if (!ok) {
    std::fprintf(stderr, "downstream: all_reduce gave %f, expected 1\n", t[0].item<float>());
    return 1;
  }
  return 0;
}
