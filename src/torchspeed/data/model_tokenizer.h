// Which tokenizer goes with a model that checkpoint::load_model(path) returned.
#pragma once

#include <string>

#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/data/tokenizer.h"

namespace torchspeed::data {

// `spec` when given ("bytes" or a tokenizer path); else tokenizer files beside the model (a
// Hugging Face folder, or the model/ folder of a run); else the training config's
// data.tokenizer; else bytes. Its vocabulary must fit the model's (an error naming both).
TokenizerPtr tokenizer_of_model(const std::string& path, const checkpoint::Model& model, const std::string& spec = "");

}  // namespace torchspeed::data
