// Config loading: every real DeepSpeed config, DeepSpeed's batch-size rules, DeepSpeed's
// defaults, and one test per documented error (each names its JSON path).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <cstdlib>

#include "test_util.h"
#include "torchspeed/config/config.h"
#include "torchspeed/config/json_reader.h"

using nlohmann::json;
using torchspeed::config::Config;
using torchspeed::config::ConfigError;
using torchspeed::config::WorldShape;

namespace {

WorldShape world(int n, int tp = 0, int pp = 0) {
  WorldShape w;
  w.world_size = n;
  w.tp = tp;
  w.pp = pp;
  return w;
}

// All error messages of parsing `j`, joined; "" when it parses.
std::string errors_of(const json& j, WorldShape w = world(1)) {
  return ts_test::config_errors([&] { Config::parse(j, w); });
}

void expect_error(const json& j, const std::string& needle, WorldShape w = world(1)) {
  std::string errs = errors_of(j, w);
  EXPECT_NE(errs.find(needle), std::string::npos)
      << "expected an error containing: " << needle << "\ngot: " << (errs.empty() ? "(no error)" : errs);
}

}  // namespace

TEST(Config, EveryRealDeepSpeedConfigLoads) {
  // (file, world) -> (train, micro, gas); at other world sizes the batch may not divide.
  struct Case {
    const char* file;
    int world;
    int64_t train, micro, gas;
  };
  const std::vector<Case> cases = {
      {"model_BingBertSquad_deepspeed_bsz24_fp16_zero2_config.json", 1, 24, 3, 8},
      {"model_BingBertSquad_deepspeed_bsz24_fp16_zero2_config.json", 2, 24, 3, 4},
      {"model_BingBertSquad_deepspeed_bsz24_fp16_zero2_config.json", 8, 24, 3, 1},
      {"model_BingBertSquad_deepspeed_bsz24_fp32_config.json", 4, 24, 3, 2},
      {"model_Megatron_GPT2_ds_config_func_bs4_zero2_offload.json", 2, 4, 2, 1},
      {"model_Megatron_GPT2_ds_config_func_bs8_zero0_gas3.json", 2, 48, 8, 3},
      {"model_Megatron_GPT2_ds_config_func_scheduler.json", 4, 4, 1, 1},
      {"model_Megatron_GPT2_ds_config_perf_bs16.json", 2, 16, 8, 1},
      {"unit_ds_batch_config.json", 2, 2, 1, 1},
      {"deepspeed_autotuning_config_templates_template_zero3.json", 2, 0, 0, 1},
  };
  size_t seen = 0;
  for (const auto& entry : std::filesystem::directory_iterator(TS_DS_CONFIGS_DIR)) {
    if (entry.path().extension() != ".json") continue;
    ++seen;
    bool covered = false;
    for (const auto& c : cases) {
      if (entry.path().filename() != c.file) continue;
      covered = true;
      Config cfg = Config::load(entry.path().string(), world(c.world));
      EXPECT_EQ(cfg.train_batch_size, c.train) << c.file;
      EXPECT_EQ(cfg.train_micro_batch_size_per_gpu, c.micro) << c.file;
      EXPECT_EQ(cfg.gradient_accumulation_steps, c.gas) << c.file;
    }
    EXPECT_TRUE(covered) << "new config without a test case: " << entry.path();
  }
  EXPECT_GE(seen, 8u) << "expected the real DeepSpeed configs in " << TS_DS_CONFIGS_DIR;
}

TEST(Config, RealConfigDetailsAreRead) {
  auto dir = std::string(TS_DS_CONFIGS_DIR) + "/";
  Config a = Config::load(dir + "model_Megatron_GPT2_ds_config_func_bs4_zero2_offload.json", world(2));
  EXPECT_EQ(a.zero.stage, 2);
  EXPECT_EQ(a.zero.reduce_bucket_size, 7000000);
  EXPECT_EQ(a.zero.offload_optimizer.device, torchspeed::config::OffloadDevice::kCpu);  // deprecated cpu_offload: true
  EXPECT_TRUE(a.fp16.enabled);
  EXPECT_TRUE(a.fp16.dynamic());
  EXPECT_EQ(a.fp16.initial_scale_power, 16);  // DeepSpeed default when not written
  bool deprecated_warned = false;
  for (const auto& w : a.warnings) deprecated_warned |= w.find("cpu_offload") != std::string::npos;
  EXPECT_TRUE(deprecated_warned);

  Config z3 = Config::load(dir + "deepspeed_autotuning_config_templates_template_zero3.json", world(2));
  EXPECT_EQ(z3.zero.stage, 3);
  EXPECT_EQ(z3.zero.allgather_bucket_size, 500000000);  // written 5e8
  EXPECT_EQ(z3.zero.sub_group_size, 1000000000000);     // written 1e12
  EXPECT_EQ(z3.zero.param_persistence_threshold, 1000000);
  EXPECT_FALSE(z3.zero.overlap_comm);
  EXPECT_THROW(z3.check_batch_sizes(), torchspeed::Error);

  Config b = Config::load(dir + "model_BingBertSquad_deepspeed_bsz24_fp32_config.json", world(1));
  EXPECT_EQ(b.optimizer.type, torchspeed::optim::OptimizerType::kAdam);
  EXPECT_STREQ(b.optimizer.name(), "Adam");
  EXPECT_FALSE(b.optimizer.bias_correction);
  EXPECT_DOUBLE_EQ(b.optimizer.lr, 3e-5);
  EXPECT_DOUBLE_EQ(b.gradient_clipping, 1.0);

  Config s = Config::load(dir + "model_Megatron_GPT2_ds_config_func_scheduler.json", world(1));
  EXPECT_EQ(s.scheduler.type, "WarmupLR");
  EXPECT_DOUBLE_EQ(s.scheduler.param("warmup_max_lr"), 0.001);
  EXPECT_DOUBLE_EQ(s.scheduler.param("warmup_num_steps"), 10);
}

