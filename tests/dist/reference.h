// The independent reference of the parity tests: one process trains the whole model with plain
// LibTorch — autograd, torch::nn::utils::clip_grad_norm_, torch::optim::AdamW / SGD (or Lamb in
// plain tensor ops, below) — on the
// global batches the ranks of a parallel run see together. No engine, ZeRO, pipeline or fused
// optimizer code runs here (the LR value of a step comes from optim::LRSchedule, whose formulas
// have their own unit tests).
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torchspeed/nn/aux_loss.h"
#include "torchspeed/config/config.h"
#include "torchspeed/nn/layer_stack.h"
#include "torchspeed/optim/lr_schedule.h"
#include "torchspeed/base/error.h"

namespace ts_test {

using MicroBatch = std::pair<at::Tensor, at::Tensor>;  // (inputs, targets)

// The reference's micro-batches of one step: micro-batch m is every data-parallel rank d's
// rows of it, data(m, d), concatenated in rank order.
inline std::vector<MicroBatch> global_micro_batches(int gas, int dp, const std::function<MicroBatch(int m, int d)>& data) {
  std::vector<MicroBatch> micro;
  for (int m = 0; m < gas; ++m) {
    std::vector<at::Tensor> xs, ys;
    for (int d = 0; d < dp; ++d) {
      auto [x, y] = data(m, d);
      xs.push_back(x);
      ys.push_back(y);
    }
    micro.push_back({at::cat(xs), at::cat(ys)});
  }
  return micro;
}

// Note [Reference training step]
// What the engine computes, written the way a LibTorch user would: the gradient of one step is
// the sum over the accumulation window of d(loss_m / micro_batches), each micro-batch's loss the
// mean over its rows (the data-parallel ranks' rows of that micro-batch concatenated: the mean
// over equal-sized shards is the mean of their means, as averaged gradients are). A tensor used
// by several layers (a tied embedding and LM head) is one leaf, so its gradient is the sum of
// its uses. The norm is clipped over every distinct parameter, then the optimizer steps with
// the config's hyperparameters and the schedule's LR.
// DeepSpeed's FusedLamb (deepspeed/ops/lamb/fused_lamb.py and its kernel) written with plain
// tensor ops, one parameter tensor at a time: the trust ratio ||p|| / ||u|| of each whole tensor,
// clamped to [min_coeff, max_coeff] (1 when either norm is zero), bias correction in the step size.
class ReferenceLamb {
 public:
  ReferenceLamb(std::vector<std::pair<at::Tensor, double>> params, const torchspeed::config::OptimizerConfig& o)
      : params_(std::move(params)), o_(o) {
    for (auto& [p, wd] : params_) {
      m_.push_back(at::zeros_like(p));
      v_.push_back(at::zeros_like(p));
    }
  }
  void step(double lr) {
    torch::NoGradGuard no_grad;
    ++t_;
    const double b1 = o_.betas.at(0), b2 = o_.betas.at(1);
    const double step = o_.bias_correction ? lr * std::sqrt(1 - std::pow(b2, t_)) / (1 - std::pow(b1, t_)) : lr;
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& p = params_[i].first;
      const at::Tensor g = p.grad().defined() ? p.grad() : at::zeros_like(p);
      m_[i].mul_(b1).add_(g, 1 - b1);
      v_[i].mul_(b2).addcmul_(g, g, 1 - b2);
      const at::Tensor denom = o_.eps_inside_sqrt ? (v_[i] + o_.eps).sqrt() : v_[i].sqrt() + o_.eps;
      const at::Tensor u = m_[i] / denom + params_[i].second * p;
      const double wn = p.norm().item<double>(), un = u.norm().item<double>();
      const double coeff = wn == 0 || un == 0 ? 1.0 : std::clamp(wn / un, o_.min_coeff, o_.max_coeff);
      p.sub_(u * (step * coeff));
    }
  }
  void zero_grad() {
    for (auto& [p, wd] : params_)
      if (p.grad().defined()) p.grad().zero_();
  }

 private:
  std::vector<std::pair<at::Tensor, double>> params_;
  torchspeed::config::OptimizerConfig o_;
  std::vector<at::Tensor> m_, v_;
  int64_t t_ = 0;
};

