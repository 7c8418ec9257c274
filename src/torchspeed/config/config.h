// The DeepSpeed-compatible training config, parsed once into typed structs with DeepSpeed's
// defaults, plus torchspeed's own sections. Config::load() collects every problem (with its JSON
// path) and throws ConfigError listing them all.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "torchspeed/optim/lr_schedule.h"
#include "torchspeed/optim/optimizer_type.h"
#include "torchspeed/base/error.h"

namespace torchspeed::config {

class ConfigError : public Error {
 public:
  explicit ConfigError(std::vector<std::string> errors);
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  std::vector<std::string> errors_;
};

struct FP16Config {
  bool enabled = false;
  bool auto_cast = false;
  double loss_scale = 0.0;  // 0 = dynamic loss scaling
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  bool dynamic() const { return loss_scale == 0.0; }
};

struct BF16Config {
  bool enabled = false;
};

struct OptimizerConfig {
  optim::OptimizerType type = optim::OptimizerType::kNone;  // DeepSpeed's "type", read once
  double lr = 1e-3;
  std::vector<double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
  bool adam_w_mode = true;  // DeepSpeed's Adam decouples weight decay unless adam_w_mode=false
  double momentum = 0.0;    // SGD
  double dampening = 0.0;
  bool nesterov = false;
  double max_coeff = 10.0, min_coeff = 0.01;  // Lamb's trust-ratio bounds
  bool eps_inside_sqrt = false;               // Lamb: sqrt(v + eps) instead of sqrt(v) + eps
  int64_t freeze_step = 100000;               // OneBitAdam, OneBitLamb: warm-up steps before compression
  // ZeroOneAdam (DeepSpeed's 0/1 Adam): the variance is updated on steps var_interval apart,
  // var_interval doubling every var_update_scaler such updates, and frozen after var_freeze_step;
  // then ranks take local steps, synchronised every local_step_interval steps (doubling every
  // local_step_scaler steps, at most local_step_clipper).
  int64_t var_freeze_step = 100000, var_update_scaler = 16, local_step_scaler = 32678, local_step_clipper = 16;
  // OneBitLamb: the EMA of warm-up trust ratios, and the bounds of the frozen-variance factor.
  double coeff_beta = 0.9, factor_max = 4.0, factor_min = 0.5, factor_threshold = 0.1;
  bool one_bit() const { return optim::is_one_bit(type); }
  const char* name() const { return optim::optimizer_name(type); }
};

// The scheduler section is the schedule's own options (optim/lr_schedule.h).
using SchedulerConfig = optim::ScheduleOptions;

// offload_optimizer.device / offload_param.device, read once.
enum class OffloadDevice { kNone, kCpu, kNvme };
const char* offload_device_name(OffloadDevice d);  // "none", "cpu", "nvme"

struct OffloadConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  bool pin_memory = false;
  int64_t buffer_count = 5;
  int64_t buffer_size = 100000000;
  int64_t max_in_cpu = 1000000000;
  double ratio = 1.0;
  bool pipeline_read = false, pipeline_write = false;  // offload_optimizer: overlap swap I/O with the step
  bool fast_init = false;
  bool enabled() const { return device != OffloadDevice::kNone; }
};

// DeepSpeed's "aio" section: the asynchronous I/O of NVMe offload.
struct AioConfig {
  int64_t block_size = 1048576;
  int64_t queue_depth = 8;
  int64_t intra_op_parallelism = 1;  // old name thread_count
  bool single_submit = false;
  bool overlap_events = true;
};

// DeepSpeed's autotuning (deepspeed/autotuning/constants.py defaults). With `enabled`, a
// training run is one experiment: the engine times steps (start_profile_step,
// end_profile_step], writes {"latency" (ms per step), "throughput" (samples/s), "FLOPS_per_gpu"}
// to metric_path and the run stops, as DeepSpeed's engine exits; `torchspeed autotune` runs
// such experiments over ZeRO stages and micro-batch sizes and writes the best config.
struct AutotuningConfig {
  bool enabled = false, fast = true, overwrite = true;
  std::string results_dir = "autotuning_results", exps_dir = "autotuning_exps";
  std::string metric_path;  // "": ./autotuning_metric.json
  int64_t start_profile_step = 3, end_profile_step = 5;
  std::string metric = "throughput";      // latency, throughput, flops
  std::string tuner_type = "gridsearch";  // gridsearch, random
  int64_t tuner_early_stopping = 5, tuner_num_trials = 50;
  std::optional<int64_t> max_train_batch_size;
  int64_t min_train_batch_size = 1;
  int64_t min_train_micro_batch_size_per_gpu = 1, max_train_micro_batch_size_per_gpu = 1024;
  int64_t num_tuning_micro_batch_sizes = 3;
  bool zero_stage_given = false;  // zero_optimization.stage was in the config: only it is tuned
};

