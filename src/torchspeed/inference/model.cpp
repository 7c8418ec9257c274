#include "torchspeed/inference/model.h"
#include "torchspeed/models/moe.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <sstream>

#include "torchspeed/inference/attention.h"
#include "torchspeed/inference/linear.h"
#include "torchspeed/base/error.h"
#include "torchspeed/tensor_parallel/layers.h"

namespace torchspeed::inference {

namespace {
// One row of `n` values as int8 and its scale, max |x| / 127 (0 for a row of zeros): q =
// round-to-nearest-even(x * 127 / max |x|).
void quantize_row_int8(const float* x, int64_t n, int8_t* q, float* scale) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
  *scale = amax / 127.0f;
}

// Keys and values of the step's rows (columns [ql, ql + kvl) and [ql + kvl, ql + 2 kvl) of qkv)
// into their cache slots, as index_copy_ of qkv's slices converted to the cache's dtype would
// write them (bf16: round to nearest even; int8: each head's row with its scale).
void write_kv(const at::Tensor& qkv, int64_t ql, int64_t kvl, const std::vector<int64_t>& slots, KVCache& cache,
              int64_t layer) {
  at::Tensor& kc = cache.keys(layer);
  at::Tensor& vc = cache.values(layer);
  const float* src = qkv.data_ptr<float>();
  const int64_t ld = qkv.size(1), n = static_cast<int64_t>(slots.size());
  TS_INTERNAL_ASSERT(qkv.is_contiguous() && qkv.size(0) == n && ld == ql + 2 * kvl && kc.is_contiguous() &&
                         vc.is_contiguous(),
                     "write_kv: qkv ", qkv.sizes(), " for ", n, " slots");
  if (kc.scalar_type() == at::kFloat) {
    float *k = kc.data_ptr<float>(), *v = vc.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(k + slots[r] * kvl, src + r * ld + ql, sizeof(float) * kvl);
      std::memcpy(v + slots[r] * kvl, src + r * ld + ql + kvl, sizeof(float) * kvl);
    }
    return;
  }
  if (kc.scalar_type() == at::kChar) {
    const int64_t heads = kc.size(1), hd = kc.size(2);
    int8_t *k = kc.data_ptr<int8_t>(), *v = vc.data_ptr<int8_t>();
    float *ks = cache.key_scales(layer).data_ptr<float>(), *vs = cache.value_scales(layer).data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t at_row = slots[r] * heads + h;
        quantize_row_int8(src + r * ld + ql + h * hd, hd, k + at_row * hd, ks + at_row);
        quantize_row_int8(src + r * ld + ql + kvl + h * hd, hd, v + at_row * hd, vs + at_row);
      }
    }
    return;
  }
  TS_INTERNAL_ASSERT(kc.scalar_type() == at::kBFloat16, "KV cache dtype ", kc.scalar_type());
  auto *k = kc.data_ptr<at::BFloat16>(), *v = vc.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < n; ++r) {
    const float* row = src + r * ld;
    for (int64_t c = 0; c < kvl; ++c) {
      k[slots[r] * kvl + c] = at::BFloat16(row[ql + c]);
      v[slots[r] * kvl + c] = at::BFloat16(row[ql + kvl + c]);
    }
  }
}

// bf16 bits as fp32.
inline float widen_bf16(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// SwiGLU over fc's rows [gate | up]: silu(gate) * up, [rows, F].
at::Tensor silu_gate_up(const at::Tensor& f) {
  const int64_t half = f.size(1) / 2;
  return at::silu(f.narrow(1, 0, half)).mul_(f.narrow(1, half, half));
}

// x[0..d) *= rsqrt(mean(x^2) + eps) * w, in place (Hugging Face's RMSNorm in fp32).
void rms_norm_inplace(float* x, int64_t d, const float* w, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) x[i] = w[i] * (x[i] * r);
}

