// Text data for language models: a byte-level tokenizer, a corpus read from files or folders
// (default: the fortunes Debian installs), split into train and validation, a distributed
// sampler that gives each data-parallel rank a disjoint shard of every epoch (reshuffled from the
// seed, resumable at an exact position), and a loader that prepares the next batch in the
// background.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <future>
#include <string>
#include <vector>

#include "torchspeed/data/tokenizer.h"

namespace torchspeed::data {

constexpr const char* kDefaultCorpus = "/usr/share/games/fortunes";

// Bytes are tokens (vocab 256): no vocabulary file, any text round-trips.
struct ByteTokenizer : Tokenizer {
  static constexpr int64_t kVocab = 256;
  std::vector<int64_t> encode(const std::string& text) const override;
  std::string token_bytes(int64_t id) const override;
  int64_t vocab_size() const override { return kVocab; }
  std::string source() const override { return "bytes"; }
};

// Token ids of a corpus split (int32: GPT-2's 50257 ids and more).
using TokenIds = std::vector<int32_t>;

struct TextCorpus {
  TokenIds train, val;
  std::vector<std::string> files;
  int64_t bytes = 0;  // of text, before tokenization

  // Reads a file or every text file under a folder (sorted; fortune index files *.dat and
  // duplicate links are skipped; '%' separator lines of fortune files dropped), tokenized with
  // `tokenizer` (bytes when null). The last `val_fraction` of the tokens is the validation split.
  // Errors name the path.
  static TextCorpus load(const std::string& path, double val_fraction, int64_t min_tokens,
                         const Tokenizer* tokenizer = nullptr);

  // Conditional entropy H(next token | token) of the training split, in nats: the loss of the
  // best bigram model, the baseline a trained model must beat.
  double bigram_entropy() const;
};

// Which windows of a split each rank reads, epoch by epoch. Window i covers tokens
// [i * seq_len, i * seq_len + seq_len + 1) (inputs and next-token targets).
class DistributedSampler {
 public:
  DistributedSampler(int64_t num_windows, int dp_rank, int dp_size, uint64_t seed);
  // The next window index for this rank; advances epochs as needed.
  int64_t next();
  int64_t windows_per_rank() const { return per_rank_; }
  nlohmann::json state() const { return {{"epoch", epoch_}, {"position", position_}, {"dp_size", size_}}; }
  // A state saved at another data-parallel size continues after the same share of the epoch.
  void load_state(const nlohmann::json& s);
  int64_t epoch() const { return epoch_; }
  // Every window this rank reads in `epoch`, in order.
  std::vector<int64_t> shard(int64_t epoch) const;

 private:
  int64_t windows_, per_rank_;
  int rank_, size_;
  uint64_t seed_;
  int64_t epoch_ = 0, position_ = 0;
  std::vector<int64_t> current_;
};

struct Batch {
  at::Tensor inputs, targets;  // [batch, seq_len] int64
};

// Micro-batches of windows from one split, the next one built on a background thread.
class TextLoader {
 public:
  TextLoader(const TokenIds& tokens, int64_t seq_len, int64_t batch, int dp_rank,
             int dp_size, uint64_t seed);
  ~TextLoader();
  Batch next();
  DistributedSampler& sampler() { return sampler_; }
  // The sampler's position after the batches next() has returned (not the one prepared ahead):
  // what a checkpoint saves. load_state drops the prepared batch.
  nlohmann::json state() const { return consumed_; }
  void load_state(const nlohmann::json& s);
  int64_t num_windows() const { return windows_; }

 private:
  Batch build();
  const TokenIds& tokens_;
  int64_t seq_len_, batch_, windows_;
  DistributedSampler sampler_;
  std::future<Batch> pending_;
  nlohmann::json consumed_;
};

}  // namespace torchspeed::data
