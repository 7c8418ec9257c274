// GGUF out (gguf_writer.h).
#include "torchspeed/checkpoint/gguf_writer.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <map>

#include "torchspeed/checkpoint/io_names.h"
#include "torchspeed/base/error.h"

namespace torchspeed::checkpoint::gguf {
namespace {

// GGUF's value types (gguf.h in ggml).
enum : uint32_t { kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kString = 8, kArray = 9, kU64 = 10 };

void put(std::string& out, const void* p, size_t n) { out.append(static_cast<const char*>(p), n); }
template <typename T>
void put(std::string& out, T v) {
  put(out, &v, sizeof(v));
}
void put_string(std::string& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out += s;
}

void put_value(std::string& out, const Value& v) {
  std::visit(
      [&](const auto& x) {
        using X = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<X, uint32_t>) {
          put<uint32_t>(out, kU32), put(out, x);
        } else if constexpr (std::is_same_v<X, int32_t>) {
          put<uint32_t>(out, kI32), put(out, x);
        } else if constexpr (std::is_same_v<X, float>) {
          put<uint32_t>(out, kF32), put(out, x);
        } else if constexpr (std::is_same_v<X, bool>) {
          put<uint32_t>(out, kBool), put<uint8_t>(out, x ? 1 : 0);
        } else if constexpr (std::is_same_v<X, std::string>) {
          put<uint32_t>(out, kString), put_string(out, x);
        } else if constexpr (std::is_same_v<X, uint64_t>) {
          put<uint32_t>(out, kU64), put(out, x);
        } else if constexpr (std::is_same_v<X, std::vector<std::string>>) {
          put<uint32_t>(out, kArray), put<uint32_t>(out, kString), put<uint64_t>(out, x.size());
          for (const auto& s : x) put_string(out, s);
        } else if constexpr (std::is_same_v<X, std::vector<int32_t>>) {
          put<uint32_t>(out, kArray), put<uint32_t>(out, kI32), put<uint64_t>(out, x.size());
          put(out, x.data(), x.size() * sizeof(int32_t));
        } else {
          static_assert(std::is_same_v<X, std::vector<float>>);
          put<uint32_t>(out, kArray), put<uint32_t>(out, kF32), put<uint64_t>(out, x.size());
          put(out, x.data(), x.size() * sizeof(float));
        }
      },
      v);
}

constexpr uint64_t kAlign = 32;
void pad(std::string& out) { out.append((kAlign - out.size() % kAlign) % kAlign, '\0'); }

int64_t encoded_bytes(Type type, int64_t n) {
  switch (type) {
    case Type::kF32: return 4 * n;
    case Type::kF16:
    case Type::kBF16: return 2 * n;
    case Type::kQ8_0: return n / 32 * 34;
    case Type::kQ4_0: return n / 32 * 18;
    case Type::kQ4_1: return n / 32 * 20;
    default: TS_CHECK(false, "GGUF writer: type ", type_name(static_cast<uint32_t>(type)), " is not written (F32, F16, BF16, Q8_0, Q4_0, Q4_1 are)");
  }
  return 0;
}

}  // namespace