// Note [Serving tensor shapes]
// The serving kernels index the weights by the config's widths (the fused qkv rows, the heads'
// columns, the norms' d, the q/k norms' head_dim, the vocabulary's rows), not by the tensors'
// own sizes, and the tensor-parallel split narrows by them too: a checkpoint whose tensors
// disagree with its config would have them read past their buffers. So every tensor's shape is
// checked against the one the config gives it, and its dtype for being floating point (weights
// are widened from it), before anything is built; each error names the tensor, its shape and
// the expected one.
std::map<std::string, std::vector<int64_t>> expected_shapes(const models::GPTConfig& c) {
  const int64_t d = c.d_model, qkv = c.q_width() + 2 * c.kv_width(), up = c.swiglu() ? 2 * c.ff() : c.ff();
  std::map<std::string, std::vector<int64_t>> e;
  e["embed.tok.weight"] = {c.vocab, d};
  if (!c.rope()) e["embed.pos.weight"] = {c.seq_len, d};
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string b = "block" + std::to_string(i) + ".";
    for (const char* n : {"ln1", "ln2"}) {
      e[b + n + ".weight"] = {d};
      if (!c.rms()) e[b + n + ".bias"] = {d};
    }
    if (c.qk_norm) e[b + "q_norm.weight"] = e[b + "k_norm.weight"] = {c.hd()};
    e[b + "qkv.weight"] = {qkv, d};
    if (c.qkv_bias) e[b + "qkv.bias"] = {qkv};
    e[b + "attn_proj.weight"] = {d, c.q_width()};
    if (c.attn_out_bias) e[b + "attn_proj.bias"] = {d};
    if (c.moe.enabled()) {
      const models::MoEConfig m = c.experts();
      e[b + "moe.router"] = {m.num_experts, d};
      e[b + "moe.gate_up"] = {m.num_experts, 2 * m.d_ff, d};
      e[b + "moe.down"] = {m.num_experts, d, m.d_ff};
      if (m.shared_d_ff > 0) {
        e[b + "moe.shared_fc"] = {2 * m.shared_d_ff, d};
        e[b + "moe.shared_proj"] = {d, m.shared_d_ff};
        e[b + "moe.shared_gate"] = {1, d};
      }
      continue;
    }
    e[b + "fc.weight"] = {up, d};
    if (c.mlp_bias) e[b + "fc.bias"] = {up};
    e[b + "mlp_proj.weight"] = {d, c.ff()};
    if (c.mlp_bias) e[b + "mlp_proj.bias"] = {d};
  }
  e["head.ln_f.weight"] = {d};
  if (!c.rms()) e["head.ln_f.bias"] = {d};
  if (!c.tie_embeddings) e["head.weight"] = {c.vocab, d};
  return e;
}

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

void check_tensors(const checkpoint::Model& model, const models::GPTConfig& cfg) {
  const auto expected = expected_shapes(cfg);
  std::set<std::string> seen;
  for (const auto& [name, t] : model.params) {
    TS_CHECK(seen.insert(name).second, model.source, ": tensor \"", name, "\" is listed twice");
    const auto it = expected.find(name);
    TS_CHECK(it != expected.end(), model.source, ": tensor \"", name, "\" is not part of a model with config ",
             cfg.to_json().dump());
    TS_CHECK(t.defined(), model.source, ": tensor \"", name, "\" has no data");
    TS_CHECK(c10::isFloatingType(t.scalar_type()), model.source, ": tensor \"", name, "\" has dtype ", t.scalar_type(),
             "; a model's weights are floating point");
    TS_CHECK(t.sizes().vec() == it->second, model.source, ": tensor \"", name, "\" has shape ", shape_str(t.sizes()),
             ", but the model's config needs ", shape_str(it->second), " (config ", cfg.to_json().dump(), ")");
  }
  for (const auto& [name, shape] : expected) {
    TS_CHECK(seen.count(name), model.source, ": the model has no tensor \"", name, "\" (", shape_str(shape), ")");
  }
}

struct Params {
  std::map<std::string, at::Tensor> by_name;
  std::string source;
  at::Tensor take(const std::string& name) {
    auto it = by_name.find(name);
    TS_CHECK(it != by_name.end(), source, ": the model has no tensor \"", name, "\"");
    at::Tensor t = it->second.to(at::kFloat).contiguous();
    by_name.erase(it);
    return t;
  }
};
}  // namespace