struct ZeroConfig {
  int stage = 0;
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  int64_t reduce_bucket_size = 500000000;
  bool allgather_partitions = true;
  int64_t allgather_bucket_size = 500000000;
  bool overlap_comm = false;  // DeepSpeed: true by default at stage 3
  bool load_from_fp32_weights = true;
  bool elastic_checkpoint = false;
  OffloadConfig offload_optimizer;
  OffloadConfig offload_param;
  int64_t sub_group_size = 1000000000;
  int64_t prefetch_bucket_size = 50000000;
  int64_t param_persistence_threshold = 100000;
  int64_t model_persistence_threshold = INT64_MAX;
  int64_t max_live_parameters = 1000000000;
  int64_t max_reuse_distance = 1000000000;
  bool gather_16bit_weights_on_model_save = false;
  bool round_robin_gradients = false;
  bool ignore_unused_parameters = true;
  // ZeRO++ qgZ: the gradients' reduce-scatter sends 4-bit blocks across hosts (stages 2-3;
  // Note [Quantized reduce-scatter]).
  bool quantized_gradients = false;
  // ZeRO++ hpZ (stage 3): after a layer's forward all-gather each rank keeps a secondary shard,
  // 1/hpz_partition_size of it, so later gathers until the step stay within a group of that
  // many consecutive data-parallel ranks (a host). 1: off.
  int hpz_partition_size = 1;
  // ZeRO++ qwZ (stage 3): parameter all-gathers send int8 blocks (Note [Quantized all-gather]).
  bool quantized_weights = false;
};

struct ActivationCheckpointingConfig {
  bool partition_activations = false;
  bool contiguous_memory_optimization = false;
  bool cpu_checkpointing = false;
  std::optional<int64_t> number_checkpoints;
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
};

struct PipelineConfig {
  int stages = 1;
  std::string partition_method = "parameters";  // uniform, parameters, type:REGEX
  int activation_checkpoint_interval = 0;
  std::string schedule = "1f1b";  // 1f1b, gpipe
};

struct TensorParallelConfig {
  int tp_size = 1;
};

struct CheckpointConfig {
  std::string tag_validation = "Warn";  // Ignore, Warn, Fail
  bool load_universal = false;
  bool use_node_local_storage = false;
  int keep_last = 0;  // 0 keeps every checkpoint
};

struct MonitorConfig {
  bool enabled = false;
  std::string output_path;
  std::string job_name = "DeepSpeedJobName";
};

// Quantization-aware training: DeepSpeed's compression_training weight and activation
// quantization (deepspeed/compression) and MoQ's quantize_training section, run by
// compression/ (Note [Quantization-aware training] in compression/schedule.cpp).
struct QuantizeGroupConfig {
  std::string name;                  // the key under different_groups ("wq1")
  std::string path;                  // its JSON path, for errors when it is bound to a model
  std::vector<std::string> modules;  // regular expressions searched in module names
  int start_bits = 16, target_bits = 16;  // weights: from start_bits down to target_bits
  int64_t quantization_period = 1;        // steps at start_bits; doubles at each bit dropped
  int bits = 8;                           // activations
};

struct WeightQuantizationConfig {
  bool enabled = false;
  // true: weights quantized to target_bits in every forward (DeepSpeed's
  // quantize_weight_in_forward); false: MoQ, the start_bits -> target_bits schedule.
  bool in_forward = false;
  int64_t schedule_offset = 0;  // applied optimizer steps before quantization starts
  int64_t quantize_groups = 1;  // scales per weight tensor (rows in contiguous groups)
  bool symmetric = true;
  bool stochastic = false;      // rounding (MoQ only)
  bool fp16_mixed = false;      // MoQ: blend ratio * w + (1 - ratio) * q(w), ratio falling
  double change_ratio = 0.001;  // the ratio's fall per step
  bool verbose = false;
  // quantize_training (MoQ as its tutorial configures it): every matrix of the model, no
  // module list (`groups` holds one group matching every module).
  bool every_matrix = false;
  std::string section;  // "compression_training.weight_quantization" or "quantize_training"
  std::vector<QuantizeGroupConfig> groups;
};

struct ActivationQuantizationConfig {
  bool enabled = false;
  bool symmetric = true;
  int64_t schedule_offset = 1000;
  std::vector<QuantizeGroupConfig> groups;
};

struct CompressionConfig {
  WeightQuantizationConfig weight;
  ActivationQuantizationConfig activation;
  bool enabled() const { return weight.enabled || activation.enabled; }
};

// DeepSpeed's data_efficiency.data_routing.random_ltd (random layerwise token dropping, the
// Random-LTD paper): the listed layers see only `kept` tokens of each sequence, a random sorted
// subset per sample; the others pass by them unchanged. `kept` grows from min_value to max_value
// over require_steps steps in multiples of seq_per_step ("fixed_linear").
struct RandomLtdConfig {
  bool enabled = false;
  int64_t total_layer_num = 0;
  int64_t layer_num = 0;
  std::vector<int64_t> layer_ids;
  int64_t min_value = 0, max_value = 0;
  int64_t require_steps = 1, seq_per_step = 1;
  // The tokens the listed layers keep in the forward passes after `global_steps` steps
  // (DeepSpeed's RandomLTDScheduler.get_value).
  int64_t kept(int64_t global_steps) const;
};