class ReferenceTrainer {
 public:
  // `no_decay`: parameters (by name) in a second group without weight decay, as
  // engine::no_weight_decay_group puts them.
  ReferenceTrainer(torchspeed::nn::LayerStack model, const torchspeed::config::Config& cfg,
                   std::function<bool(const std::string&, const at::Tensor&)> no_decay = nullptr)
      : model_(std::move(model)),
        clip_(cfg.gradient_clipping),
        schedule_(cfg.scheduler, cfg.optimizer.lr, cfg.optimizer.betas.at(0)) {
    using torchspeed::optim::OptimizerType;
    TS_CHECK(cfg.optimizer.type == OptimizerType::kAdamW || cfg.optimizer.type == OptimizerType::kSGD ||
                 cfg.optimizer.type == OptimizerType::kLamb,
             "the reference trains with AdamW, SGD or Lamb, not '", cfg.optimizer.name(), "'");
    std::unordered_set<const void*> seen;
    std::vector<at::Tensor> decay, plain;
    for (const auto& item : model_->named_parameters()) {
      if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // a tied tensor again
      if (!item.value().requires_grad()) continue;  // frozen (a LoRA run's base)
      params_.push_back(item.value());
      (no_decay && no_decay(item.key(), item.value()) ? plain : decay).push_back(item.value());
    }
    const auto& o = cfg.optimizer;
    if (o.type == OptimizerType::kLamb) {
      std::vector<std::pair<at::Tensor, double>> with_wd;
      for (auto& p : decay) with_wd.emplace_back(p, o.weight_decay);
      for (auto& p : plain) with_wd.emplace_back(p, 0.0);
      lamb_ = std::make_unique<ReferenceLamb>(std::move(with_wd), o);
      return;
    }
    std::vector<torch::optim::OptimizerParamGroup> groups;
    auto add_group = [&](std::vector<at::Tensor> ps, double weight_decay) {
      if (ps.empty()) return;
      if (o.type == OptimizerType::kSGD) {
        groups.emplace_back(std::move(ps), std::make_unique<torch::optim::SGDOptions>(
                                               torch::optim::SGDOptions(o.lr)
                                                   .momentum(o.momentum)
                                                   .dampening(o.dampening)
                                                   .nesterov(o.nesterov)
                                                   .weight_decay(weight_decay)));
      } else {
        groups.emplace_back(std::move(ps), std::make_unique<torch::optim::AdamWOptions>(
                                               torch::optim::AdamWOptions(o.lr)
                                                   .betas({o.betas.at(0), o.betas.at(1)})
                                                   .eps(o.eps)
                                                   .weight_decay(weight_decay)));
      }
    };
    add_group(decay, o.weight_decay);
    add_group(plain, 0.0);
    if (o.type == OptimizerType::kSGD) {
      opt_ = std::make_unique<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(o.lr));
    } else {
      opt_ = std::make_unique<torch::optim::AdamW>(std::move(groups),
                                                   torch::optim::AdamWOptions(o.lr));
    }
  }

  // One optimizer step over one accumulation window (see Note [Reference training step]).
  // Returns the mean of the micro-batches' losses.
  double step(const std::vector<MicroBatch>& micro_batches) {
    TS_CHECK(!micro_batches.empty(), "a reference step needs at least one micro-batch");
    model_->train();
    if (lamb_) {
      lamb_->zero_grad();
    } else {
      opt_->zero_grad();
    }
    double sum = 0.0;
    const double n = static_cast<double>(micro_batches.size() * pieces_);
    // Auxiliary losses (an MoE model's load balancing) are added to the loss here, spelled out,
    // rather than attached to the layers' outputs as the engine does (nn/aux_loss.h).
    torchspeed::nn::AuxLoss::collect(true);
    for (const auto& [xs, ys] : micro_batches) {
      const auto x_pieces = xs.chunk(pieces_), y_pieces = ys.chunk(pieces_);
      for (size_t i = 0; i < x_pieces.size(); ++i) {
        at::Tensor loss = model_->loss(model_->forward(x_pieces[i]), y_pieces[i]);
        sum += loss.item<double>();
        at::Tensor total = loss;
        for (const at::Tensor& a : torchspeed::nn::AuxLoss::take_collected()) total = total + a;
        (total / n).backward();
      }
    }
    torchspeed::nn::AuxLoss::collect(false);
    // The norm before clipping; a non-positive gradient_clipping clips nothing.
    last_norm_ = torch::nn::utils::clip_grad_norm_(params_, clip_ > 0.0 ? clip_ : 1e30);
    if (lamb_) {
      lamb_->step(schedule_.lr());
    } else {
      for (auto& g : opt_->param_groups()) g.options().set_lr(schedule_.lr());
      opt_->step();
    }
    schedule_.step();
    return sum / n;
  }

  // The mean loss over micro-batches without gradients (eval mode).
  double eval(const std::vector<MicroBatch>& micro_batches) {
    torch::NoGradGuard no_grad;
    model_->eval();
    double sum = 0.0;
    for (const auto& [xs, ys] : micro_batches) {
      const auto x_pieces = xs.chunk(pieces_), y_pieces = ys.chunk(pieces_);
      for (size_t i = 0; i < x_pieces.size(); ++i) sum += model_->loss(model_->forward(x_pieces[i]), y_pieces[i]).item<double>();
    }
    model_->train();
    return sum / static_cast<double>(micro_batches.size() * pieces_);
  }

  // Each micro-batch runs as `n` equal pieces along the batch (the data-parallel ranks' own
  // micro-batches), the loss their mean: for layers whose result depends on the batch it sees
  // (an MoE layer's expert capacity and load-balancing loss), as the ranks compute it.
  void set_pieces(int64_t n) { pieces_ = n; }

  // Global L2 norm of the last step's gradients, before clipping.
  double last_grad_norm() const { return last_norm_; }
  // Every parameter by name (a tied tensor under each of its names), copied.
  std::map<std::string, at::Tensor> params() const {
    std::map<std::string, at::Tensor> out;
    for (const auto& item : model_->named_parameters())
      out[item.key()] = item.value().detach().clone();
    return out;
  }
  // Distinct parameter tensors and their elements.
  size_t num_tensors() const { return params_.size(); }
  int64_t num_parameters() const {
    int64_t n = 0;
    for (const auto& p : params_) n += p.numel();
    return n;
  }
  // Whether two names denote the same tensor (a tied weight).
  bool same_tensor(const std::string& a, const std::string& b) const {
    const auto named = model_->named_parameters();
    const at::Tensor *pa = named.find(a), *pb = named.find(b);
    return pa && pb && pa->unsafeGetTensorImpl() == pb->unsafeGetTensorImpl();
  }
  torchspeed::nn::LayerStack& model() { return model_; }

 private:
  torchspeed::nn::LayerStack model_;
  double clip_;
  torchspeed::optim::LRSchedule schedule_;
  std::vector<at::Tensor> params_;  // distinct, in named_parameters() order
  std::unique_ptr<torch::optim::Optimizer> opt_;
  std::unique_ptr<ReferenceLamb> lamb_;
  int64_t pieces_ = 1;
  double last_norm_ = 0.0;
};

// ||a - b|| / ||b|| over one tensor.
inline double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-12);
}

}  // namespace ts_test