TEST(Config, BatchSizeDerivationFollowsDeepSpeed) {
  struct Case {
    json j;
    int world;
    int64_t train, micro, gas;
  };
  const std::vector<Case> ok = {
      {{{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 4}, {"gradient_accumulation_steps", 2}}, 4, 32, 4, 2},
      {{{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 4}}, 4, 32, 4, 2},
      {{{"train_batch_size", 32}, {"gradient_accumulation_steps", 2}}, 4, 32, 4, 2},
      {{{"train_micro_batch_size_per_gpu", 4}, {"gradient_accumulation_steps", 2}}, 4, 32, 4, 2},
      {{{"train_batch_size", 32}}, 4, 32, 8, 1},
      {{{"train_micro_batch_size_per_gpu", 4}}, 4, 16, 4, 1},
  };
  for (const auto& c : ok) {
    Config cfg = Config::parse(c.j, world(c.world));
    EXPECT_EQ(cfg.train_batch_size, c.train) << c.j;
    EXPECT_EQ(cfg.train_micro_batch_size_per_gpu, c.micro) << c.j;
    EXPECT_EQ(cfg.gradient_accumulation_steps, c.gas) << c.j;
  }
  // dp counts only data-parallel ranks: 8 ranks with tp 2 and pp 2 is dp 2.
  Config g = Config::parse({{"train_batch_size", 16}, {"train_micro_batch_size_per_gpu", 2}}, world(8, 2, 2));
  EXPECT_EQ(g.dp, 2);
  EXPECT_EQ(g.gradient_accumulation_steps, 4);

  expect_error({{"train_batch_size", 30}, {"train_micro_batch_size_per_gpu", 4}, {"gradient_accumulation_steps", 2}},
               "train_batch_size: 30 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2", world(4));
  expect_error({{"train_batch_size", 24}, {"train_micro_batch_size_per_gpu", 3}}, "is not divisible by", world(3));
  expect_error({{"train_batch_size", 0}}, "train_batch_size: must be in [1, 2147483648], got 0");
  expect_error({{"train_batch_size", 8}}, "does not divide the world size 6", world(6, 4, 1));
}

// The communication deadline: torchspeed.comm_timeout_s when given, else the environment's
// TORCHSPEED_COMM_TIMEOUT_S (as every communicator), else 600 s. A job used to ignore the
// environment and wait 600 s for a host that was gone.
TEST(Config, CommTimeoutFollowsTheEnvironmentUnlessTheConfigSetsIt) {
  const nlohmann::json base = {{"train_batch_size", 4}, {"train_micro_batch_size_per_gpu", 4}};
  ::unsetenv("TORCHSPEED_COMM_TIMEOUT_S");
  EXPECT_EQ(Config::parse(base, world(1)).torchspeed.comm_timeout_s, 600.0);
  ::setenv("TORCHSPEED_COMM_TIMEOUT_S", "12.5", 1);
  EXPECT_EQ(Config::parse(base, world(1)).torchspeed.comm_timeout_s, 12.5);
  nlohmann::json set = base;
  set["torchspeed"] = {{"comm_timeout_s", 30}};
  EXPECT_EQ(Config::parse(set, world(1)).torchspeed.comm_timeout_s, 30.0);
  ::unsetenv("TORCHSPEED_COMM_TIMEOUT_S");
}

