// Every tensor of a GGUF file dequantized by torchspeed's reader (checkpoint/gguf.h), written as
// safetensors for a Python test to compare with the gguf package's dequantization.
// usage: gguf_tensors FILE.gguf OUT.safetensors
#include <cstdio>

#include "torchspeed/checkpoint/gguf.h"
#include "torchspeed/checkpoint/io_names.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: gguf_tensors FILE.gguf OUT.safetensors\n");
    return 2;
  }
  try {
    const torchspeed::checkpoint::gguf::File f(argv[1]);
    torchspeed::checkpoint::NamedTensors out;
    for (const auto& t : f.header().tensors) out.emplace_back(t.name, f.tensor(t));
    torchspeed::checkpoint::save_safetensors(argv[2], out);
    std::printf("gguf_tensors: %zu tensors of %s (version %u)\n", out.size(), argv[1], f.header().version);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gguf_tensors: %s\n", e.what());
    return 1;
  }
}
