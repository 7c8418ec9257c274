#include "torchspeed/models/lora.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <cmath>
#include <map>
#include <set>

#include "torchspeed/base/error.h"

namespace torchspeed::models {

using checkpoint::peft::Fused;
using checkpoint::peft::Target;

LoraOptions LoraOptions::from_json(const nlohmann::json& j, const GPTConfig& cfg) {
  TS_CHECK(j.is_object(), "lora: expected an object, got ", j.dump());
  LoraOptions o;
  for (const auto& [k, v] : j.items()) {
    TS_CHECK(k == "r" || k == "lora_alpha" || k == "lora_dropout" || k == "use_rslora" || k == "target_modules",
             "lora.", k, ": unknown key (r, lora_alpha, lora_dropout, use_rslora and target_modules are read)");
  }
  if (j.contains("r")) {
    TS_CHECK(j["r"].is_number_integer() && j["r"].get<int64_t>() >= 1, "lora.r: expected a positive integer, got ", j["r"].dump());
    o.r = j["r"].get<int64_t>();
  }
  if (j.contains("lora_alpha")) {
    TS_CHECK(j["lora_alpha"].is_number(), "lora.lora_alpha: expected a number, got ", j["lora_alpha"].dump());
    o.alpha = j["lora_alpha"].get<double>();
  }
  if (j.contains("lora_dropout")) {
    TS_CHECK(j["lora_dropout"].is_number() && j["lora_dropout"].get<double>() >= 0 && j["lora_dropout"].get<double>() < 1,
             "lora.lora_dropout: expected a number in [0, 1), got ", j["lora_dropout"].dump());
    o.dropout = j["lora_dropout"].get<double>();
  }
  if (j.contains("use_rslora")) {
    TS_CHECK(j["use_rslora"].is_boolean(), "lora.use_rslora: expected true or false, got ", j["use_rslora"].dump());
    o.rslora = j["use_rslora"].get<bool>();
  }
  const std::vector<Target> ts = checkpoint::peft::targets(cfg);
  std::set<std::string> known;
  for (const Target& t : ts) known.insert(t.short_name);
  if (j.contains("target_modules")) {
    const auto& tm = j["target_modules"];
    if (tm == "all-linear") {
      o.target_modules.assign(known.begin(), known.end());
    } else {
      TS_CHECK(tm.is_array() && !tm.empty(), "lora.target_modules: expected a list of module names or \"all-linear\", got ",
               tm.dump());
      for (const auto& m : tm) {
        TS_CHECK(m.is_string() && known.count(m.get<std::string>()), "lora.target_modules: ", m.dump(),
                 " is not a linear of this model's blocks (", [&] {
                   std::string s;
                   for (const auto& k : known) s += (s.empty() ? "" : ", ") + k;
                   return s;
                 }(), ")");
        o.target_modules.push_back(m.get<std::string>());
      }
    }
  } else {
    // PEFT's default for the Llama family (and GPT-2's c_attn): the attention's query and value.
    o.target_modules = cfg.rope() ? std::vector<std::string>{"q_proj", "v_proj"} : std::vector<std::string>{"c_attn"};
  }
  return o;
}

nlohmann::json LoraOptions::to_json() const {
  return {{"r", r}, {"lora_alpha", alpha}, {"lora_dropout", dropout}, {"use_rslora", rslora}, {"target_modules", target_modules}};
}

double LoraOptions::scale() const { return rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r); }

namespace {
std::string holder_name(const Target& t) {
  std::string n = t.module;
  for (char& ch : n) {
    if (ch == '.') ch = '_';
  }
  return n;
}
}  // namespace

std::string lora_param_name(int64_t layer, const Target& t, char which) {
  return "block" + std::to_string(layer) + ".lora." + holder_name(t) + (which == 'A' ? ".lora_A" : ".lora_B");
}

LoraBlockImpl::LoraBlockImpl(const GPTConfig& cfg, const LoraOptions& o) : options(o) {
  for (const Target& t : checkpoint::peft::targets(cfg)) {
    auto& out = fused_out[static_cast<int>(t.fused)];
    out = std::max(out, t.row0 + t.rows);
    bool wanted = false;
    for (const auto& m : o.target_modules) wanted |= m == t.short_name;
    if (!wanted) continue;
    auto holder = register_module(holder_name(t), std::make_shared<torch::nn::Module>());
    Module m;
    m.target = t;
    m.holder = holder.get();
    m.A = holder->register_parameter("lora_A", at::empty({o.r, t.in}));
    m.B = holder->register_parameter("lora_B", at::zeros({t.rows, o.r}));
    {
      c10::NoGradGuard g;
      // nn.Linear's default (what PEFT's kaiming_uniform_(a=sqrt(5)) gives): U(-1/sqrt(in), 1/sqrt(in)).
      const double bound = 1.0 / std::sqrt(static_cast<double>(t.in));
      m.A.uniform_(-bound, bound);
    }
    modules.push_back(std::move(m));
  }
}