// torchspeed's own settings, under the "torchspeed" key.
struct TorchspeedConfig {
  // Keys nobody reads: "typos" (default) refuses the ones within a small edit distance of a
  // known key (with it as the suggestion) and warns about the rest, which DeepSpeed ignores;
  // "error" refuses every one; "warn" refuses none.
  std::string unknown_keys = "typos";
  int intra_op_threads = 0;            // 0 = cores per rank
  double comm_timeout_s = 600.0;
  int64_t comm_chunk_bytes = 1 << 20;
  // ALST's tiling (models/gpt.h, tiled()): the dense MLP, and the LM head with its loss, over
  // this many slices of each sequence in training. 0: whole.
  int64_t tiled_mlp = 0;
  int64_t tiled_loss = 0;
};

// The world the config is resolved for.
struct WorldShape {
  int world_size = 1;
  int tp = 0;  // 0 = from the config (tensor_parallel.tp_size), else 1
  int pp = 0;  // 0 = from the config (pipeline.stages), else 1
};

// What fills a config's "auto" values, as the Hugging Face Trainer fills them from its
// TrainingArguments (transformers' HfTrainerDeepSpeedConfig); the defaults are
// TrainingArguments' own. `torchspeed train` takes max_steps from train.steps and hidden_size
// from model.d_model. Config::parse says which value each "auto" became (warnings) and refuses an
// "auto" it cannot resolve, naming the key and what must be given.
struct AutoValues {
  int64_t per_device_train_batch_size = 8;
  int64_t gradient_accumulation_steps = 1;
  double learning_rate = 5e-5;
  double weight_decay = 0.0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  double max_grad_norm = 1.0;
  int64_t warmup_steps = 0;
  std::optional<int64_t> max_steps;    // scheduler total_num_steps
  std::optional<int64_t> hidden_size;  // ZeRO bucket sizes (else DeepSpeed's defaults)
  bool fp16 = false, bf16 = false;
  std::string source = "Hugging Face TrainingArguments' default";
};

struct Config {
  // Batch sizes as resolved: train_batch_size = micro * grad_accum * dp / sp; 0 when the config gives
  // none (templates), which check_batch_sizes() refuses.
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 1;
  int steps_per_print = 10;
  bool wall_clock_breakdown = false;
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  double gradient_clipping = 0.0;
  std::string communication_data_type;  // "" = the compute dtype; fp32, fp16, bf16
  std::string grad_accum_dtype;         // data_types.grad_accum_dtype: "" (= fp32), fp32, bf16
  int64_t seed = 1234;
  bool memory_breakdown = false;

  FP16Config fp16;
  BF16Config bf16;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ZeroConfig zero;
  AioConfig aio;
  AutotuningConfig autotuning;
  CompressionConfig compression;
  RandomLtdConfig random_ltd;
  ActivationCheckpointingConfig activation_checkpointing;
  PipelineConfig pipeline;
  TensorParallelConfig tensor_parallel;
  CheckpointConfig checkpoint;
  MonitorConfig csv_monitor;
  MonitorConfig tensorboard;
  TorchspeedConfig torchspeed;

  // Sections owned by other components ("model", "data", "train"), kept as written; their
  // owners validate them.
  nlohmann::json sections = nlohmann::json::object();

  // dp: the data-parallel group (ZeRO's), world / (tp x pp). sp: DeepSpeed-Ulysses'
  // sequence_parallel_size, consecutive ranks of it that split each sequence; the batch counts
  // dp / sp sequences per micro-step (DeepSpeed's world_size / sequence_parallel_size).
  int world_size = 1, tp = 1, pp = 1, dp = 1, sp = 1;
  int replicas() const { return dp / sp; }
  std::vector<std::string> warnings;
  nlohmann::json source;  // the config as written

  // Parses and resolves; throws ConfigError listing every problem found.
  static Config parse(const nlohmann::json& j, const WorldShape& world = WorldShape(),
                      const AutoValues& autos = AutoValues());
  // Reads a file (JSON errors name the file, line and column) and parses it.
  static Config load(const std::string& path, const WorldShape& world = WorldShape(),
                     const AutoValues& autos = AutoValues());

  // Throws when the config gave no batch size (training needs one).
  void check_batch_sizes() const;

  // The resolved config as DeepSpeed-style JSON, defaults and derived values filled in.
  nlohmann::json to_json() const;
};

// The key reference of docs/config.md: every declared key with its default, values, treatment
// and meaning, one Markdown table per section (`torchspeed config --keys`).
std::string key_reference();

// Reads a JSON file; a syntax error names the file, byte offset, line and column.
nlohmann::json read_json_file(const std::string& path);

}  // namespace torchspeed::config
