// Drives the checkpoint tests across fresh processes (tests/dist/checkpoint_tests.sh): trains the
// tiny GPT (dropout on, so the RNG must continue exactly) with the engine, optionally loading a
// checkpoint first and saving at a step, and writes what the tests compare: the dp-mean loss of
// every step as exact hex floats, and the final fp32 master weights as safetensors.
//
//   checkpoint_driver --stage S --precision fp32|bf16|fp16 --steps N [--gas G] [--dropout P] [--d-model D] [--pp P] [--tp T]
//       [--load DIR | --try-load DIR] [--save DIR (--save-at K | --save-every K) [--stop-after-save]]
//       [--keep-last K]
//       [--fault kill:R|fail:R] [--only-rank0-saves] [--comm-timeout S] [--offload SWAPDIR] --out PREFIX
//     --offload: optimizer state (stages 1-3) and parameters (stage 3) in swap files under SWAPDIR
//   checkpoint_driver --compare DIR_A DIR_B   (full optimizer state of two checkpoints equal?)
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "torchspeed/checkpoint/reshard.h"
#include "torchspeed/checkpoint/sharded.h"
#include "torchspeed/data/text.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"

using namespace torchspeed;

namespace {

struct Args {
  int stage = 0, steps = 4, gas = 2, save_at = -1, save_every = 0, keep_last = 0, d_model = 32, pp = 1, tp = 1;
  double dropout = 0.1, comm_timeout = 600;
  std::string precision = "fp32", load, try_load, save, fault, out, compare_a, compare_b, offload;
  bool stop_after_save = false, only_rank0_saves = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto v = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--stage") a.stage = std::stoi(v());
    else if (k == "--precision") a.precision = v();
    else if (k == "--steps") a.steps = std::stoi(v());
    else if (k == "--gas") a.gas = std::stoi(v());
    else if (k == "--d-model") a.d_model = std::stoi(v());
    else if (k == "--pp") a.pp = std::stoi(v());
    else if (k == "--tp") a.tp = std::stoi(v());
    else if (k == "--dropout") a.dropout = std::stod(v());
    else if (k == "--load") a.load = v();
    else if (k == "--save") a.save = v();
    else if (k == "--save-at") a.save_at = std::stoi(v());
    else if (k == "--save-every") a.save_every = std::stoi(v());
    else if (k == "--try-load") a.try_load = v();
    else if (k == "--keep-last") a.keep_last = std::stoi(v());
    else if (k == "--stop-after-save") a.stop_after_save = true;
    else if (k == "--only-rank0-saves") a.only_rank0_saves = true;
    else if (k == "--fault") a.fault = v();
    else if (k == "--comm-timeout") a.comm_timeout = std::stod(v());
    else if (k == "--out") a.out = v();
    else if (k == "--offload") a.offload = v();
    else if (k == "--compare") {
      a.compare_a = v();
      a.compare_b = v();
    } else {
      std::fprintf(stderr, "unknown argument %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

std::string hex(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%a", v);
  return buf;
}

// Every parameter's master, exp_avg and exp_avg_sq, whole, from a checkpoint's files.
int compare(const std::string& a, const std::string& b) {
  auto full = [](const std::string& path, const std::string& kind) {
    return checkpoint::full_state(checkpoint::open_local(path), kind);
  };
  int diffs = 0;
  for (const char* kind : {"master", "exp_avg", "exp_avg_sq"}) {
    const auto x = full(a, kind), y = full(b, kind);
    if (x.size() != y.size()) return std::printf("different parameter counts\n"), 1;
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i].first != y[i].first || !x[i].second.equal(y[i].second)) {
        std::printf("%s of %s differs\n", kind, x[i].first.c_str());
        ++diffs;
      }
    }
  }
  const auto ea = checkpoint::open_local(a).manifest["engine"], eb = checkpoint::open_local(b).manifest["engine"];
  for (const char* k : {"global_steps", "micro_steps", "optimizer_steps", "loss_scaler", "lr_schedule"}) {
    if (ea[k] != eb[k]) {
      std::printf("engine state %s differs: %s vs %s\n", k, ea[k].dump().c_str(), eb[k].dump().c_str());
      ++diffs;
    }
  }
  if (diffs == 0) std::printf("STATES_EQUAL\n");
  return diffs == 0 ? 0 : 1;
}

int run(const Args& a, const Runtime& rt) {
  const int world = rt.world_size;
  const int dp_size = world / (a.pp * a.tp);
  const int micro = 8 / (a.gas * dp_size) > 0 ? 8 / (a.gas * dp_size) : 1;  // global batch 8
  nlohmann::json j = {
      {"train_micro_batch_size_per_gpu", micro},
      {"gradient_accumulation_steps", a.gas},
      {"gradient_clipping", 1.0},
      {"bf16", {{"enabled", a.precision == "bf16"}}},
      {"fp16", {{"enabled", a.precision == "fp16"}, {"initial_scale_power", 12}, {"loss_scale_window", 2}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
      {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_max_lr", 3e-3}, {"warmup_num_steps", 3}}}}},
      {"zero_optimization", {{"stage", a.stage}, {"reduce_bucket_size", 3000}, {"stage3_param_persistence_threshold", 0}}},
      {"checkpoint", {{"keep_last", a.keep_last}}},
      {"pipeline", {{"stages", a.pp}}},
      {"tensor_parallel", {{"tp_size", a.tp}}},
      {"torchspeed", {{"comm_timeout_s", a.comm_timeout}}}};
  if (!a.offload.empty()) {
    j["zero_optimization"]["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", a.offload}, {"pipeline_read", true},
                                                   {"pipeline_write", true}};
    if (a.stage == 3) {
      j["zero_optimization"]["offload_param"] = {{"device", "nvme"}, {"nvme_path", a.offload}, {"max_in_cpu", 0}};
    }
  }
  config::WorldShape shape;
  shape.world_size = world;
  const auto cfg = config::Config::parse(j, shape);
  models::GPTConfig g;
  g.vocab = 256;
  g.seq_len = 16;
  g.d_model = a.d_model;
  g.n_layer = 2;
  g.n_head = 2;
  g.dropout = a.dropout;
  auto groups = make_groups(rt, cfg);
  auto engine = initialize(groups, models::gpt_spec(g, 7, groups.tp), cfg);
  // Deterministic text: a few thousand bytes of a repeating pattern with variation.
  data::TokenIds tokens(6000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(97 + (i * i / 7 + i / 13) % 26);
  const auto& dp = engine->groups().dp;
  data::TextLoader loader(tokens, g.seq_len, micro, dp->rank(), dp->size(), 11);
  // Dropout streams differ per data-parallel rank and agree across a tensor-parallel group (its
  // ranks hold the same replicated activations); tp is the fastest-varying grid dimension.
  torch::manual_seed(100 + rt.rank / a.tp);

  if (!a.load.empty()) {
    auto loaded = engine->load_checkpoint(a.load);
    if (!loaded) throw Error("no checkpoint in " + a.load);
    loader.load_state(loaded->client_state.at("data"));
  }
  // A load that must fail (damaged files) and leave the engine as it was: training goes on.
  if (!a.try_load.empty()) {
    try {
      engine->load_checkpoint(a.try_load);
      if (rt.is_rank0()) std::printf("LOADED (unexpectedly)\n");
    } catch (const Error& e) {
      if (rt.is_rank0()) std::printf("LOAD_FAILED: %s\n", e.what());
    }
  }
  // Saves when the step count reaches --save-at (also right after loading: a pure reshard).
  auto maybe_save = [&]() -> bool {
    const int64_t step = engine->global_step();
    if (step != a.save_at && !(a.save_every > 0 && step > 0 && step % a.save_every == 0)) return false;
    if (!a.fault.empty()) ::setenv("TORCHSPEED_CHECKPOINT_FAULT", a.fault.c_str(), 1);
    if (a.only_rank0_saves && !rt.is_rank0()) return false;
    try {
      engine->save_checkpoint(a.save, "", {{"data", loader.state()}});
      if (rt.is_rank0()) std::printf("SAVED step %ld\n", static_cast<long>(engine->global_step()));
    } catch (const CommError&) {
      throw;
    } catch (const Error& e) {
      // The tests of failed saves continue: training state must be intact.
      if (rt.is_rank0()) std::printf("SAVE_FAILED: %s\n", e.what());
    }
    std::fflush(stdout);
    return a.stop_after_save;
  };
  if (maybe_save()) return 0;
  std::ofstream losses;
  if (rt.is_rank0() && !a.out.empty()) losses.open(a.out + ".losses", std::ios::app);
  while (engine->global_step() < a.steps) {
    const double mean = engine->train_batch(loader);  // over micro-batches and data-parallel ranks
    if (losses.is_open()) losses << engine->global_step() << " " << hex(mean) << "\n" << std::flush;
    if (maybe_save()) return 0;
  }
  auto params = engine->master_params();
  if (rt.is_rank0() && !a.out.empty()) checkpoint::save_safetensors(a.out + ".params.safetensors", params);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const Runtime& rt = init();
  int rc = 0;
  try {
    rc = a.compare_a.empty() ? run(a, rt) : (rt.is_rank0() ? compare(a.compare_a, a.compare_b) : 0);
  } catch (const std::exception& e) {
    std::printf("ERROR rank %d: %s\n", rt.rank, e.what());
    std::fflush(stdout);
    rc = 1;
  }
  shutdown();
  return rc;
}
