// Corpus loading, the bigram baseline, the sampler and the loader.
#include "torchspeed/data/text.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <unordered_map>

#include "torchspeed/base/error.h"

namespace fs = std::filesystem;

namespace torchspeed::data {

std::vector<int64_t> ByteTokenizer::encode(const std::string& text) const {
  std::vector<int64_t> out;
  out.reserve(text.size());
  for (unsigned char c : text) out.push_back(c);
  return out;
}

std::string ByteTokenizer::token_bytes(int64_t id) const {
  TS_CHECK(id >= 0 && id < kVocab, "token id ", id, " is outside the byte vocabulary [0, 256)");
  return std::string(1, static_cast<char>(id));
}

namespace {
std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  TS_CHECK(in.good(), "cannot read '", p.string(), "'");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  TS_CHECK(s.find('\0') == std::string::npos, "'", p.string(), "' is not a text file (it contains NUL bytes)");
  // Fortune files separate entries with lines holding a single '%'.
  std::string out;
  std::istringstream lines(s);
  std::string line;
  while (std::getline(lines, line)) {
    if (line == "%") continue;
    out += line;
    out += '\n';
  }
  return out;
}
}  // namespace

TextCorpus TextCorpus::load(const std::string& path, double val_fraction, int64_t min_tokens, const Tokenizer* tokenizer) {
  TS_CHECK(val_fraction > 0 && val_fraction < 0.5, "data.val_fraction must be in (0, 0.5), got ", val_fraction);
  TS_CHECK(fs::exists(path), "data path '", path, "' does not exist",
           path == kDefaultCorpus ? " (install the corpus: apt-get install fortunes)" : "");
  TextCorpus c;
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    std::set<fs::path> seen;
    for (const auto& e : fs::recursive_directory_iterator(path)) {
      if (!e.is_regular_file() || e.is_symlink()) continue;
      const auto ext = e.path().extension().string();
      if (ext == ".dat" || ext == ".u8" || ext == ".gz") continue;
      if (seen.insert(fs::canonical(e.path())).second) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  std::string text;
  for (const auto& f : files) {
    text += read_text(f);
    c.files.push_back(f.string());
  }
  TS_CHECK(!text.empty(), "data path '", path, "' holds no text");
  c.bytes = static_cast<int64_t>(text.size());
  TokenIds ids;
  if (tokenizer) {
    for (int64_t id : tokenizer->encode(text)) ids.push_back(static_cast<int32_t>(id));
  } else {
    ids.assign(reinterpret_cast<const unsigned char*>(text.data()), reinterpret_cast<const unsigned char*>(text.data()) + text.size());
  }
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t n_val = static_cast<int64_t>(n * val_fraction);
  TS_CHECK(n - n_val >= min_tokens && n_val >= min_tokens, "the corpus at '", path, "' has ", n,
           " tokens: too short for windows of ", min_tokens, " tokens in both splits (validation ",
           n_val, " tokens); use more text or a shorter model.seq_len");
  c.train.assign(ids.begin(), ids.end() - n_val);
  c.val.assign(ids.end() - n_val, ids.end());
  return c;
}

double TextCorpus::bigram_entropy() const {
  std::unordered_map<int64_t, double> pair, first;
  for (size_t i = 0; i + 1 < train.size(); ++i) {
    pair[(static_cast<int64_t>(train[i]) << 32) | static_cast<uint32_t>(train[i + 1])] += 1;
    first[train[i]] += 1;
  }
  const double total = static_cast<double>(train.size() - 1);
  double h = 0.0;
  for (const auto& [key, c] : pair) h -= c / total * std::log(c / first[key >> 32]);
  return h;
}

DistributedSampler::DistributedSampler(int64_t num_windows, int rank, int size, uint64_t seed)
    : windows_(num_windows), rank_(rank), size_(size), seed_(seed) {
  TS_CHECK(size >= 1 && rank >= 0 && rank < size, "sampler: rank ", rank, " of ", size);
  per_rank_ = num_windows / size;  // every rank the same count: ranks stay in step
  TS_CHECK(per_rank_ >= 1, "the data has ", num_windows, " windows, fewer than the ", size,
           " data-parallel ranks; use more text or a shorter model.seq_len");
  current_ = shard(0);
}

std::vector<int64_t> DistributedSampler::shard(int64_t epoch) const {
  std::vector<int64_t> perm(static_cast<size_t>(windows_));
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 gen(seed_ * 1000003ULL + static_cast<uint64_t>(epoch));
  std::shuffle(perm.begin(), perm.end(), gen);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < per_rank_; ++i) out.push_back(perm[static_cast<size_t>(i * size_ + rank_)]);
  return out;
}

int64_t DistributedSampler::next() {
  if (position_ == per_rank_) {
    ++epoch_;
    position_ = 0;
    current_ = shard(epoch_);
  }
  return current_[static_cast<size_t>(position_++)];
}

void DistributedSampler::load_state(const nlohmann::json& s) {
  TS_CHECK(s.contains("epoch") && s.contains("position"), "sampler state needs epoch and position, got ", s.dump());
  epoch_ = s.at("epoch").get<int64_t>();
  position_ = s.at("position").get<int64_t>();
  const int64_t saved_size = s.value("dp_size", static_cast<int64_t>(size_));
  if (saved_size != size_) position_ = std::min(per_rank_, position_ * saved_size / size_);
  TS_CHECK(position_ >= 0 && position_ <= per_rank_, "sampler state position ", position_, " outside 0..", per_rank_);
  current_ = shard(epoch_);
}

TextLoader::TextLoader(const TokenIds& tokens, int64_t seq_len, int64_t batch, int rank,
                       int size, uint64_t seed)
    : tokens_(tokens),
      seq_len_(seq_len),
      batch_(batch),
      windows_((static_cast<int64_t>(tokens.size()) - 1) / seq_len),
      sampler_(windows_, rank, size, seed),
      consumed_(sampler_.state()) {}

TextLoader::~TextLoader() {
  if (pending_.valid()) pending_.wait();
}

Batch TextLoader::build() {
  Batch b;
  b.inputs = at::empty({batch_, seq_len_}, at::kLong);
  b.targets = at::empty({batch_, seq_len_}, at::kLong);
  int64_t* x = b.inputs.data_ptr<int64_t>();
  int64_t* y = b.targets.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch_; ++i) {
    const int64_t start = sampler_.next() * seq_len_;
    for (int64_t t = 0; t < seq_len_; ++t) {
      x[i * seq_len_ + t] = tokens_[static_cast<size_t>(start + t)];
      y[i * seq_len_ + t] = tokens_[static_cast<size_t>(start + t + 1)];
    }
  }
  return b;
}

Batch TextLoader::next() {
  Batch b = pending_.valid() ? pending_.get() : build();
  consumed_ = sampler_.state();  // no build is running now
  pending_ = std::async(std::launch::async, [this] { return build(); });
  return b;
}

void TextLoader::load_state(const nlohmann::json& s) {
  if (pending_.valid()) pending_.get();
  sampler_.load_state(s);
  consumed_ = sampler_.state();
}

}  // namespace torchspeed::data
