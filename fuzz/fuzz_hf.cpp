// libFuzzer target: the Hugging Face model folder reader (checkpoint/hf_decoder.cpp: Llama,
// Mistral, Qwen2/3 and SmolLM's config.json, the sharded index). The first byte picks the
// folder: one with model.safetensors, or one with model.safetensors.index.json naming a shard;
// the rest is config.json, then (after a NUL byte) the index. The tensors are those of a tiny
// Llama (vocabulary 32, width 8, one layer, 2 heads, 1 key/value head); the fuzzer changes the
// config around them. A config that disagrees with the tensors must be refused with a
// torchspeed::Error naming the problem, never reach a LibTorch error or read out of bounds; a
// model that loads must have the shapes its config declares.
// With bit 3 set (bits 1 and 2 clear), the folder holds a tiny Mixtral instead (2 experts per
// layer, Mixtral's per-expert tensor names) and the config is a Mixture-of-Experts one's.
// With the first byte's bit 2 set, the input is instead a LoRA adapter's adapter_config.json
// (checkpoint/peft.cpp, `serve --lora-modules`) beside PEFT tensors for the same tiny Llama: a
// config that is refused must be refused with an Error, and an adapter that loads must have its
// modules' shapes.
#include <ATen/ATen.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include "fuzz_util.h"
#include "torchspeed/checkpoint/hf_decoder.h"
#include "torchspeed/checkpoint/peft.h"
#include "torchspeed/checkpoint/io_names.h"

namespace torchspeed::comm {
std::chrono::milliseconds default_timeout() { return std::chrono::minutes(10); }
}  // namespace torchspeed::comm

