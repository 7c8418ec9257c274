// libFuzzer target: the GGUF reader. The bytes are a file: the header parser (magic, version,
// counts, typed metadata, tensor table, alignment, extents) on the bytes in memory, every
// tensor of an accepted header dequantized, then the file read as a model (load_gguf: metadata
// to the model description, shapes against it) and as a tokenizer (BpeTokenizer::from_gguf).
// Refusals are torchspeed::Error; anything else, or a read outside the bytes (ASan), is a bug.
#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "torchspeed/checkpoint/gguf.h"
#include "torchspeed/data/bpe_tokenizer.h"

namespace {
namespace g = torchspeed::checkpoint::gguf;
constexpr const char* kTarget = "fuzz_gguf";
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  g::Header h;
  const bool ok = fuzz::run_expecting_errors(kTarget, [&] { h = g::parse_header(data, size, size, "fuzz.gguf"); });
  if (ok) {
    for (const auto& t : h.tensors) {
      if (t.numel() > (int64_t{1} << 22)) continue;  // bounded work per input
      if (h.data_offset + t.offset + static_cast<uint64_t>(t.bytes) > size) fuzz::bug(kTarget, "a tensor's extent passed the check but not the file");
      std::vector<float> out(static_cast<size_t>(t.numel()));
      fuzz::run_expecting_errors(kTarget, [&] {
        g::dequantize(t.type, data + h.data_offset + t.offset, t.bytes, t.numel(), out.data(), t.name);
      });
    }
  }
  static const std::string in = fuzz::scratch_dir() + "/in.gguf";
  fuzz::write_file(in, data, size);
  fuzz::run_expecting_errors(kTarget, [&] { (void)g::load_gguf(in); });
  fuzz::run_expecting_errors(kTarget, [&] {
    const auto tok = torchspeed::data::BpeTokenizer::from_gguf(in);
    const auto ids = tok.encode("Hello 123 <|im_end|> w\xc3\xb6rld");
    for (int64_t id : ids) (void)tok.token_bytes(id);
  });
  return 0;
}