InferenceModel::InferenceModel(const checkpoint::Model& model, WeightFormat format, comm::CommunicatorPtr tp, bool bf16_dot)
    : cfg_(models::GPTConfig::from_json(model.config.value("model", nlohmann::json::object()))) {
  if (tp && tp->size() > 1) tp_ = tp;
  const int tps = tp_ ? tp_->size() : 1, tpr = tp_ ? tp_->rank() : 0;
  TS_CHECK(cfg_.n_head % tps == 0, "model.n_head ", cfg_.n_head, " does not divide by --tp ", tps);
  // Each rank serves whole key/value heads; with fewer KV heads than ranks, tp / n_kv_head
  // consecutive ranks each hold (and cache) the one KV head of their query heads, as vLLM
  // replicates them.
  TS_CHECK(cfg_.kv_heads() % tps == 0 || tps % cfg_.kv_heads() == 0, "model.n_kv_head ", cfg_.kv_heads(), " and --tp ", tps,
           ": each rank serves whole key/value heads, so one must divide the other");
  heads_ = cfg_.n_head / tps;
  kv_heads_ = std::max<int64_t>(cfg_.kv_heads() / tps, 1);
  const int64_t kv_first = cfg_.kv_heads() % tps == 0 ? tpr * kv_heads_ : tpr / (tps / cfg_.kv_heads());
  if (!cfg_.swiglu()) gelu_ = activation_for_gelu(cfg_.gelu_approximate());
  hd_ = cfg_.hd();
  check_tensors(model, cfg_);  // Note [Serving tensor shapes]
  Params p;
  p.source = model.source;
  for (const auto& [name, t] : model.params) p.by_name[name] = t;
  auto split = [&](const at::Tensor& full, tensor_parallel::Split s) {
    return tp_ && full.defined() ? tensor_parallel::slice(full, s, tpr, tps).contiguous() : full;
  };
  kv_first_ = kv_first;
  auto split_qkv = [&](const at::Tensor& full) { return split_qkv_rows(full); };
  auto maybe = [&](bool present, const std::string& name) { return present ? p.take(name) : at::Tensor(); };
  const bool ln = !cfg_.rms();
  const tensor_parallel::Split rows{0, 1}, cols{1, 1}, gate_up{0, 2};
  tok_ = p.take("embed.tok.weight");
  if (!cfg_.rope()) pos_ = p.take("embed.pos.weight");
  for (int64_t i = 0; i < cfg_.n_layer; ++i) {
    const std::string b = "block" + std::to_string(i) + ".";
    Layer L;
    L.ln1_w = p.take(b + "ln1.weight");
    L.ln1_b = maybe(ln, b + "ln1.bias");
    L.ln2_w = p.take(b + "ln2.weight");
    L.ln2_b = maybe(ln, b + "ln2.bias");
    L.q_norm = maybe(cfg_.qk_norm, b + "q_norm.weight");
    L.k_norm = maybe(cfg_.qk_norm, b + "k_norm.weight");
    L.qkv = ServingLinear(split_qkv(p.take(b + "qkv.weight")), split_qkv(maybe(cfg_.qkv_bias, b + "qkv.bias")), format,
                          bf16_dot);
    L.proj = ServingLinear(split(p.take(b + "attn_proj.weight"), cols), maybe(cfg_.attn_out_bias, b + "attn_proj.bias"),
                           format, bf16_dot);
    if (cfg_.moe.enabled()) {
      const models::MoEConfig m = cfg_.experts();
      L.moe = true;
      L.router = ServingLinear(p.take(b + "moe.router"), at::Tensor(), WeightFormat::kFP32);
      const at::Tensor gu = p.take(b + "moe.gate_up"), dn = p.take(b + "moe.down");
      // Expert parallelism over the --tp ranks: consecutive blocks of experts (Note [Serving experts]).
      L.expert_first = tpr * m.num_experts / tps;
      for (int64_t e = L.expert_first; e < (tpr + 1) * m.num_experts / tps; ++e) {
        L.expert_fc.emplace_back(gu[e].contiguous(), at::Tensor(), format, bf16_dot);
        L.expert_mlp.emplace_back(dn[e].contiguous(), at::Tensor(), format, bf16_dot);
      }
      if (m.shared_d_ff > 0) {
        L.shared_fc = ServingLinear(p.take(b + "moe.shared_fc"), at::Tensor(), format, bf16_dot);
        L.shared_mlp = ServingLinear(p.take(b + "moe.shared_proj"), at::Tensor(), format, bf16_dot);
        L.shared_gate = ServingLinear(p.take(b + "moe.shared_gate"), at::Tensor(), WeightFormat::kFP32);
      }
      layers_.push_back(std::move(L));
      continue;
    }
    const tensor_parallel::Split fc_split = cfg_.swiglu() ? gate_up : rows;
    L.fc = ServingLinear(split(p.take(b + "fc.weight"), fc_split), split(maybe(cfg_.mlp_bias, b + "fc.bias"), fc_split),
                         format, bf16_dot);
    L.mlp = ServingLinear(split(p.take(b + "mlp_proj.weight"), cols), maybe(cfg_.mlp_bias, b + "mlp_proj.bias"), format,
                          bf16_dot);
    layers_.push_back(std::move(L));
  }
  lnf_w_ = p.take("head.ln_f.weight");
  lnf_b_ = maybe(ln, "head.ln_f.bias");
  // The LM head is replicated: with a byte vocabulary it is 0.3% of the weights, and splitting
  // it would add an all-gather per token.
  // With 4-bit layers the head is int8 (as llama.cpp's 4-bit files keep the output matrix in more
  // bits): the logits are what sampling reads directly.
  head_ = ServingLinear(cfg_.tie_embeddings ? tok_ : p.take("head.weight"), at::Tensor(),
                        format == WeightFormat::kQ4_0 || format == WeightFormat::kQ4_1 ? WeightFormat::kInt8 : format, bf16_dot);
  if (!p.by_name.empty()) {
    TS_CHECK(false, p.source, ": tensor \"", p.by_name.begin()->first, "\" is not part of a model with config ",
             cfg_.to_json().dump(), " (", p.by_name.size(), " unused)");
  }
  if (cfg_.rope()) {
    const models::RopeTables t = models::rope_tables(cfg_, cfg_.seq_len);
    rope_cos_ = t.cos.contiguous();
    rope_sin_ = t.sin.contiguous();
  }
}

// The fused qkv rows [q | k | v]: this rank's query heads and their KV heads.
at::Tensor InferenceModel::split_qkv_rows(const at::Tensor& full) const {
  if (!tp_ || !full.defined()) return full;
  const int64_t Q = cfg_.q_width(), KVW = cfg_.kv_width(), local_kv = kv_heads_ * cfg_.hd();
  const int64_t r = tp_->rank(), n = tp_->size(), kv0 = kv_first_ * cfg_.hd();
  return at::cat({full.narrow(0, r * Q / n, Q / n), full.narrow(0, Q + kv0, local_kv), full.narrow(0, Q + KVW + kv0, local_kv)})
      .contiguous();
}