std::string encode(Type type, const float* x, int64_t n) {
  std::string out;
  out.reserve(static_cast<size_t>(encoded_bytes(type, n)));
  switch (type) {
    case Type::kF32:
      put(out, x, static_cast<size_t>(n) * 4);
      break;
    case Type::kF16:
      for (int64_t i = 0; i < n; ++i) put<uint16_t>(out, c10::Half(x[i]).x);
      break;
    case Type::kBF16:
      for (int64_t i = 0; i < n; ++i) put<uint16_t>(out, c10::BFloat16(x[i]).x);
      break;
    case Type::kQ8_0: {
      TS_CHECK(n % 32 == 0, "GGUF writer: Q8_0 needs a multiple of 32 values, not ", n);
      for (int64_t b = 0; b < n; b += 32) {
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b + j]));
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        put<uint16_t>(out, c10::Half(d).x);
        for (int j = 0; j < 32; ++j) put<int8_t>(out, static_cast<int8_t>(std::round(x[b + j] * id)));
      }
      break;
    }
    case Type::kQ4_0: {
      // quantize_row_q4_0_ref: d = the value of largest magnitude / -8; low nibbles hold values
      // 0-15, high 16-31 (inference::quantize_q4 repacks these blocks for its kernel).
      TS_CHECK(n % 32 == 0, "GGUF writer: Q4_0 needs a multiple of 32 values, not ", n);
      for (int64_t b = 0; b < n; b += 32) {
        float amax = 0.f, max = 0.f;
        for (int j = 0; j < 32; ++j) {
          if (amax < std::fabs(x[b + j])) {
            amax = std::fabs(x[b + j]);
            max = x[b + j];
          }
        }
        const float d = max / -8.f, id = d != 0.f ? 1.f / d : 0.f;
        put<uint16_t>(out, c10::Half(d).x);
        auto q = [&](int j) { return std::min(15, static_cast<int>(static_cast<int8_t>(x[b + j] * id + 8.5f))); };
        for (int j = 0; j < 16; ++j) put<uint8_t>(out, static_cast<uint8_t>(q(j) | (q(16 + j) << 4)));
      }
      break;
    }
    case Type::kQ4_1: {
      // quantize_row_q4_1_ref: d = (max - min) / 15, m = min, q = (x - min) / d rounded.
      TS_CHECK(n % 32 == 0, "GGUF writer: Q4_1 needs a multiple of 32 values, not ", n);
      for (int64_t b = 0; b < n; b += 32) {
        float lo = x[b], hi = x[b];
        for (int j = 1; j < 32; ++j) {
          lo = std::min(lo, x[b + j]);
          hi = std::max(hi, x[b + j]);
        }
        const float d = (hi - lo) / 15.f, id = d != 0.f ? 1.f / d : 0.f;
        put<uint16_t>(out, c10::Half(d).x);
        put<uint16_t>(out, c10::Half(lo).x);
        auto q = [&](int j) { return std::min(15, static_cast<int>(static_cast<int8_t>((x[b + j] - lo) * id + 0.5f))); };
        for (int j = 0; j < 16; ++j) put<uint8_t>(out, static_cast<uint8_t>(q(j) | (q(16 + j) << 4)));
      }
      break;
    }
    default: encoded_bytes(type, n);  // the error
  }
  return out;
}

namespace {

uint32_t file_type(Type type) {
  // llama_ftype: ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q4_0 2, MOSTLY_Q4_1 3, MOSTLY_Q8_0 7, MOSTLY_BF16 32.
  switch (type) {
    case Type::kF32: return 0;
    case Type::kF16: return 1;
    case Type::kQ4_0: return 2;
    case Type::kQ4_1: return 3;
    case Type::kQ8_0: return 7;
    default: return 32;
  }
}

Type tensor_type(Type file, const std::string& name, const at::Tensor& x) {
  if (x.dim() == 1) return Type::kF32;
  // 4-bit files keep the embedding and the output matrix in Q8_0 (llama.cpp's quantize gives them
  // more bits too); we serve the LM head of 4-bit models in int8.
  const bool four_bit = file == Type::kQ4_0 || file == Type::kQ4_1;
  if (four_bit && (name == "token_embd.weight" || name == "output.weight")) file = Type::kQ8_0;
  if ((file == Type::kQ8_0 || four_bit) && x.size(-1) % 32 != 0) return Type::kF16;
  return file;
}

}  // namespace

int64_t write(const std::string& path, const Metadata& metadata, const std::vector<OutTensor>& tensors) {
  std::string out;
  out += "GGUF";
  put<uint32_t>(out, 3);
  put<uint64_t>(out, tensors.size());
  put<uint64_t>(out, metadata.size());
  for (const auto& [k, v] : metadata) {
    put_string(out, k);
    put_value(out, v);
  }
  uint64_t offset = 0;
  std::vector<at::Tensor> data;
  for (const auto& t : tensors) {
    const at::Tensor x = t.data.to(at::kFloat).contiguous();
    TS_CHECK(x.dim() >= 1 && x.dim() <= 4, path, ": tensor ", t.name, " has ", x.dim(), " dimensions");
    put_string(out, t.name);
    put<uint32_t>(out, static_cast<uint32_t>(x.dim()));
    for (int64_t d = x.dim() - 1; d >= 0; --d) put<uint64_t>(out, static_cast<uint64_t>(x.size(d)));  // fastest first
    put<uint32_t>(out, static_cast<uint32_t>(t.type));
    put<uint64_t>(out, offset);
    offset += static_cast<uint64_t>(encoded_bytes(t.type, x.numel()));
    offset += (kAlign - offset % kAlign) % kAlign;
    data.push_back(x);
  }
  pad(out);
  out.reserve(out.size() + offset);
  for (size_t i = 0; i < tensors.size(); ++i) {
    out += encode(tensors[i].type, data[i].data_ptr<float>(), data[i].numel());
    pad(out);
  }
  write_file_atomic(path, out);
  return static_cast<int64_t>(out.size());
}