TEST(Config, UnknownKeysSuggestTheNearestKnownKey) {
  expect_error({{"train_batch_size", 8}, {"zero_optimisation", {{"stage", 2}}}},
               "zero_optimisation: unknown key; did you mean \"zero_optimization\"?");
  expect_error({{"train_batch_size", 8}, {"zero_optimization", {{"stagee", 2}}}},
               "zero_optimization.stagee: unknown key; did you mean \"stage\"?");
  expect_error({{"train_batch_size", 8}, {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"beta", {0.9, 0.99}}}}}}},
               "optimizer.params.beta: unknown key; did you mean \"betas\"?");
  // A key like no known one is a warning (DeepSpeed ignores it), unless unknown_keys is "error".
  Config far = Config::parse({{"train_batch_size", 8}, {"my_cluster_tag", "0,1"}});
  ASSERT_EQ(far.warnings.size(), 1u);
  EXPECT_NE(far.warnings[0].find("my_cluster_tag: unknown key, ignored as DeepSpeed ignores it"),
            std::string::npos) << far.warnings[0];
  expect_error({{"train_batch_size", 8}, {"my_cluster_tag", "0,1"}, {"torchspeed", {{"unknown_keys", "error"}}}},
               "my_cluster_tag: unknown key (\"torchspeed\": {\"unknown_keys\": \"error\"}");
  // "warn" turns the typos into warnings too.
  Config c = Config::parse({{"train_batch_size", 8}, {"zero_optimisation", {{"stage", 2}}},
                            {"torchspeed", {{"unknown_keys", "warn"}}}});
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("zero_optimisation: unknown key, ignored as DeepSpeed ignores it (did you mean "
                               "\"zero_optimization\"?)"),
            std::string::npos) << c.warnings[0];
}

// "auto" as the Hugging Face Trainer fills it (Note ["auto" values] in config.cpp).
TEST(Config, AutoValuesAreResolvedAsTheHuggingFaceTrainerDoes) {
  const json hf = {{"train_batch_size", "auto"},
                   {"train_micro_batch_size_per_gpu", "auto"},
                   {"gradient_accumulation_steps", "auto"},
                   {"gradient_clipping", "auto"},
                   {"bf16", {{"enabled", "auto"}}},
                   {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", "auto"}, {"betas", "auto"}, {"eps", "auto"},
                                                                 {"weight_decay", "auto"}}}}},
                   {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_min_lr", "auto"}, {"warmup_max_lr", "auto"},
                                                                    {"warmup_num_steps", "auto"}}}}},
                   {"zero_optimization", {{"stage", 3}, {"reduce_bucket_size", "auto"},
                                          {"stage3_prefetch_bucket_size", "auto"},
                                          {"stage3_param_persistence_threshold", "auto"},
                                          {"stage3_max_live_parameters", "auto"}}}};
  // TrainingArguments' defaults: 8 per device, no accumulation, clipping 1.0, lr 5e-5.
  Config c = Config::parse(hf, world(4));
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.train_batch_size, 32);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_FALSE(c.bf16.enabled);
  EXPECT_EQ(c.optimizer.lr, 5e-5);
  EXPECT_EQ(c.optimizer.betas, (std::vector<double>{0.9, 0.999}));
  EXPECT_EQ(c.optimizer.eps, 1e-8);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_EQ(c.scheduler.param("warmup_max_lr"), 5e-5);
  EXPECT_EQ(c.scheduler.param("warmup_num_steps"), 0.0);
  // Without a hidden size the bucket sizes are DeepSpeed's defaults, as DeepSpeed reads "auto".
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.zero.prefetch_bucket_size, 50000000);
  EXPECT_EQ(c.zero.max_live_parameters, 1000000000);
  // Every filled value is said, with where it came from.
  std::string all;
  for (const auto& w : c.warnings) all += w + "\n";
  EXPECT_NE(all.find("train_micro_batch_size_per_gpu: \"auto\" -> 8 (Hugging Face TrainingArguments' default "
                     "per_device_train_batch_size)"), std::string::npos) << all;
  EXPECT_NE(all.find("train_batch_size: \"auto\" -> derived"), std::string::npos) << all;
  EXPECT_NE(all.find("zero_optimization.stage3_max_live_parameters: \"auto\" -> DeepSpeed's default"),
            std::string::npos) << all;

  // What a trainer supplies (torchspeed train: train.steps and model.d_model).
  torchspeed::config::AutoValues a;
  a.per_device_train_batch_size = 2;
  a.gradient_accumulation_steps = 4;
  a.learning_rate = 3e-4;
  a.bf16 = true;
  a.hidden_size = 64;
  a.max_steps = 1000;
  json with_total = hf;
  with_total["scheduler"] = {{"type", "WarmupDecayLR"}, {"params", {{"total_num_steps", "auto"}, {"warmup_num_steps", "auto"}}}};
  Config t = Config::parse(with_total, world(2), a);
  EXPECT_EQ(t.train_batch_size, 16);
  EXPECT_EQ(t.gradient_accumulation_steps, 4);
  EXPECT_TRUE(t.bf16.enabled);
  EXPECT_EQ(t.optimizer.lr, 3e-4);
  EXPECT_EQ(t.scheduler.param("total_num_steps"), 1000.0);
  EXPECT_EQ(t.zero.reduce_bucket_size, 64 * 64);
  EXPECT_EQ(t.zero.prefetch_bucket_size, static_cast<int64_t>(0.9 * 64 * 64));
  EXPECT_EQ(t.zero.param_persistence_threshold, 640);

  // Batch sizes are derived from the ones given: 64 over dp 4 with 2 micro-batches.
  Config d = Config::parse({{"train_batch_size", 64}, {"train_micro_batch_size_per_gpu", "auto"},
                            {"gradient_accumulation_steps", 2}}, world(4));
  EXPECT_EQ(d.train_micro_batch_size_per_gpu, 8);
  // What cannot be derived is an error naming the key and what to give.
  expect_error(with_total, "scheduler.params.total_num_steps: \"auto\" needs the number of training steps");
  expect_error({{"train_batch_size", 8}, {"steps_per_print", "auto"}}, "steps_per_print: \"auto\" cannot be derived here; give a value");
  expect_error({{"train_batch_size", 8}, {"optimizer", {{"type", "AdamW"}, {"params", {{"amsgrad", "auto"}}}}}},
               "optimizer.params.amsgrad: \"auto\" cannot be derived here");
}