// Note [Serving LoRA]
// A request's adapter adds B (A x) to each fused linear it targets (Note [LoRA]). Decode is
// bound by the bytes of weights read per token, and an adapter of rank 16 on all seven linears
// of SmolLM2 is 650 KB a layer in fp32: so each module keeps its own B (not a block-diagonal B
// over the fused width, whose zeros were 2-3x those bytes), in bf16 beside compact base weights,
// and the decode rows run one kernel per fused linear (lora_rows: per row, u = A x, then each
// module's rows += B_t u_t, in a fixed order: a row's bits do not depend on the batch) instead
// of a dozen ATen calls. Prompt rows (more than the row kernels take) use GEMMs.
int32_t InferenceModel::add_adapter(const checkpoint::peft::Adapter& a) {
  using checkpoint::peft::Fused;
  TS_CHECK(!cfg_.moe.enabled(), a.source, ": LoRA adapters on a Mixture-of-Experts model are not implemented");
  const std::vector<checkpoint::peft::Target> ts = checkpoint::peft::targets(cfg_);
  TS_CHECK(static_cast<int64_t>(a.A.size()) == cfg_.n_layer, a.source, ": an adapter for ", a.A.size(),
           " layers, the model has ", cfg_.n_layer);
  TS_CHECK(lora_.size() < (1u << 20), "too many LoRA adapters");
  const int tps = tp_ ? tp_->size() : 1, tpr = tp_ ? tp_->rank() : 0;
  const tensor_parallel::Split rows{0, 1}, cols{1, 1}, gate_up{0, 2};
  const at::ScalarType store = layers_.front().qkv.format() == WeightFormat::kFP32 ? at::kFloat : at::kBFloat16;
  std::vector<std::array<LoraPair, checkpoint::peft::kFusedCount>> layers(static_cast<size_t>(cfg_.n_layer));
  for (int64_t l = 0; l < cfg_.n_layer; ++l) {
    for (int f = 0; f < checkpoint::peft::kFusedCount; ++f) {
      // The modules of fused linear f: their A rows stacked; which module each output row is
      // (-1: none), split over the TP group as the linear's rows are, gives each module's rows
      // on this rank.
      std::vector<at::Tensor> As;
      std::vector<size_t> mods;
      int64_t out = 0;
      for (size_t t = 0; t < ts.size(); ++t) {
        if (static_cast<int>(ts[t].fused) != f) continue;
        out = std::max(out, ts[t].row0 + ts[t].rows);
        if (!a.A[static_cast<size_t>(l)][t].defined()) continue;
        As.push_back(a.A[static_cast<size_t>(l)][t]);
        mods.push_back(t);
      }
      if (As.empty()) continue;
      at::Tensor owner = at::full({out, 1}, -1.0f);
      for (size_t m = 0; m < mods.size(); ++m) owner.narrow(0, ts[mods[m]].row0, ts[mods[m]].rows).fill_(static_cast<float>(m));
      at::Tensor A = at::cat(As, 0);
      auto split = [&](const at::Tensor& full, tensor_parallel::Split s) {
        return tp_ ? tensor_parallel::slice(full, s, tpr, tps).contiguous() : full;
      };
      // Column-parallel linears (qkv, fc): this rank's output rows of each module. Row-parallel
      // ones (attn_proj, mlp_proj): A's columns of this rank's inputs, so that each rank's B A x
      // is its part of the update, summed by the all-reduce the linear's output takes anyway.
      switch (static_cast<Fused>(f)) {
        case Fused::kQKV: owner = split_qkv_rows(owner); break;
        case Fused::kFC: owner = split(owner, cfg_.swiglu() ? gate_up : rows); break;
        case Fused::kProj:
        case Fused::kMLP: A = split(A, cols); break;
      }
      LoraPair& p = layers[static_cast<size_t>(l)][static_cast<size_t>(f)];
      p.A = A.to(store).contiguous();
      const auto own = owner.squeeze(1);
      const float* ow = own.data_ptr<float>();
      int64_t col = 0;
      for (size_t m = 0; m < mods.size(); ++m) {
        const size_t t = mods[m];
        const at::Tensor& B = a.B[static_cast<size_t>(l)][t];
        const int64_t rm = B.size(1);
        // This rank's rows of module m: one run of the owner column.
        int64_t lo = -1, hi = -1;
        for (int64_t r = 0; r < own.size(0); ++r) {
          if (static_cast<int64_t>(ow[r]) != static_cast<int64_t>(m)) continue;
          if (lo < 0) lo = r;
          TS_INTERNAL_ASSERT(hi < 0 || hi == r, "LoRA: module rows not contiguous after the TP split");
          hi = r + 1;
        }
        if (lo >= 0) {
          // Which of the module's rows those are (GPT-2's c_attn on a TP rank: some of q, k and
          // v each): the split of the module's row indices.
          at::Tensor idx = at::full({out, 1}, -1.0f);
          idx.narrow(0, ts[t].row0, ts[t].rows).copy_(at::arange(ts[t].rows, at::kFloat).unsqueeze(1));
          switch (static_cast<Fused>(f)) {
            case Fused::kQKV: idx = split_qkv_rows(idx); break;
            case Fused::kFC: idx = split(idx, cfg_.swiglu() ? gate_up : rows); break;
            default: break;
          }
          const at::Tensor which_rows = idx.squeeze(1).narrow(0, lo, hi - lo).to(at::kLong);
          LoraModule lm;
          lm.lo = lo;
          lm.rows = hi - lo;
          lm.col = col;
          lm.r = rm;
          lm.Bt = (B.index_select(0, which_rows) * a.scale(rm)).t().contiguous().to(store).contiguous();
          p.modules.push_back(std::move(lm));
        }
        col += rm;
      }
      p.present = true;
    }
  }
  lora_.push_back(std::move(layers));
  return static_cast<int32_t>(lora_.size());
}