namespace {
namespace ck = torchspeed::checkpoint;
constexpr const char* kTarget = "fuzz_hf";

ck::NamedTensors tiny_llama() {
  auto t = [](std::initializer_list<int64_t> shape) { return at::randn(shape); };
  const std::string l = "model.layers.0.";
  return {{"model.embed_tokens.weight", t({32, 8})},
          {l + "input_layernorm.weight", t({8})},
          {l + "self_attn.q_proj.weight", t({8, 8})},
          {l + "self_attn.k_proj.weight", t({4, 8})},
          {l + "self_attn.v_proj.weight", t({4, 8})},
          {l + "self_attn.o_proj.weight", t({8, 8})},
          {l + "post_attention_layernorm.weight", t({8})},
          {l + "mlp.gate_proj.weight", t({16, 8})},
          {l + "mlp.up_proj.weight", t({16, 8})},
          {l + "mlp.down_proj.weight", t({8, 16})},
          {"model.norm.weight", t({8})}};
}

// The same tiny model with a Mixtral block: 2 experts of width 16.
ck::NamedTensors tiny_mixtral() {
  ck::NamedTensors out;
  for (auto& [name, t] : tiny_llama()) {
    if (name.find(".mlp.") == std::string::npos) out.emplace_back(name, t);
  }
  const std::string m = "model.layers.0.block_sparse_moe.";
  out.emplace_back(m + "gate.weight", at::randn({2, 8}));
  for (int e = 0; e < 2; ++e) {
    const std::string x = m + "experts." + std::to_string(e) + ".";
    out.emplace_back(x + "w1.weight", at::randn({16, 8}));
    out.emplace_back(x + "w3.weight", at::randn({16, 8}));
    out.emplace_back(x + "w2.weight", at::randn({8, 16}));
  }
  return out;
}

torchspeed::models::GPTConfig tiny_llama_config() {
  torchspeed::models::GPTConfig c;
  c.vocab = 32, c.d_model = 8, c.n_layer = 1, c.n_head = 2, c.n_kv_head = 1, c.d_ff = 16;
  c.norm = "rmsnorm", c.positions = "rope", c.activation = "swiglu";
  c.qkv_bias = c.attn_out_bias = c.mlp_bias = false;
  return c;
}

struct Folders {
  std::string single, sharded, adapter, mixtral;
  Folders() {
    adapter = fuzz::scratch_dir() + "/adapter";
    std::filesystem::create_directories(adapter);
    // rank 2 on q_proj and down_proj, rank 3 on v_proj (a rank_pattern's shapes)
    const std::string l = "base_model.model.model.layers.0.";
    ck::save_safetensors(adapter + "/adapter_model.safetensors",
                         {{l + "self_attn.q_proj.lora_A.weight", at::randn({2, 8})},
                          {l + "self_attn.q_proj.lora_B.weight", at::randn({8, 2})},
                          {l + "self_attn.v_proj.lora_A.weight", at::randn({3, 8})},
                          {l + "self_attn.v_proj.lora_B.weight", at::randn({4, 3})},
                          {l + "mlp.down_proj.lora_A.weight", at::randn({2, 16})},
                          {l + "mlp.down_proj.lora_B.weight", at::randn({8, 2})}});
    single = fuzz::scratch_dir() + "/single";
    sharded = fuzz::scratch_dir() + "/sharded";
    std::filesystem::create_directories(single);
    std::filesystem::create_directories(sharded);
    mixtral = fuzz::scratch_dir() + "/mixtral";
    std::filesystem::create_directories(mixtral);
    ck::save_safetensors(mixtral + "/model.safetensors", tiny_mixtral());
    const auto tensors = tiny_llama();
    ck::save_safetensors(single + "/model.safetensors", tensors);
    ck::save_safetensors(sharded + "/shard-1.safetensors", tensors);
  }
};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Folders folders;
  if (size < 1) return 0;
  const bool sharded = data[0] & 1;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 2) {
    fuzz::write_file(folders.adapter + "/adapter_config.json", data + 1, size - 1);
    const auto cfg = tiny_llama_config();
    ck::peft::Adapter a;
    if (!fuzz::run_expecting_errors(kTarget, [&] { a = ck::peft::load(folders.adapter, cfg); })) return 0;
    const auto targets = ck::peft::targets(cfg);
    for (size_t t = 0; t < targets.size(); ++t) {
      const at::Tensor& A = a.A[0][t];
      const at::Tensor& B = a.B[0][t];
      if (A.defined() != B.defined()) fuzz::bug(kTarget, "an adapter module with only one of A and B loaded");
      if (A.defined() && (A.size(1) != targets[t].in || B.size(0) != targets[t].rows || B.size(1) != A.size(0)))
        fuzz::bug(kTarget, "adapter module " + targets[t].module + " loaded with shapes the model cannot use");
      if (A.defined() && !std::isfinite(a.scale(A.size(0)))) fuzz::bug(kTarget, "a loaded adapter's scale is not finite");
    }
    return 0;
  }
  const size_t nul = rest.find('\0');
  const std::string dir = (data[0] & 4) && !sharded ? folders.mixtral : sharded ? folders.sharded : folders.single;
  const std::string config = rest.substr(0, nul);
  fuzz::write_file(dir + "/config.json", reinterpret_cast<const uint8_t*>(config.data()), config.size());
  if (sharded) {
    const std::string index = nul == std::string::npos ? std::string("{\"weight_map\": {}}") : rest.substr(nul + 1);
    fuzz::write_file(dir + "/model.safetensors.index.json", reinterpret_cast<const uint8_t*>(index.data()), index.size());
  }
  ck::Model m;
  if (!fuzz::run_expecting_errors(kTarget, [&] { m = ck::hf::load_decoder(dir); })) return 0;
  const auto& cfg = m.config.at("model");
  const int64_t vocab = cfg.at("vocab").get<int64_t>(), d = cfg.at("d_model").get<int64_t>();
  for (const auto& [name, t] : m.params) {
    if (name == "embed.tok.weight" && (t.dim() != 2 || t.size(0) != vocab || t.size(1) != d))
      fuzz::bug(kTarget, "the embedding's shape disagrees with the accepted config");
    if (name.find("ln") != std::string::npos && name.find(".weight") != std::string::npos && (t.dim() != 1 || t.size(0) != d))
      fuzz::bug(kTarget, "norm " + name + " does not have the config's width");
    if (name.find(".moe.gate_up") != std::string::npos) {
      const auto& e = cfg.at("moe");
      if (t.dim() != 3 || t.size(0) != e.at("num_experts").get<int64_t>() || t.size(1) != 2 * e.at("d_ff").get<int64_t>() ||
          t.size(2) != d)
        fuzz::bug(kTarget, "the experts' shape disagrees with the accepted config");
    }
  }
  return 0;
}