// Configs gathered from DeepSpeed's, DeepSpeedExamples' and accelerate's repositories
// (tests/data/ds-configs-real/SOURCES.md), each tried at world sizes 1 to 64: the ones that load,
// and each refusal naming its key and why. The list of refusals is what torchspeed does not have;
// any other failure, or a listed one that starts loading, fails the test.
TEST(Config, RealConfigsFromDeepSpeedRepositoriesLoadOrAreRefusedByName) {
  const std::map<std::string, std::string> refused = {
      // DeepSpeed features torchspeed does not have (enabled in the file).
      {"DeepSpeedExamples__training__bing_bert__deepspeed_bsz4k_progressive_layer_drop_config_seq128.json",
       "progressive_layer_drop: is a DeepSpeed feature"},
      {"DeepSpeed__tests__model__BingBertSquad__deepspeed_bsz24_fp16_eigenvalue_quantize_config.json",
       "eigenvalue: is a DeepSpeed feature"},
      {"DeepSpeedExamples__training__DeepSpeed-ZenFlow__finetuning__zf_config.json", "zero_optimization.zenflow: ZenFlow"},
      {"DeepSpeed__tests__torch_compile__ds_config_z3_deepcompile_no_persist.json", "compile: deepcompile"},
      {"DeepSpeedExamples__training__bf16_master_weight__configs__bf16_full.json",
       "bf16.bf16_master_weights_and_grads: torchspeed keeps fp32 master weights"},
      {"DeepSpeedExamples__benchmarks__autosp__configs__autosp_config.json", "compile: deepcompile"},
      // Pruning is not available (quantization-aware training is).
      {"DeepSpeedExamples__compression__cifar__config__ds_config_channel_prune.json",
       "compression_training.channel_pruning.shared_parameters: enabled is true: channel pruning"},
  };
  // What a trainer supplies for "auto" values (the number of steps, the model's hidden size).
  torchspeed::config::AutoValues trainer;
  trainer.max_steps = 1000;
  trainer.hidden_size = 768;
  size_t total = 0, loaded = 0, refused_as_listed = 0;
  for (const auto& entry : std::filesystem::directory_iterator(TS_DS_REAL_DIR)) {
    if (entry.path().extension() != ".json") continue;
    ++total;
    const std::string name = entry.path().filename().string();
    std::string errors;
    bool ok = false;
    for (int w : {1, 2, 4, 8, 16, 32, 64}) {
      try {
        Config::load(entry.path().string(), world(w), trainer);
        ok = true;
        break;
      } catch (const ConfigError& e) {
        if (!errors.empty()) continue;  // the first world size's errors
        for (const auto& m : e.errors()) errors += m + "\n";
      }
    }
    const auto it = refused.find(name);
    if (ok) {
      ++loaded;
      EXPECT_TRUE(it == refused.end()) << name << " loads now: take it off the list of refusals";
    } else if (it != refused.end()) {
      ++refused_as_listed;
      EXPECT_NE(errors.find(it->second), std::string::npos) << name << ":\n" << errors;
    } else {
      ADD_FAILURE() << name << " does not load:\n" << errors;
    }
  }
  std::printf("real DeepSpeed configs: %zu of %zu load (%.0f%%), %zu refused by name\n", loaded, total,
              100.0 * static_cast<double>(loaded) / static_cast<double>(total), refused_as_listed);
  EXPECT_GE(total, 70u) << "expected the configs of " << TS_DS_REAL_DIR;
  EXPECT_EQ(loaded + refused_as_listed, total);
}