// The rows of one forward that one adapter updates: their indices (ascending), how many of them
// are row-kernel rows (those come first).
struct InferenceModel::LoraGroup {
  int32_t adapter = 0;
  std::vector<int64_t> rows;
  at::Tensor index;
  int64_t kernel_rows = 0;
};

namespace {
// One row of the LoRA row kernel: u = A x (R dot products of length `in`), then each module's
// rows of `o` += its B u, accumulated in d first: the same order whatever the batch. Compiled for
// AVX512, AVX2 and the baseline, chosen at load time (the build's flags target the baseline).
__attribute__((target_clones("avx512f", "avx2", "default"))) void lora_row(
    const float* xr, const void* A, bool bf16, int64_t R, int64_t in, float* u,
    const std::vector<InferenceModel::LoraModuleView>& modules, std::vector<float>& d, float* o) {
  for (int64_t j = 0; j < R; ++j) {
    float s = 0.0f;
    if (bf16) {
      const uint16_t* a = static_cast<const uint16_t*>(A) + j * in;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < in; ++k) s += xr[k] * widen_bf16(a[k]);
    } else {
      const float* a = static_cast<const float*>(A) + j * in;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < in; ++k) s += xr[k] * a[k];
    }
    u[j] = s;
  }
  for (const auto& m : modules) {
    d.assign(static_cast<size_t>(m.rows), 0.0f);
    float* dp = d.data();
    for (int64_t j = 0; j < m.r; ++j) {
      const float uj = u[m.col + j];
      if (bf16) {
        const uint16_t* b = static_cast<const uint16_t*>(m.Bt.data_ptr()) + j * m.rows;
#pragma omp simd
        for (int64_t c = 0; c < m.rows; ++c) dp[c] += uj * widen_bf16(b[c]);
      } else {
        const float* b = static_cast<const float*>(m.Bt.data_ptr()) + j * m.rows;
#pragma omp simd
        for (int64_t c = 0; c < m.rows; ++c) dp[c] += uj * b[c];
      }
    }
    float* oo = o + m.lo;
#pragma omp simd
    for (int64_t c = 0; c < m.rows; ++c) oo[c] += dp[c];
  }
}
}  // namespace

void InferenceModel::lora_add(const std::vector<LoraGroup>& groups, int64_t layer, checkpoint::peft::Fused which,
                              const at::Tensor& x, at::Tensor& out) const {
  for (const LoraGroup& g : groups) {
    const LoraPair& p = lora_[static_cast<size_t>(g.adapter - 1)][static_cast<size_t>(layer)][static_cast<size_t>(which)];
    if (!p.present) continue;
    TS_INTERNAL_ASSERT(x.is_contiguous() && out.is_contiguous(), "LoRA: inputs not contiguous");
    const int64_t R = p.A.size(0), in = p.A.size(1), ldo = out.size(1);
    if (g.kernel_rows > 0) {  // decode rows: the row kernel
      const float* xp = x.data_ptr<float>();
      float* op = out.data_ptr<float>();
      const int64_t* rows = g.rows.data();
      const bool bf16 = p.A.scalar_type() == at::kBFloat16;
      at::parallel_for(0, g.kernel_rows, 2, [&](int64_t r0, int64_t r1) {
        std::vector<float> u(static_cast<size_t>(R)), d;
        for (int64_t i = r0; i < r1; ++i) {
          lora_row(xp + rows[i] * x.size(1), p.A.data_ptr(), bf16, R, in, u.data(), p.modules, d, op + rows[i] * ldo);
        }
      });
    }
    const auto rest = static_cast<int64_t>(g.rows.size()) - g.kernel_rows;
    if (rest > 0) {  // prompt rows: GEMMs over the group's rows
      const at::Tensor idx = g.index.narrow(0, g.kernel_rows, rest);
      const at::Tensor u = x.index_select(0, idx).mm(p.A.to(at::kFloat).t());
      for (const LoraModule& m : p.modules) {
        out.narrow(1, m.lo, m.rows).index_add_(0, idx, u.narrow(1, m.col, m.r).mm(m.Bt.to(at::kFloat)));
      }
    }
  }
}

