// Hugging Face's "auto" values, resolved before the sections are read.
#include "torchspeed/config/config.h"
#include "torchspeed/config/detail/sections.h"
#include "torchspeed/config/json_reader.h"

#include <functional>

namespace torchspeed::config::detail {

// Note ["auto" values]
// Hugging Face configs leave values to the Trainer as "auto", which transformers'
// HfTrainerDeepSpeedConfig fills from TrainingArguments before DeepSpeed sees the config
// (DeepSpeed itself drops "auto" inside its pydantic sections, taking the default, and fails on
// the top-level ones). We do the same, saying for each key what it became (a warning):
//  - batch sizes: an "auto" one is derived from the ones given and the world size; when neither
//    train_batch_size nor the micro-batch is given, the micro-batch is per_device_train_batch_size
//    (and an "auto" accumulation gradient_accumulation_steps);
//  - gradient_clipping, optimizer lr/betas/eps/weight_decay, scheduler warmup_min_lr (0),
//    warmup_max_lr (the learning rate), warmup_num_steps, total_num_steps (max_steps: an error
//    when unknown), fp16/bf16.enabled: from AutoValues;
//  - ZeRO's reduce_bucket_size, stage3_prefetch_bucket_size and
//    stage3_param_persistence_threshold from the hidden size (h*h, 0.9*h*h, 10*h), as the Trainer;
//  - any other "auto" inside a section DeepSpeed validates with pydantic (zero_optimization,
//    fp16, bf16, the monitors, tensor_parallel, compile): DeepSpeed's default;
//  - anywhere else: an error naming the key.
void resolve_auto(nlohmann::json& j, const AutoValues& a, Diagnostics& diag) {
  auto is_auto = [](const nlohmann::json& o, const std::string& k) {
    return o.is_object() && o.contains(k) && o.at(k).is_string() && o.at(k).get<std::string>() == "auto";
  };
  auto fill = [&](nlohmann::json& o, const std::string& path, const std::string& k, const nlohmann::json& v,
                  const std::string& from) {
    if (!is_auto(o, k)) return;
    o[k] = v;
    diag.warnings.push_back(concat(path.empty() ? "" : path + ".", k, ": \"auto\" -> ", v.dump(), " (", from, ")"));
  };
  auto drop = [&](nlohmann::json& o, const std::string& path, const std::string& k, const std::string& why) {
    if (!is_auto(o, k)) return;
    o.erase(k);
    diag.warnings.push_back(concat(path.empty() ? "" : path + ".", k, ": \"auto\" -> ", why));
  };
  const std::string hf = a.source;
  // Batch sizes.
  std::vector<std::string> batch_autos;
  for (const char* k : {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}) {
    if (is_auto(j, k)) batch_autos.push_back(k);
  }
  if (!batch_autos.empty()) {
    const bool gas_auto = is_auto(j, "gradient_accumulation_steps");
    for (const auto& k : batch_autos) j.erase(k);
    if (!j.contains("train_batch_size") && !j.contains("train_micro_batch_size_per_gpu")) {
      j["train_micro_batch_size_per_gpu"] = "auto";
      fill(j, "", "train_micro_batch_size_per_gpu", a.per_device_train_batch_size, hf + " per_device_train_batch_size");
      if (gas_auto) {
        j["gradient_accumulation_steps"] = "auto";
        fill(j, "", "gradient_accumulation_steps", a.gradient_accumulation_steps, hf + " gradient_accumulation_steps");
      }
    }
    for (const auto& k : batch_autos) {
      if (!j.contains(k)) diag.warnings.push_back(concat(k, ": \"auto\" -> derived from the other batch sizes and the world size"));
    }
  }
  fill(j, "", "gradient_clipping", a.max_grad_norm, hf + " max_grad_norm");
  for (const char* s : {"fp16", "bf16", "bfloat16"}) {
    if (j.contains(s) && j[s].is_object()) {
      fill(j[s], s, "enabled", std::string(s) == "fp16" ? a.fp16 : a.bf16, hf + (std::string(s) == "fp16" ? " fp16" : " bf16"));
    }
  }
  if (j.contains("optimizer") && j["optimizer"].is_object() && j["optimizer"].contains("params") &&
      j["optimizer"]["params"].is_object()) {
    auto& p = j["optimizer"]["params"];
    fill(p, "optimizer.params", "lr", a.learning_rate, hf + " learning_rate");
    fill(p, "optimizer.params", "weight_decay", a.weight_decay, hf + " weight_decay");
    fill(p, "optimizer.params", "betas", nlohmann::json::array({a.adam_beta1, a.adam_beta2}), hf + " adam_beta1, adam_beta2");
    fill(p, "optimizer.params", "eps", a.adam_epsilon, hf + " adam_epsilon");
  }
  if (j.contains("scheduler") && j["scheduler"].is_object() && j["scheduler"].contains("params") &&
      j["scheduler"]["params"].is_object()) {
    auto& p = j["scheduler"]["params"];
    double lr = a.learning_rate;
    if (j.contains("optimizer") && j["optimizer"].is_object() && j["optimizer"].contains("params") &&
        j["optimizer"]["params"].is_object() && j["optimizer"]["params"].contains("lr") &&
        j["optimizer"]["params"]["lr"].is_number()) {
      lr = j["optimizer"]["params"]["lr"].get<double>();
    }
    fill(p, "scheduler.params", "warmup_min_lr", 0.0, "as the Hugging Face Trainer");
    fill(p, "scheduler.params", "warmup_max_lr", lr, "the optimizer's learning rate");
    fill(p, "scheduler.params", "warmup_num_steps", a.warmup_steps, hf + " warmup_steps");
    if (a.max_steps) {
      fill(p, "scheduler.params", "total_num_steps", *a.max_steps, "the number of training steps");
    } else if (is_auto(p, "total_num_steps")) {
      diag.errors.push_back("scheduler.params.total_num_steps: \"auto\" needs the number of training steps, which only "
                            "a trainer knows (torchspeed train takes train.steps); give a number");
      p["total_num_steps"] = 1;  // reported: the parse fails, and the reader adds no second error
    }
  }
  if (j.contains("zero_optimization") && j["zero_optimization"].is_object()) {
    auto& z = j["zero_optimization"];
    const bool stage3 = z.contains("stage") && z["stage"].is_number_integer() && z["stage"].get<int>() == 3;
    if (a.hidden_size) {
      const int64_t h = *a.hidden_size;
      fill(z, "zero_optimization", "reduce_bucket_size", h * h, "hidden size squared, as the Hugging Face Trainer");
      if (stage3) {
        fill(z, "zero_optimization", "stage3_prefetch_bucket_size", static_cast<int64_t>(0.9 * static_cast<double>(h * h)),
             "0.9 x hidden size squared, as the Hugging Face Trainer");
        fill(z, "zero_optimization", "stage3_param_persistence_threshold", 10 * h,
             "10 x hidden size, as the Hugging Face Trainer");
      }
    }
  }
  // What is left: DeepSpeed's default inside its pydantic sections, else an error.
  std::function<void(nlohmann::json&, const std::string&, bool)> rest = [&](nlohmann::json& o, const std::string& path,
                                                                           bool defaults) {
    if (!o.is_object()) return;
    std::vector<std::string> keys;
    for (const auto& item : o.items()) keys.push_back(item.key());
    for (const auto& k : keys) {
      if (is_auto(o, k)) {
        if (defaults) {
          drop(o, path, k, "DeepSpeed's default, as DeepSpeed reads \"auto\" in this section");
        } else {
          diag.errors.push_back(concat(path.empty() ? "" : path + ".", k,
                                       ": \"auto\" cannot be derived here; give a value"));
          o.erase(k);
        }
      } else {
        rest(o[k], path.empty() ? k : path + "." + k, defaults);
      }
    }
  };
  std::vector<std::string> top;
  for (const auto& item : j.items()) top.push_back(item.key());
  static const std::set<std::string> pydantic = {"zero_optimization", "fp16", "bf16", "bfloat16", "tensorboard",
                                                 "csv_monitor", "wandb", "comet", "tensor_parallel", "compile",
                                                 "comms_logger"};
  for (const auto& k : top) {
    if (k == "pipeline" || k == "model" || k == "data" || k == "train" || k == "lora") continue;  // their readers say
    if (j[k].is_object()) {
      rest(j[k], k, pydantic.count(k) > 0);
    } else if (is_auto(j, k)) {
      diag.errors.push_back(concat(k, ": \"auto\" cannot be derived here; give a value"));
      j.erase(k);
    }
  }
}

}  // namespace torchspeed::config::detail