TEST(Config, TypeAndRangeErrorsNameTheJsonPath) {
  const json base = {{"train_batch_size", 8}};
  auto with = [&](const json& extra) {
    json j = base;
    j.update(extra);
    return j;
  };
  expect_error(with({{"zero_optimization", {{"stage", "two"}}}}),
               "zero_optimization.stage: expected an integer, found string \"two\"");
  expect_error(with({{"zero_optimization", {{"stage", 4}}}}), "zero_optimization.stage: must be in [0, 3], got 4");
  expect_error(with({{"zero_optimization", {{"reduce_bucket_size", 1.5}}}}),
               "zero_optimization.reduce_bucket_size: expected an integer, found number 1.5");
  expect_error(with({{"fp16", {{"enabled", "yes"}}}}), "fp16.enabled: expected true or false");
  expect_error(with({{"fp16", {{"enabled", true}}}, {"bf16", {{"enabled", true}}}}),
               "fp16.enabled and bf16.enabled are both true");
  expect_error(with({{"autotuning", {{"enabled", true}, {"tuner_type", "model_based"}}}}),
               "autotuning.tuner_type: \"model_based\" (DeepSpeed's XGBoost cost model) is not available");
  expect_error(with({{"autotuning", {{"enabled", true}, {"start_profile_step", 5}, {"end_profile_step", 5}}}}),
               "autotuning.end_profile_step: 5 must be after start_profile_step 5");
  expect_error(with({{"autotuning", {{"enabled", true}, {"model_info", {{"profile", true}}}}}}),
               "autotuning.model_info: profile: true");
  expect_error(with({{"autotuning", {{"enabled", true}, {"metric", "speed"}}}}), "autotuning.metric:");
  expect_error(with({{"autotuning", {{"enabled", true}, {"fast", false}}}}), "autotuning.fast: false (DeepSpeed then also tunes");
  expect_error(with({{"optimizer", {{"type", "Adagrad"}}}}),
               "optimizer.type: \"Adagrad\" is a DeepSpeed optimizer torchspeed does not have");
  expect_error(with({{"optimizer", {{"type", "ZeroOneAdam"}}}, {"zero_optimization", {{"stage", 1}}}}),
               "optimizer: type ZeroOneAdam needs zero_optimization.stage 0, got 1");
  expect_error(with({{"optimizer", {{"type", "OneBitLamb"}}}, {"fp16", {{"enabled", true}, {"loss_scale", 128}}}}),
               "fp16.loss_scale: 128: OneBitLamb needs dynamic loss scaling");
  expect_error(with({{"optimizer", {{"type", "OneBitLamb"}, {"params", {{"factor_min", 5.0}}}}}}),
               "optimizer.params.factor_min: 5 is above factor_max 4");
  expect_error(with({{"optimizer", {{"type", "ZeroOneAdam"}, {"params", {{"local_step_clipper", 0}}}}}}),
               "optimizer.params.local_step_clipper: must be");
  expect_error(with({{"optimizer", {{"type", "OnebitAdam"}}}, {"zero_optimization", {{"stage", 2}}}}),
               "optimizer: type OneBitAdam needs zero_optimization.stage 0, got 2");
  expect_error(with({{"optimizer", {{"type", "Lamb"}, {"params", {{"max_grad_norm", 1.0}}}}}}),
               "optimizer.params.max_grad_norm: is not an optimizer parameter");
  expect_error(with({{"optimizer", {{"type", "Lamb"}, {"params", {{"max_coeff", 0.1}, {"min_coeff", 0.5}}}}}}),
               "optimizer.params.min_coeff: 0.5 is above max_coeff 0.1");
  expect_error(with({{"optimizer", {{"type", "Adamm"}}}}), "(did you mean \"Adam\"?)");
  expect_error(with({{"optimizer", {{"type", "AdamW"}, {"params", {{"betas", {0.9}}}}}}}),
               "optimizer.params.betas: expected a list of 2 numbers");
  expect_error(with({{"scheduler", {{"type", "WarmupDecayLR"}, {"params", {{"warmup_num_steps", 10}}}}}}),
               "scheduler.params.total_num_steps: is required for WarmupDecayLR");
  expect_error(with({{"zero_optimization", {{"stage", 3}, {"offload_param", {{"device", "nvme"}}}}}}),
               "zero_optimization.offload_param.nvme_path: is required when device is \"nvme\"");
  expect_error(with({{"zero_optimization", {{"stage", 3}, {"offload_param",
                       {{"device", "nvme"}, {"nvme_path", "/x"}, {"buffer_count", 1}}}}}}),
               "zero_optimization.offload_param.buffer_count: must be at least 2");
  expect_error(with({{"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.3}}}}}}),
               "zero_optimization.offload_optimizer.ratio: a partial offload");
  expect_error(with({{"zero_optimization", {{"stage", 2}, {"offload_optimizer",
                       {{"device", "nvme"}, {"nvme_path", "/x"}, {"buffer_count", 1}}}}}}),
               "zero_optimization.offload_optimizer.buffer_count: must be at least 2");
  expect_error(with({{"zero_optimization", {{"stage", 0}, {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/x"}}}}}}),
               "optimizer offload needs ZeRO stage 1, 2 or 3");
  expect_error(with({{"aio", {{"thread_count", 1000}, {"queue_depth", 8}}}}),
               "aio.thread_count: queue_depth 8 x 1000 requests in flight is over 4096");
  expect_error(with({{"aio", {{"block_size", 1000}}}}), "aio.block_size: must be a multiple of 512");
  expect_error(with({{"aio", {{"queu_depth", 8}}}}), "aio.queu_depth: unknown key; did you mean \"queue_depth\"?");
  expect_error(with({{"amp", {{"enabled", true}}}}), "amp: is a DeepSpeed feature torchspeed does not have");
  expect_error(with({{"zero_optimization", {{"stage", 2}}}, {"pipeline", {{"stages", 2}}}}),
               "cannot be combined with pipeline parallelism", world(2));
  expect_error(json::array({1, 2}), "expected a JSON object");
}

TEST(Config, OffloadAndAioKeysAreReadWithDeepSpeedsDefaults) {
  Config d = Config::parse({{"train_micro_batch_size_per_gpu", 1},
                            {"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/tmp"}}}}}},
                           world(1));
  EXPECT_EQ(d.zero.offload_optimizer.buffer_count, 4);
  EXPECT_FALSE(d.zero.offload_optimizer.pipeline_read);
  EXPECT_FALSE(d.zero.offload_optimizer.pipeline_write);
  EXPECT_EQ(d.aio.block_size, 1048576);
  EXPECT_EQ(d.aio.queue_depth, 8);
  EXPECT_TRUE(d.aio.overlap_events);
  EXPECT_FALSE(d.aio.single_submit);
  Config c = Config::parse({{"train_micro_batch_size_per_gpu", 1},
                            {"zero_optimization", {{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}, {"pipeline", true}}},
                                                   {"offload_param", {{"device", "cpu"}, {"pin_memory", true}}}}},
                            {"aio", {{"block_size", 262144}, {"queue_depth", 16}, {"thread_count", 1},
                                     {"single_submit", true}, {"overlap_events", false}}}},
                           world(1));
  EXPECT_TRUE(c.zero.offload_optimizer.pipeline_read && c.zero.offload_optimizer.pipeline_write);
  EXPECT_EQ(c.aio.block_size, 262144);
  EXPECT_EQ(c.aio.queue_depth, 16);
  EXPECT_TRUE(c.aio.single_submit);
  EXPECT_FALSE(c.aio.overlap_events);
  EXPECT_EQ(c.to_json()["aio"]["queue_depth"], 16);
  // device "cpu" is said to be the in-memory path; pin_memory to have no effect.
  std::string all;
  for (const auto& w : c.warnings) all += w + "\n";
  EXPECT_NE(all.find("zero_optimization.offload_optimizer.device: \"cpu\": on this CPU-only machine the state "
                     "already lives in host memory"), std::string::npos) << all;
  EXPECT_NE(all.find("zero_optimization.offload_param.pin_memory: has no effect without a device"), std::string::npos)
      << all;
  EXPECT_NE(all.find("zero_optimization.offload_optimizer.pipeline"), std::string::npos) << all;  // deprecated name
}

TEST(Config, EveryErrorIsReportedAtOnce) {
  std::string errs = errors_of({{"train_batch_size", 8},
                                {"zero_optimization", {{"stage", 9}}},
                                {"fp16", {{"hysteresis", 0}}},
                                {"gradient_clippin", 1.0}});
  EXPECT_NE(errs.find("zero_optimization.stage"), std::string::npos) << errs;
  EXPECT_NE(errs.find("fp16.hysteresis: must be"), std::string::npos) << errs;
  EXPECT_NE(errs.find("gradient_clippin: unknown key; did you mean \"gradient_clipping\"?"), std::string::npos) << errs;
}

TEST(Config, DefaultsAreDeepSpeeds) {
  Config c = Config::parse({{"train_batch_size", 8}, {"fp16", {{"enabled", true}}}, {"zero_optimization", {{"stage", 3}}}});
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_FALSE(c.fp16.consecutive_hysteresis);
  EXPECT_DOUBLE_EQ(c.fp16.min_loss_scale, 1.0);
  EXPECT_TRUE(c.zero.overlap_comm);  // stage 3 overlaps by default
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.zero.prefetch_bucket_size, 50000000);
  EXPECT_EQ(c.zero.param_persistence_threshold, 100000);
  EXPECT_EQ(c.steps_per_print, 10);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 0.0);
  Config s = Config::parse({{"train_batch_size", 8}, {"scheduler", {{"type", "WarmupCosineLR"}, {"params", {{"total_num_steps", 100}}}}}});
  EXPECT_DOUBLE_EQ(s.scheduler.param("cos_min_ratio"), 0.0001);
  EXPECT_DOUBLE_EQ(s.scheduler.param("warmup_num_steps"), 1000);
  EXPECT_EQ(s.scheduler.warmup_type, "log");
}