void InferenceModel::norm_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& out) const {
  if (!cfg_.rms()) {
    layer_norm_rows(x, w, b, cfg_.layer_norm_eps, out);
    return;
  }
  rms_norm_rows(x, w, cfg_.layer_norm_eps, out);
}

void InferenceModel::position_qk(at::Tensor& qkv, const std::vector<int64_t>& pos, const Layer& L) const {
  if (!cfg_.qk_norm && !cfg_.rope()) return;
  const int64_t N = qkv.size(0), ld = qkv.size(1), hd = hd_, half = hd_ / 2, heads = heads_ + kv_heads_;
  float* base = qkv.data_ptr<float>();
  const float* qn = L.q_norm.defined() ? L.q_norm.data_ptr<float>() : nullptr;
  const float* kn = L.k_norm.defined() ? L.k_norm.data_ptr<float>() : nullptr;
  const float* cs = cfg_.rope() ? rope_cos_.data_ptr<float>() : nullptr;
  const float* sn = cfg_.rope() ? rope_sin_.data_ptr<float>() : nullptr;
  const float eps = static_cast<float>(cfg_.layer_norm_eps);
  at::parallel_for(0, N * heads, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / heads, h = t % heads;  // heads [0, heads_) are queries, then keys
      float* x = base + r * ld + h * hd;            // the keys follow the queries in qkv's row
      if (qn) rms_norm_inplace(x, hd, h < heads_ ? qn : kn, eps);
      if (cs) {
        const float* c = cs + pos[static_cast<size_t>(r)] * half;
        const float* s = sn + pos[static_cast<size_t>(r)] * half;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] - x2 * s[i];
          x[i + half] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}

int64_t InferenceModel::weight_bytes() const {
  int64_t b = head_.weight_bytes();
  for (const Layer& L : layers_) {
    b += L.qkv.weight_bytes() + L.proj.weight_bytes();
    if (!L.moe) {
      b += L.fc.weight_bytes() + L.mlp.weight_bytes();
      continue;
    }
    // A decode step reads the router, k experts per token (this rank's at most) and the shared one.
    const models::MoEConfig m = cfg_.experts();
    const auto local = static_cast<int64_t>(L.expert_fc.size());
    b += L.router.weight_bytes();
    if (local > 0) b += std::min(m.k, local) * (L.expert_fc[0].weight_bytes() + L.expert_mlp[0].weight_bytes());
    if (m.shared_d_ff > 0) b += L.shared_fc.weight_bytes() + L.shared_mlp.weight_bytes() + L.shared_gate.weight_bytes();
  }
  return b;
}

// Note [Serving experts]
// An MoE layer routes each row dropless (whatever capacity the model trained with: with a
// capacity, a token's experts would depend on what else is in the batch) with the training
// code's route() over the router's logits, computed by the row kernel for decode rows so each
// row's choice has the same bits in any batch. Each expert runs over its rows (gathered in row
// order, so its decode rows lead and take the row kernel), and its output times the routing
// weight is added to the residual in expert order, as transformers' loop adds them.
// With --tp the attention splits by heads as for a dense model and the experts spread over the
// ranks (vLLM's expert parallelism beside tensor parallelism): every rank routes the same rows
// (the activations are replicated), runs only its own experts over their rows, and one
// all-reduce per layer sums the ranks' updates (the shared expert counted on rank 0). A row's
// sum does not depend on the other rows, so batching still changes no bits.
void InferenceModel::experts_add(const Layer& L, const at::Tensor& h, int64_t decode_rows, at::Tensor& x) const {
  models::MoEConfig m = cfg_.experts();
  m.drop_tokens = false;
  const at::Tensor logits = L.router.forward(h, decode_rows, /*add_bias=*/false);
  const models::Routing r = models::route(logits, m, /*training=*/false);
  const at::Tensor weights = r.weights.reshape({-1}).contiguous();
  const models::ExpertGroups groups = models::group_by_expert(r.experts, m.num_experts);
  at::Tensor update = at::zeros_like(x);
  int64_t first = 0;
  const auto local = static_cast<int64_t>(L.expert_fc.size());
  for (int64_t e = 0; e < m.num_experts; ++e) {
    const int64_t n = groups.counts[static_cast<size_t>(e)];
    const at::Tensor sel = groups.order.narrow(0, first, n);
    first += n;
    if (n == 0 || e < L.expert_first || e >= L.expert_first + local) continue;  // none, or another rank's
    const auto i = static_cast<size_t>(e - L.expert_first);
    const at::Tensor rows = at::floor_divide(sel, m.k);
    const int64_t kernel_rows = (rows < decode_rows).sum().item<int64_t>();
    const at::Tensor f = silu_gate_up(L.expert_fc[i].forward(h.index_select(0, rows).contiguous(), kernel_rows, false));
    at::Tensor y = L.expert_mlp[i].forward(f, kernel_rows, false);
    y.mul_(weights.index_select(0, sel).unsqueeze(1));
    update.index_add_(0, rows, y);
  }
  if (m.shared_d_ff > 0 && (!tp_ || tp_->rank() == 0)) {
    at::Tensor s = L.shared_mlp.forward(silu_gate_up(L.shared_fc.forward(h, decode_rows, false)), decode_rows, false);
    s.mul_(at::sigmoid(L.shared_gate.forward(h, decode_rows, false)));
    update.add_(s);
  }
  if (tp_) tp_->all_reduce(update);
  x.add_(update);
}

void InferenceModel::attention(const StepPlan& plan, int64_t layer, const at::Tensor& q, KVCache& cache,
                               const std::vector<at::Tensor>& ctx_slots, at::Tensor& out) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd_));
  const int64_t group = heads_ / kv_heads_;
  const at::Tensor& kc = cache.keys(layer);
  const at::Tensor& vc = cache.values(layer);
  std::vector<DecodeAttentionItem> decode;
  int64_t row = 0;
  for (size_t s = 0; s < plan.seqs.size(); ++s) {
    const SeqChunk& c = plan.seqs[s];
    const int64_t t = static_cast<int64_t>(c.tokens.size()), L = c.start + t;
    if (t == 1 || c.speculative) {
      // Each row over the positions up to its own, as if decoded alone (a verified draft token's
      // row gets the bits its plain decode would).
      for (int64_t i = 0; i < t; ++i) {
        decode.push_back({q[row + i].data_ptr<float>(), ctx_slots[s].data_ptr<int64_t>(), c.start + i + 1,
                          out[row + i].data_ptr<float>()});
      }
    } else {
      // A prompt chunk: its queries against every cached position up to each query's own.
      at::Tensor K = kc.index_select(0, ctx_slots[s]).to(at::kFloat);  // [L, KV, hd]
      at::Tensor V = vc.index_select(0, ctx_slots[s]).to(at::kFloat);
      if (cache.dtype() == at::kChar) {  // each row times its scale, as the decode kernel reads it
        K.mul_(cache.key_scales(layer).index_select(0, ctx_slots[s]).unsqueeze(2));
        V.mul_(cache.value_scales(layer).index_select(0, ctx_slots[s]).unsqueeze(2));
      }
      K = K.permute({1, 0, 2});  // [KV, L, hd]
      V = V.permute({1, 0, 2});
      if (group > 1) {  // each KV head for its query group, as repeat_kv
        K = K.repeat_interleave(group, 0);
        V = V.repeat_interleave(group, 0);
      }
      at::Tensor Q = q.narrow(0, row, t).permute({1, 0, 2});               // [H, t, hd]
      at::Tensor att = at::matmul(Q, K.transpose(1, 2)).mul_(scale);      // [H, t, L]
      at::Tensor qpos = at::arange(c.start, L, at::kLong).unsqueeze(1);
      at::Tensor kpos = at::arange(0, L, at::kLong).unsqueeze(0);
      att.masked_fill_(kpos > qpos, -std::numeric_limits<float>::infinity());
      at::Tensor y = at::matmul(att.softmax(-1), V);  // [H, t, hd]
      out.narrow(0, row, t).copy_(y.permute({1, 0, 2}));
    }
    row += t;
  }
  if (!decode.empty()) {
    const bool int8 = cache.dtype() == at::kChar;
    decode_attention(decode.data(), static_cast<int64_t>(decode.size()), kc.data_ptr(), vc.data_ptr(),
                     int8 ? KVType::kInt8 : cache.dtype() == at::kBFloat16 ? KVType::kBF16 : KVType::kFP32, heads_, kv_heads_,
                     hd_, scale, int8 ? cache.key_scales(layer).data_ptr<float>() : nullptr,
                     int8 ? cache.value_scales(layer).data_ptr<float>() : nullptr);
  }
}