at::Tensor LoraBlockImpl::delta(Fused which, const at::Tensor& x) {
  // The modules of this fused linear: their A rows stacked, their B blocks on the diagonal (zero
  // rows where no module is targeted), so that the update is two matrix products.
  std::vector<const Module*> ms;
  for (const Module& m : modules) {
    if (m.target.fused == which) ms.push_back(&m);
  }
  if (ms.empty()) return at::Tensor();
  const int64_t out = fused_out[static_cast<int>(which)], R = options.r * static_cast<int64_t>(ms.size());
  std::vector<at::Tensor> As, rows;
  int64_t next_row = 0, col = 0;
  const auto opts = ms[0]->B.options();
  for (const Module* m : ms) {
    As.push_back(m->A);
    if (m->target.row0 > next_row) rows.push_back(at::zeros({m->target.row0 - next_row, R}, opts));
    std::vector<at::Tensor> blk;
    if (col > 0) blk.push_back(at::zeros({m->target.rows, col}, opts));
    blk.push_back(m->B);
    if (R - col - options.r > 0) blk.push_back(at::zeros({m->target.rows, R - col - options.r}, opts));
    rows.push_back(blk.size() == 1 ? blk[0] : at::cat(blk, 1));
    next_row = m->target.row0 + m->target.rows;
    col += options.r;
  }
  if (out > next_row) rows.push_back(at::zeros({out - next_row, R}, opts));
  const at::Tensor A = As.size() == 1 ? As[0] : at::cat(As, 0);
  const at::Tensor B = rows.size() == 1 ? rows[0] : at::cat(rows, 0);
  const at::Tensor in = options.dropout > 0 ? at::dropout(x, options.dropout, is_training()) : x;
  return at::matmul(at::matmul(in, A.t()), B.t()) * options.scale();
}

void freeze(torch::nn::Module& m) {
  for (auto& p : m.parameters(/*recurse=*/true)) p.set_requires_grad(false);
}

checkpoint::peft::Adapter lora_adapter_of(const std::vector<std::pair<std::string, at::Tensor>>& params, const GPTConfig& cfg,
                                          const LoraOptions& o) {
  std::map<std::string, at::Tensor> by_name(params.begin(), params.end());
  const std::vector<Target> ts = checkpoint::peft::targets(cfg);
  checkpoint::peft::Adapter a;
  a.r = o.r;
  a.alpha = o.alpha;
  a.rslora = o.rslora;
  a.config = {{"lora_dropout", o.dropout}};
  a.A.assign(static_cast<size_t>(cfg.n_layer), std::vector<at::Tensor>(ts.size()));
  a.B = a.A;
  size_t used = 0;
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    for (size_t t = 0; t < ts.size(); ++t) {
      const auto ia = by_name.find(lora_param_name(l, ts[t], 'A'));
      const auto ib = by_name.find(lora_param_name(l, ts[t], 'B'));
      if (ia == by_name.end() && ib == by_name.end()) continue;
      TS_CHECK(ia != by_name.end() && ib != by_name.end(), "LoRA: block ", l, " has only one of ", ts[t].module,
               "'s lora_A and lora_B");
      a.A[static_cast<size_t>(l)][t] = ia->second.detach().to(at::kFloat).contiguous();
      a.B[static_cast<size_t>(l)][t] = ib->second.detach().to(at::kFloat).contiguous();
      used += 2;
    }
  }
  TS_CHECK(used > 0, "LoRA: the run's parameters hold no adapter (", params.size(), " tensors, e.g. \"",
           params.empty() ? "" : params[0].first, "\")");
  TS_CHECK(used == params.size(), "LoRA: the run has ", params.size() - used, " trainable tensors that are not LoRA's");
  return a;
}

std::vector<std::pair<std::string, at::Tensor>> merge_lora(const std::vector<std::pair<std::string, at::Tensor>>& base,
                                                           const checkpoint::peft::Adapter& a, const GPTConfig& cfg) {
  static const char* fused_names[] = {"qkv", "attn_proj", "fc", "mlp_proj"};
  const std::vector<Target> ts = checkpoint::peft::targets(cfg);
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.reserve(base.size());
  for (const auto& [name, t] : base) out.emplace_back(name, t.detach().to(at::kFloat).clone());
  std::map<std::string, at::Tensor*> by_name;
  for (auto& [name, t] : out) by_name[name] = &t;
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    for (size_t t = 0; t < ts.size(); ++t) {
      const at::Tensor& A = a.A[static_cast<size_t>(l)][t];
      if (!A.defined()) continue;
      const std::string w = "block" + std::to_string(l) + "." + fused_names[static_cast<int>(ts[t].fused)] + ".weight";
      const auto it = by_name.find(w);
      TS_CHECK(it != by_name.end(), "LoRA merge: the base has no tensor \"", w, "\"");
      it->second->narrow(0, ts[t].row0, ts[t].rows).add_(at::matmul(a.B[static_cast<size_t>(l)][t], A) * a.scale(A.size(0)));
    }
  }
  return out;
}

}  // namespace torchspeed::models