TEST(Config, ResolvedJsonParsesBackToItself) {
  json j = {{"train_micro_batch_size_per_gpu", 2}, {"gradient_accumulation_steps", 3},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-4}, {"weight_decay", 0.1}}}}},
            {"scheduler", {{"type", "OneCycle"}, {"params", {{"cycle_min_lr", 1e-4}, {"cycle_max_lr", 1e-3}}}}},
            {"bf16", {{"enabled", true}}}, {"zero_optimization", {{"stage", 2}}}, {"gradient_clipping", 1.0}};
  Config a = Config::parse(j, world(2));
  json resolved = a.to_json();
  resolved.erase("world");
  Config b = Config::parse(resolved, world(2));
  json again = b.to_json();
  again.erase("world");
  EXPECT_EQ(resolved, again);
  EXPECT_EQ(b.train_batch_size, 12);
  EXPECT_DOUBLE_EQ(b.scheduler.param("cycle_second_step_size"), 2000);  // defaults to the first
}

TEST(Config, InvalidJsonNamesFileLineAndColumn) {
  auto path = std::filesystem::temp_directory_path() / "ts_bad_config.json";
  {
    std::ofstream out(path);
    out << "{\n  \"train_batch_size\": 8,\n  \"fp16\": {\"enabled\": tru}\n}\n";
  }
  try {
    Config::load(path.string());
    FAIL() << "expected an error";
  } catch (const ConfigError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(path.string() + ": invalid JSON at byte"), std::string::npos) << msg;
    EXPECT_NE(msg.find("line 3, column"), std::string::npos) << msg;
  }
  EXPECT_THROW(Config::load("/nonexistent/ts.json"), torchspeed::Error);
  std::filesystem::remove(path);
}