at::Tensor InferenceModel::run(const StepPlan& plan, KVCache& cache, bool logits) {
  c10::InferenceMode guard;
  TS_INTERNAL_ASSERT(!plan.seqs.empty(), "empty step plan");
  std::vector<int64_t> toks, pos, slots, logit_rows;
  std::vector<at::Tensor> ctx;
  int64_t decode_rows = 0, decode_logit_rows = 0;
  bool leading = true;
  for (const SeqChunk& c : plan.seqs) {
    const int64_t t = static_cast<int64_t>(c.tokens.size());
    TS_INTERNAL_ASSERT(t > 0, "a chunk with no tokens");
    TS_CHECK(c.start + t <= cfg_.seq_len, "positions up to ", c.start + t, " exceed the model's context of ",
             cfg_.seq_len);
    const int64_t row0 = static_cast<int64_t>(toks.size());
    TS_INTERNAL_ASSERT(!c.speculative || (c.all_logits && c.want_logits), "a speculative chunk needs every row's logits");
    if (leading && (t == 1 || c.speculative)) {
      decode_rows += t;
      if (c.want_logits) decode_logit_rows += c.all_logits ? t : 1;
    } else {
      leading = false;
    }
    toks.insert(toks.end(), c.tokens.begin(), c.tokens.end());
    for (int64_t k = 0; k < t; ++k) pos.push_back(c.start + k);
    std::vector<int64_t> ctx_slots;
    append_slots(c.blocks, cache.block_size(), 0, c.start + t, ctx_slots);
    slots.insert(slots.end(), ctx_slots.begin() + c.start, ctx_slots.end());
    ctx.push_back(at::tensor(ctx_slots, at::kLong));
    if (c.want_logits) {
      for (int64_t k = c.all_logits ? 0 : t - 1; k < t; ++k) logit_rows.push_back(row0 + k);
    }
  }
  const int64_t N = static_cast<int64_t>(toks.size()), d = cfg_.d_model, dl = heads_ * hd_, kvl = kv_heads_ * hd_;
  // LoRA: the rows of each adapter the plan's chunks name.
  std::vector<LoraGroup> lora;
  {
    int64_t row = 0;
    for (const SeqChunk& c : plan.seqs) {
      const auto t = static_cast<int64_t>(c.tokens.size());
      if (c.adapter != 0) {
        TS_CHECK(c.adapter > 0 && c.adapter <= num_adapters(), "LoRA adapter ", c.adapter, " is not loaded (",
                 num_adapters(), " are)");
        auto it = std::find_if(lora.begin(), lora.end(), [&](const LoraGroup& g) { return g.adapter == c.adapter; });
        if (it == lora.end()) it = lora.insert(lora.end(), LoraGroup{c.adapter, {}, {}, 0});
        for (int64_t k = 0; k < t; ++k) {
          it->rows.push_back(row + k);
          if (row + k < decode_rows) ++it->kernel_rows;
        }
      }
      row += t;
    }
    for (LoraGroup& g : lora) g.index = at::tensor(g.rows, at::kLong);
  }
  using checkpoint::peft::Fused;
  const bool lora_fc_act = !lora.empty() && !cfg_.swiglu();  // GELU after fc's update, not inside its kernel
  const at::Tensor tok_t = at::tensor(toks, at::kLong);
  at::Tensor x = tok_.index_select(0, tok_t);  // [N, d]
  if (pos_.defined()) x.add_(pos_.index_select(0, at::tensor(pos, at::kLong)));
  // Per layer, besides the kernels: the layer norms (our row kernel), the cache writes and the
  // bias and residual adds (inside the linear kernels) are no separate ATen ops, which at batch
  // 1 cost about as much as a quarter of the weights' bytes.
  at::Tensor h = at::empty({N, d}, x.options());
  at::Tensor y = at::empty({N, heads_, hd_}, x.options());
  for (int64_t l = 0; l < cfg_.n_layer; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    norm_rows(x, L.ln1_w, L.ln1_b, h);
    at::Tensor qkv = L.qkv.forward(h, decode_rows);  // [N, dl + 2 kvl]
    if (!lora.empty()) lora_add(lora, l, Fused::kQKV, h, qkv);
    position_qk(qkv, pos, L);
    const at::Tensor q = qkv.narrow(1, 0, dl).view({N, heads_, hd_});  // rows dl + 2 kvl apart
    write_kv(qkv, dl, kvl, slots, cache, l);
    attention(plan, l, q, cache, ctx, y);
    if (tp_) {
      at::Tensor a = L.proj.forward(y.view({N, dl}), decode_rows, /*add_bias=*/false);
      if (!lora.empty()) lora_add(lora, l, Fused::kProj, y.view({N, dl}), a);
      tp_->all_reduce(a);
      L.proj.add_bias(a);
      x.add_(a);
    } else {
      L.proj.forward_add(y.view({N, dl}), decode_rows, x);
      if (!lora.empty()) lora_add(lora, l, Fused::kProj, y.view({N, dl}), x);
    }
    norm_rows(x, L.ln2_w, L.ln2_b, h);
    if (L.moe) {
      experts_add(L, h, decode_rows, x);
      continue;
    }
    at::Tensor f = L.fc.forward(h, decode_rows, /*add_bias=*/true,
                                cfg_.swiglu() || lora_fc_act ? Activation::kNone : gelu_);
    if (!lora.empty()) lora_add(lora, l, Fused::kFC, h, f);
    if (lora_fc_act) activate(f.data_ptr<float>(), N, f.size(1), 0, f.size(1), gelu_);  // the kernel's GELU: same bits
    if (cfg_.swiglu()) f = silu_gate_up(f);
    if (tp_) {
      at::Tensor m = L.mlp.forward(f, decode_rows, /*add_bias=*/false);
      if (!lora.empty()) lora_add(lora, l, Fused::kMLP, f, m);
      tp_->all_reduce(m);
      L.mlp.add_bias(m);
      x.add_(m);
    } else {
      L.mlp.forward_add(f, decode_rows, x);
      if (!lora.empty()) lora_add(lora, l, Fused::kMLP, f, x);
    }
  }
  const at::Tensor last = x.index_select(0, at::tensor(logit_rows, at::kLong));
  at::Tensor hf;
  if (cfg_.rms()) {
    hf = at::empty_like(last);
    rms_norm_rows(last, lnf_w_, cfg_.layer_norm_eps, hf);
  } else {
    hf = at::layer_norm(last, {d}, lnf_w_, lnf_b_, cfg_.layer_norm_eps);
  }
  if (!logits) return hf;
  return head_.forward(hf, decode_logit_rows);
}

}  // namespace torchspeed::inference