std::string architecture_of(const nlohmann::json& m) {
  TS_CHECK(!(m.contains("moe") && m.at("moe").value("num_experts", int64_t{0}) > 0),
           "convert --format gguf: Mixture-of-Experts models (model.moe) are not written as GGUF yet; --format hf writes "
           "them as Mixtral / Qwen2-MoE / Qwen3-MoE");
  auto is = [&](const char* key, const std::string& want, const std::string& dflt) { return m.value(key, dflt) == want; };
  // GPT-2 itself (learned positions, LayerNorm, a GELU MLP with biases): llama.cpp's "gpt2", whose
  // GELU is the tanh approximation (HF GPT-2's gelu_new), so only a model trained with that one.
  if (is("positions", "learned", "learned") && is("norm", "layernorm", "layernorm") && !is("activation", "swiglu", "gelu")) {
    TS_CHECK(is("activation", "gelu_tanh", "gelu"), "convert --format gguf: model.activation is \"",
             m.value("activation", std::string("gelu")), "\"; llama.cpp's gpt2 architecture computes GELU's tanh approximation ",
             "(\"gelu_tanh\", HF GPT-2's gelu_new), not the exact GELU");
    TS_CHECK(!m.value("qk_norm", false), "convert --format gguf: q/k norms in a GPT-2 model fit no llama.cpp architecture");
    // Absent bias keys mean GPTConfig's default, GPT-2's: every linear has its bias.
    TS_CHECK(m.value("qkv_bias", true) && m.value("attn_out_bias", true) && m.value("mlp_bias", true),
             "convert --format gguf: llama.cpp's gpt2 architecture has a bias on every linear layer; this model lacks some");
    const int64_t d = m.at("d_model").get<int64_t>(), heads = m.at("n_head").get<int64_t>();
    TS_CHECK(m.value("n_kv_head", heads) == heads && m.value("head_dim", d / heads) == d / heads && m.value("d_ff", 4 * d) == 4 * d,
             "convert --format gguf: llama.cpp's gpt2 architecture has n_kv_head = n_head, head_dim = d_model / n_head and ",
             "d_ff = 4 d_model");
    return "gpt2";
  }
  TS_CHECK(is("positions", "rope", "learned"), "convert --format gguf: model.positions is \"",
           m.value("positions", std::string("learned")), "\"; GGUF is written for rotary-position decoders (Llama, Mistral, Qwen2, Qwen3, SmolLM)");
  TS_CHECK(is("norm", "rmsnorm", "layernorm"), "convert --format gguf: model.norm is \"", m.value("norm", std::string("layernorm")),
           "\"; llama.cpp's llama/qwen2/qwen3 architectures use RMSNorm");
  TS_CHECK(is("activation", "swiglu", "gelu"), "convert --format gguf: model.activation is \"",
           m.value("activation", std::string("gelu")), "\"; llama.cpp's llama/qwen2/qwen3 architectures use SwiGLU");
  TS_CHECK(!m.value("mlp_bias", false), "convert --format gguf: model.mlp_bias true has no place in llama.cpp's architectures");
  const bool qk_norm = m.value("qk_norm", false), qkv_bias = m.value("qkv_bias", false), out_bias = m.value("attn_out_bias", false);
  if (m.contains("rope_scaling") && m["rope_scaling"].is_object()) {
    const std::string t = m["rope_scaling"].value("type", std::string("none"));
    TS_CHECK(t == "none" || t == "linear", "convert --format gguf: model.rope_scaling.type \"", t,
             "\" is not written yet (none and linear are)");
  }
  if (qk_norm) {
    TS_CHECK(!qkv_bias && !out_bias, "convert --format gguf: q/k norms with attention biases fit no llama.cpp architecture");
    return "qwen3";
  }
  if (qkv_bias) {
    TS_CHECK(!out_bias, "convert --format gguf: model.attn_out_bias true fits no llama.cpp architecture with q/k/v biases");
    return "qwen2";
  }
  TS_CHECK(!out_bias, "convert --format gguf: model.attn_out_bias true has no place in llama.cpp's llama architecture");
  return "llama";
}

