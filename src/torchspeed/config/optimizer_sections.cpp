// The optimizer and scheduler sections, with DeepSpeed's names, parameters and defaults
// (deepspeed/runtime/config.py, lr_schedules.py, the 1-bit optimizers' constructors).
#include "torchspeed/config/config.h"
#include "torchspeed/config/detail/sections.h"
#include "torchspeed/config/json_reader.h"

#include <cmath>
#include <limits>

namespace torchspeed::config::detail {

void read_optimizer(JsonReader& r, OptimizerConfig& c) {
  // Names as DeepSpeed compares them (lower case): "OnebitAdam" is OneBitAdam.
  // The one place an optimizer's name becomes its type (optim/optimizer_type.h).
  const std::string name = r.get_string("type", "", {"Adam", "AdamW", "SGD", "Lamb", "OneBitAdam", "ZeroOneAdam",
                                                     "OneBitLamb", "Adagrad", "MuAdam", "MuAdamW", "MuSGD"});
  if (name.empty() && r.has("type") == false) r.error("type", "is required in an optimizer section");
  c.type = optim::optimizer_type_named(name).value_or(optim::OptimizerType::kNone);
  if (!name.empty() && c.type == optim::OptimizerType::kNone) {
    r.error("type", concat("\"", name, "\" is a DeepSpeed optimizer torchspeed does not have; "
                        "use Adam, AdamW, SGD, Lamb, OneBitAdam, ZeroOneAdam or OneBitLamb"));
  }
  auto p = r.child("params");
  if (!p) {
    if (c.type == optim::OptimizerType::kSGD) c.lr = 1e-3;
    return r.finish();
  }
  c.lr = p->get_double("lr", 1e-3, 0.0);
  c.weight_decay = p->get_double("weight_decay", 0.0, 0.0);
  if (c.type == optim::OptimizerType::kSGD) {
    c.momentum = p->get_double("momentum", 0.0, 0.0);
    c.dampening = p->get_double("dampening", 0.0, 0.0);
    c.nesterov = p->get_bool("nesterov", false);
  } else {
    c.betas = p->get_double_list("betas", {0.9, 0.999}, 2);
    for (double b : c.betas) {
      if (b < 0.0 || b >= 1.0) p->error("betas", concat("each beta must be in [0, 1), got ", b));
    }
    c.eps = p->get_double("eps", 1e-8, 0.0);
    c.bias_correction = p->get_bool("bias_correction", true);
    if (c.one_bit()) {  // deepspeed.runtime.fp16.onebit's OnebitAdam, ZeroOneAdam and OnebitLamb
      const char* what = c.type == optim::OptimizerType::kOneBitAdam ? "1-bit Adam" : c.type == optim::OptimizerType::kZeroOneAdam ? "0/1 Adam" : "1-bit Lamb";
      if (c.type == optim::OptimizerType::kZeroOneAdam) {
        c.var_freeze_step = p->get_int("var_freeze_step", 100000, 0);
        c.var_update_scaler = p->get_int("var_update_scaler", 16, 1);
        c.local_step_scaler = p->get_int("local_step_scaler", 32678, 1);
        c.local_step_clipper = p->get_int("local_step_clipper", 16, 1);
      } else {
        c.freeze_step = p->get_int("freeze_step", 100000, 0);
      }
      if (c.type == optim::OptimizerType::kOneBitLamb) {
        c.max_coeff = p->get_double("max_coeff", 10.0, 0.0);
        c.min_coeff = p->get_double("min_coeff", 0.01, 0.0);
        if (c.min_coeff > c.max_coeff) p->error("min_coeff", concat(c.min_coeff, " is above max_coeff ", c.max_coeff));
        c.coeff_beta = p->get_double("coeff_beta", 0.9, 0.0, 0.999999);
        c.factor_max = p->get_double("factor_max", 4.0, 0.0);
        c.factor_min = p->get_double("factor_min", 0.5, 0.0);
        if (c.factor_min > c.factor_max) p->error("factor_min", concat(c.factor_min, " is above factor_max ", c.factor_max));
        c.factor_threshold = p->get_double("factor_threshold", 0.1, 0.0);
      }
      if (c.bias_correction && p->has("bias_correction")) {
        p->warn("bias_correction", concat(what, " has no bias correction (DeepSpeed ignores this flag too)"));
      }
      c.bias_correction = false;
      if (p->get_bool("eps_inside_sqrt", false)) {
        p->warn("eps_inside_sqrt", concat(what, " adds eps outside the square root (DeepSpeed ignores this flag too)"));
      }
      if (p->get_bool("cuda_aware", false)) p->warn("cuda_aware", "no effect: the buffers are in host memory");
      // Every backend DeepSpeed names runs over torchspeed's MPI communicator.
      p->get_string("comm_backend_name", "nccl", {"nccl", "mpi", "gloo", "compressed", "hccl"});
      if (p->has("max_grad_norm")) {
        p->error("max_grad_norm", "is not an optimizer parameter (as in DeepSpeed); use the top-level gradient_clipping");
      }
    } else if (c.type == optim::OptimizerType::kLamb) {  // deepspeed.ops.lamb.FusedLamb's parameters
      c.max_coeff = p->get_double("max_coeff", 10.0, 0.0);
      c.min_coeff = p->get_double("min_coeff", 0.01, 0.0);
      if (c.min_coeff > c.max_coeff) p->error("min_coeff", concat(c.min_coeff, " is above max_coeff ", c.max_coeff));
      c.eps_inside_sqrt = p->get_bool("eps_inside_sqrt", false);
      if (p->has("max_grad_norm")) {
        p->error("max_grad_norm", "is not an optimizer parameter (as in DeepSpeed); use the top-level gradient_clipping");
      }
    } else {
      c.adam_w_mode = p->get_bool("adam_w_mode", true);
      if (c.type == optim::OptimizerType::kAdamW && !c.adam_w_mode) {
        p->error("adam_w_mode", "AdamW always decouples weight decay; use type Adam for L2 decay");
      }
      p->accept("torch_adam");
      p->accept("fused");
    }
    if (p->get_bool("amsgrad", false)) p->error("amsgrad", "AMSGrad is not supported");
  }
  p->finish();
  r.finish();
}

void read_scheduler(JsonReader& r, SchedulerConfig& c) {
  c.type = r.get_string("type", "", {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
                                     "LRRangeTest"});
  if (c.type.empty()) {
    if (!r.has("type")) r.error("type", "is required in a scheduler section");
    return r.finish();
  }
  // Name -> default; NaN marks a parameter DeepSpeed requires.
  const double kRequired = std::numeric_limits<double>::quiet_NaN();
  std::vector<std::pair<std::string, double>> spec;
  if (c.type == "WarmupLR" || c.type == "WarmupDecayLR") {
    spec = {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 0.001}, {"warmup_num_steps", 1000}};
    if (c.type == "WarmupDecayLR") spec.push_back({"total_num_steps", kRequired});
  } else if (c.type == "WarmupCosineLR") {
    spec = {{"total_num_steps", kRequired}, {"warmup_min_ratio", 0.0},
            {"warmup_num_steps", 1000}, {"cos_min_ratio", 0.0001}};
  } else if (c.type == "OneCycle") {
    spec = {{"cycle_min_lr", kRequired}, {"cycle_max_lr", kRequired}, {"decay_lr_rate", 0.0},
            {"cycle_first_step_size", 2000}, {"cycle_second_step_size", -1},
            {"cycle_first_stair_count", 0}, {"cycle_second_stair_count", -1},
            {"decay_step_size", 0}, {"cycle_momentum", 1}, {"cycle_min_mom", 0.8},
            {"cycle_max_mom", 0.9}, {"decay_mom_rate", 0.0}};
  } else {  // LRRangeTest
    spec = {{"lr_range_test_min_lr", 0.001}, {"lr_range_test_step_size", 2000},
            {"lr_range_test_step_rate", 1.0}, {"lr_range_test_staircase", 0}};
  }
  auto p = r.child("params");
  if (!p) {
    for (auto& [name, def] : spec) {
      if (std::isnan(def)) r.error("params", concat("needs \"", name, "\" for ", c.type));
      c.params[name] = def;
    }
    return r.finish();
  }
  for (auto& [name, def] : spec) {
    if (name == "cycle_momentum" || name == "lr_range_test_staircase") {
      c.params[name] = p->get_bool(name, def != 0.0) ? 1.0 : 0.0;
      continue;
    }
    auto v = p->get_opt_double(name);
    if (!v && std::isnan(def)) p->error(name, concat("is required for ", c.type));
    c.params[name] = v.value_or(std::isnan(def) ? 0.0 : def);
  }
  if (c.type.rfind("Warmup", 0) == 0) c.warmup_type = p->get_string("warmup_type", "log", {"log", "linear"});
  p->accept("last_batch_iteration");
  if (c.type == "OneCycle") {
    if (c.params["cycle_second_step_size"] < 0) c.params["cycle_second_step_size"] = c.params["cycle_first_step_size"];
    if (c.params["cycle_second_stair_count"] < 0) c.params["cycle_second_stair_count"] = c.params["cycle_first_stair_count"];
  }
  p->finish();
  r.finish();
}

}  // namespace torchspeed::config::detail