TEST(Config, NearestKeyIsConservative) {
  using torchspeed::config::nearest_key;
  EXPECT_EQ(nearest_key("zero_optimisation", {"zero_optimization", "optimizer"}), "zero_optimization");
  EXPECT_EQ(nearest_key("banana", {"zero_optimization", "optimizer", "fp16"}), "");
}

// Issue 13 item 4: every DeepSpeed key torchspeed accepts does what DeepSpeed documents, or is
// refused with its path (the value torchspeed cannot honour), or warns that it has no effect.
TEST(Config, KeysTorchspeedCannotHonourAreRefusedWithTheirPath) {
  const json base = {{"train_batch_size", 8}};
  auto with = [&](json extra) {
    json j = base;
    j.merge_patch(extra);
    return j;
  };
  expect_error(with({{"zero_optimization", {{"load_from_fp32_weights", false}}}}),
               "zero_optimization.load_from_fp32_weights: torchspeed always restores");
  expect_error(with({{"zero_optimization", {{"ignore_unused_parameters", false}}}}),
               "zero_optimization.ignore_unused_parameters: torchspeed reduces zeros");
  // hpZ and qwZ act on stage 3's parameter gathers: accepted there, refused below.
  expect_error(with({{"zero_optimization", {{"zero_hpz_partition_size", 8}, {"stage", 2}}}}),
               "zero_optimization.zero_hpz_partition_size: ZeRO++ hierarchical partitioning (hpZ) keeps a secondary copy "
               "of stage 3's parameter shards: it needs stage 3, and stage is 2");
  expect_error(with({{"zero_optimization", {{"zero_hpz_partition_size", 0}, {"stage", 3}}}}),
               "zero_optimization.zero_hpz_partition_size");
  {
    const auto c = Config::parse(with({{"zero_optimization", {{"zero_hpz_partition_size", 8}, {"stage", 3},
                                                               {"zero_quantized_weights", true}}}}),
                                 world(8));
    EXPECT_EQ(c.zero.hpz_partition_size, 8);
    EXPECT_TRUE(c.zero.quantized_weights);
    const auto again = Config::parse(c.to_json(), world(8));
    EXPECT_EQ(again.zero.hpz_partition_size, 8);
    EXPECT_TRUE(again.zero.quantized_weights);
  }
  // qgZ is accepted at stages 2-3 (it replaces their reduce-scatter); below, it is refused.
  expect_error(with({{"zero_optimization", {{"zero_quantized_gradients", true}, {"stage", 1}}}}),
               "zero_optimization.zero_quantized_gradients: ZeRO++ quantized gradients (qgZ) quantize the gradients' "
               "reduce-scatter: they need stage 2 or 3, and stage is 1");
  expect_error(with({{"zero_optimization", {{"zero_quantized_gradients", true}, {"stage", 2}, {"reduce_scatter", false}}}}),
               "zero_optimization.zero_quantized_gradients: ZeRO++ quantized gradients (qgZ) replace the reduce-scatter");
  expect_error(with({{"zero_optimization", {{"zero_quantized_weights", true}, {"stage", 1}}}}),
               "zero_optimization.zero_quantized_weights: ZeRO++ quantized weights (qwZ) quantize stage 3's parameter "
               "all-gather: they need stage 3, and stage is 1");
  expect_error(with({{"zero_optimization", {{"mics_shard_size", 4}}}}), "zero_optimization.mics_shard_size: MiCS");
  expect_error(with({{"checkpoint", {{"use_node_local_storage", true}}}}),
               "checkpoint.use_node_local_storage: torchspeed checkpoints need one folder");
  expect_error(with({{"pipeline", {{"stages", "auto"}}}}),
               "pipeline.stages: \"auto\" is not available in torchspeed");
  expect_error(with({{"data_types", {{"grad_accum_dtype", "fp16"}}}}), "data_types.grad_accum_dtype: torchspeed accumulates");
  expect_error(with({{"data_types", {{"grad_accum_dtype", "bf16"}}}}), "data_types.grad_accum_dtype: bf16 accumulation needs");
  expect_error(with({{"data_types", {{"grad_accum_dtype", "int8"}}}}), "data_types.grad_accum_dtype");
  // The values torchspeed always has are accepted silently.
  Config ok = Config::parse(with({{"zero_optimization", {{"contiguous_gradients", true}, {"allgather_partitions", true},
                                                         {"load_from_fp32_weights", true}, {"reduce_scatter", false},
                                                         {"sub_group_size", 1000}}},
                                  {"activation_checkpointing", {{"cpu_checkpointing", true},
                                                                {"synchronize_checkpoint_boundary", true}}},
                                  {"bf16", {{"enabled", true}}},
                                  {"data_types", {{"grad_accum_dtype", "bf16"}}}}),
                            world(1));
  EXPECT_TRUE(ok.warnings.empty()) << ok.warnings.front();
  EXPECT_FALSE(ok.zero.reduce_scatter);
  EXPECT_EQ(ok.zero.sub_group_size, 1000);
  EXPECT_EQ(ok.grad_accum_dtype, "bf16");
  EXPECT_EQ(ok.to_json()["data_types"]["grad_accum_dtype"], "bf16");
}