namespace {

// llama.cpp's "gpt2": fused q/k/v (our qkv, rows q;k;v as HF's c_attn transposed), every linear
// and norm with its bias, learned positions kept F32 as llama.cpp's converter keeps them.
int64_t save_gpt2(const std::string& path, const NamedTensors& params, const nlohmann::json& m, Type type,
                  const std::string& name, const Metadata& tokenizer) {
  const int64_t d = m.at("d_model").get<int64_t>(), n_layer = m.at("n_layer").get<int64_t>();
  Metadata md;
  md.emplace_back("general.architecture", std::string("gpt2"));
  md.emplace_back("general.name", name);
  md.emplace_back("general.file_type", file_type(type));
  if (type == Type::kQ8_0 || type == Type::kQ4_0 || type == Type::kQ4_1) md.emplace_back("general.quantization_version", uint32_t{2});
  md.emplace_back("gpt2.vocab_size", static_cast<uint32_t>(m.at("vocab").get<int64_t>()));
  md.emplace_back("gpt2.context_length", static_cast<uint32_t>(m.at("seq_len").get<int64_t>()));
  md.emplace_back("gpt2.embedding_length", static_cast<uint32_t>(d));
  md.emplace_back("gpt2.block_count", static_cast<uint32_t>(n_layer));
  md.emplace_back("gpt2.feed_forward_length", static_cast<uint32_t>(4 * d));
  md.emplace_back("gpt2.attention.head_count", static_cast<uint32_t>(m.at("n_head").get<int64_t>()));
  md.emplace_back("gpt2.attention.layer_norm_epsilon", static_cast<float>(m.value("layer_norm_eps", 1e-5)));
  md.insert(md.end(), tokenizer.begin(), tokenizer.end());
  std::map<std::string, at::Tensor> by_name(params.begin(), params.end());
  std::vector<OutTensor> ts;
  auto add = [&](const std::string& n, const std::string& ours, bool keep_f32 = false) {
    const auto it = by_name.find(ours);
    TS_CHECK(it != by_name.end(), "convert --format gguf: the model has no parameter ", ours);
    const at::Tensor x = it->second.to(at::kFloat);
    ts.push_back({n, x, keep_f32 ? Type::kF32 : tensor_type(type, n, x)});
  };
  add("token_embd.weight", "embed.tok.weight");
  add("position_embd.weight", "embed.pos.weight", true);
  for (int64_t i = 0; i < n_layer; ++i) {
    const std::string g = "blk." + std::to_string(i) + ".", b = "block" + std::to_string(i) + ".";
    for (const char* wb : {"weight", "bias"}) {
      add(g + "attn_norm." + wb, b + "ln1." + wb);
      add(g + "attn_qkv." + wb, b + "qkv." + wb);
      add(g + "attn_output." + wb, b + "attn_proj." + wb);
      add(g + "ffn_norm." + wb, b + "ln2." + wb);
      add(g + "ffn_up." + wb, b + "fc." + wb);
      add(g + "ffn_down." + wb, b + "mlp_proj." + wb);
    }
  }
  add("output_norm.weight", "head.ln_f.weight");
  add("output_norm.bias", "head.ln_f.bias");
  if (!m.value("tie_embeddings", true)) add("output.weight", "head.weight");  // tied: llama.cpp reuses token_embd
  return write(path, md, ts);
}

}  // namespace

