// The schedule of quantization-aware training: binds a config's compression groups to a model's
// compressible layers by name, and before each forward sets every bound layer's quantization
// from the number of optimizer steps applied so far (DeepSpeed's compression_scheduler and MoQ
// Quantizer). The state is a function of that count, so a resumed run continues exactly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/compression/quantize.h"
#include "torchspeed/config/config.h"
#include "torchspeed/nn/layer_stack.h"

namespace torchspeed::compression {

class Schedule {
 public:
  // Binds `config`'s groups to the compressible layers of `stack` (this rank's layers). Each
  // pattern must match a layer somewhere in the model: with pipeline stages the matches are
  // counted over `stages` (the pipeline group; null for one stage). Errors name the group's JSON
  // path. Tensor-parallel layers are not compressible (`tp` > 1 is refused).
  Schedule(const config::CompressionConfig& config, nn::LayerStack& stack, const comm::CommunicatorPtr& stages, int tp);

  // Sets every bound layer's state for the forward passes after `applied` optimizer steps
  // (steps skipped for an fp16 overflow do not count, as in DeepSpeed).
  void update(int64_t applied);

  // The layers a group was bound to (full names), for logs and tests.
  std::vector<std::string> bound(const std::string& group) const;
  // The weight bits MoQ uses after `applied` steps in `group` (0: not quantized yet).
  int weight_bits(const std::string& group) const;

 private:
  struct Binding {
    SiteState* state;
    Site::Kind kind;
    int64_t rows;
    size_t group;
    std::string name;
  };
  void bind(const std::vector<config::QuantizeGroupConfig>& groups, bool linear_only, const std::string& what,
            std::vector<Binding>& out, const comm::CommunicatorPtr& stages);
  void advance_moq(int64_t calls);

  config::CompressionConfig config_;
  std::vector<std::pair<std::string, std::vector<Site>>> layers_;  // (layer name, its sites)
  std::vector<Binding> weights_, inputs_;
  int64_t applied_ = -1;
  // MoQ after `calls` quantizations: each group's bits and period, the shared blend ratio.
  int64_t moq_calls_ = 0;
  double moq_ratio_ = 1.0;
  std::vector<int> moq_bits_;
  std::vector<int64_t> moq_period_;
};

}  // namespace torchspeed::compression