TEST(Config, KnobsWithoutEffectWarnWithTheirPath) {
  for (const auto& [section, key, value] : std::vector<std::tuple<std::string, std::string, json>>{
           {"zero_optimization", "allgather_bucket_size", 1000},
           {"zero_optimization", "contiguous_gradients", false},
           {"zero_optimization", "allgather_partitions", false},
           {"zero_optimization", "round_robin_gradients", true},
           {"zero_optimization", "stage3_max_reuse_distance", 1000},
           {"zero_optimization", "stage3_model_persistence_threshold", 1000},
           {"zero_optimization", "legacy_stage1", true},
           {"zero_optimization", "memory_efficient_linear", true},
           {"activation_checkpointing", "number_checkpoints", 4},
           {"activation_checkpointing", "partition_activations", true},
           {"activation_checkpointing", "contiguous_memory_optimization", true},
           {"activation_checkpointing", "profile", true}}) {
    Config c = Config::parse({{"train_batch_size", 8}, {section, {{key, value}}}}, world(1));
    ASSERT_EQ(c.warnings.size(), 1u) << section << "." << key;
    EXPECT_EQ(c.warnings[0].rfind(section + "." + key + ": ", 0), 0u) << c.warnings[0];
  }
  // Parameter offload below stage 3 is ignored, as DeepSpeed reads it at stage 3 only.
  Config c = Config::parse({{"train_batch_size", 8}, {"zero_optimization", {{"stage", 2}, {"offload_param", {{"device", "nvme"}, {"nvme_path", "/tmp"}}}}}}, world(1));
  ASSERT_FALSE(c.warnings.empty());
  EXPECT_EQ(c.warnings.back().rfind("zero_optimization.offload_param: ignored at ZeRO stage 2", 0), 0u) << c.warnings.back();
  EXPECT_FALSE(c.zero.offload_param.enabled());
}

// Found by fuzz/fuzz_config.cpp: each used to escape as a bare json exception or overflow int64.
TEST(Config, FuzzFindingsAreConfigErrors) {
  const std::string path = testing::TempDir() + "/huge_number.json";
  std::ofstream(path) << R"({"train_batch_size": 1e999})";
  try {
    Config::load(path, world(1));
    FAIL() << "expected an error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": invalid JSON"), std::string::npos) << e.what();
  }
  expect_error({{"train_batch_size", 8}, {"amp", {{"enabled", 1}}}}, "amp: enabled: expected a boolean, found number");
  expect_error({{"train_micro_batch_size_per_gpu", INT64_MAX}, {"gradient_accumulation_steps", 2}},
               "train_micro_batch_size_per_gpu: must be in");
  expect_error({{"train_micro_batch_size_per_gpu", int64_t{1} << 31}, {"gradient_accumulation_steps", int64_t{1} << 31}},
               "is beyond any batch torchspeed can count", world(8));
}