int64_t save_gguf(const std::string& path, const NamedTensors& params, const nlohmann::json& m, Type type,
                  const std::string& name, const Metadata& tokenizer) {
  const std::string arch = architecture_of(m);
  if (arch == "gpt2") return save_gpt2(path, params, m, type, name, tokenizer);
  const std::string p = arch + ".";
  const int64_t d = m.at("d_model").get<int64_t>(), heads = m.at("n_head").get<int64_t>();
  const int64_t kv = m.value("n_kv_head", heads), hd = m.value("head_dim", d / heads);
  const int64_t n_layer = m.at("n_layer").get<int64_t>(), ff = m.value("d_ff", 4 * d);
  const int64_t vocab = m.at("vocab").get<int64_t>();
  Metadata md;
  md.emplace_back("general.architecture", arch);
  md.emplace_back("general.name", name);
  md.emplace_back("general.file_type", file_type(type));
  if (type == Type::kQ8_0 || type == Type::kQ4_0 || type == Type::kQ4_1) md.emplace_back("general.quantization_version", uint32_t{2});
  md.emplace_back(p + "vocab_size", static_cast<uint32_t>(vocab));
  md.emplace_back(p + "context_length", static_cast<uint32_t>(m.at("seq_len").get<int64_t>()));
  md.emplace_back(p + "embedding_length", static_cast<uint32_t>(d));
  md.emplace_back(p + "block_count", static_cast<uint32_t>(n_layer));
  md.emplace_back(p + "feed_forward_length", static_cast<uint32_t>(ff));
  md.emplace_back(p + "attention.head_count", static_cast<uint32_t>(heads));
  md.emplace_back(p + "attention.head_count_kv", static_cast<uint32_t>(kv));
  md.emplace_back(p + "attention.key_length", static_cast<uint32_t>(hd));
  md.emplace_back(p + "attention.value_length", static_cast<uint32_t>(hd));
  md.emplace_back(p + "rope.dimension_count", static_cast<uint32_t>(hd));
  md.emplace_back(p + "rope.freq_base", static_cast<float>(m.value("rope_theta", 10000.0)));
  md.emplace_back(p + "attention.layer_norm_rms_epsilon", static_cast<float>(m.value("layer_norm_eps", 1e-5)));
  if (m.contains("rope_scaling") && m["rope_scaling"].is_object() && m["rope_scaling"].value("type", std::string()) == "linear") {
    md.emplace_back(p + "rope.scaling.type", std::string("linear"));
    md.emplace_back(p + "rope.scaling.factor", static_cast<float>(m["rope_scaling"].at("factor").get<double>()));
  }
  md.insert(md.end(), tokenizer.begin(), tokenizer.end());

  std::map<std::string, at::Tensor> by_name(params.begin(), params.end());
  auto get = [&](const std::string& n) {
    const auto it = by_name.find(n);
    TS_CHECK(it != by_name.end(), "convert --format gguf: the model has no parameter ", n);
    return it->second.to(at::kFloat);
  };
  std::vector<OutTensor> ts;
  auto add = [&](const std::string& n, const at::Tensor& x) {
    ts.push_back({n, x, tensor_type(type, n, x)});
  };
  // llama.cpp's "llama" architecture rotates interleaved pairs: its converter permutes q and k
  // rows (the inverse of load_gguf's unpermute); qwen2/qwen3 rotate halves as we do.
  const bool permute = arch == "llama";
  auto perm = [&](const at::Tensor& w, int64_t n_head) {
    if (!permute) return w;
    const int64_t rows = w.size(0);
    return w.reshape({n_head, 2, hd / 2, -1}).transpose(1, 2).reshape({rows, -1}).contiguous();
  };
  add("token_embd.weight", get("embed.tok.weight"));
  for (int64_t i = 0; i < n_layer; ++i) {
    const std::string g = "blk." + std::to_string(i) + ".", b = "block" + std::to_string(i) + ".";
    add(g + "attn_norm.weight", get(b + "ln1.weight"));
    const auto qkv = get(b + "qkv.weight").split_with_sizes({heads * hd, kv * hd, kv * hd});
    add(g + "attn_q.weight", perm(qkv[0], heads));
    add(g + "attn_k.weight", perm(qkv[1], kv));
    add(g + "attn_v.weight", qkv[2].contiguous());
    if (m.value("qkv_bias", false)) {
      const auto bias = get(b + "qkv.bias").split_with_sizes({heads * hd, kv * hd, kv * hd});
      add(g + "attn_q.bias", perm(bias[0].unsqueeze(1), heads).squeeze(1));
      add(g + "attn_k.bias", perm(bias[1].unsqueeze(1), kv).squeeze(1));
      add(g + "attn_v.bias", bias[2].contiguous());
    }
    if (m.value("qk_norm", false)) {
      add(g + "attn_q_norm.weight", get(b + "q_norm.weight"));
      add(g + "attn_k_norm.weight", get(b + "k_norm.weight"));
    }
    add(g + "attn_output.weight", get(b + "attn_proj.weight"));
    add(g + "ffn_norm.weight", get(b + "ln2.weight"));
    const auto fc = get(b + "fc.weight").split_with_sizes({ff, ff});
    add(g + "ffn_gate.weight", fc[0].contiguous());
    add(g + "ffn_up.weight", fc[1].contiguous());
    add(g + "ffn_down.weight", get(b + "mlp_proj.weight"));
  }
  add("output_norm.weight", get("head.ln_f.weight"));
  if (!m.value("tie_embeddings", true)) add("output.weight", get("head.weight"));
  return write(path, md, ts);
}

}  // namespace torchspeed::checkpoint::gguf
