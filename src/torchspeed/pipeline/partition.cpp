// Balanced contiguous partitions (binary search on the heaviest part's weight).
#include "torchspeed/pipeline/partition.h"

#include <algorithm>
#include <numeric>
#include <regex>

#include "torchspeed/base/error.h"

namespace torchspeed::pipeline {
namespace {

// Greedy cut with each part's weight at most `limit` and at least one layer per part.
bool fits(const std::vector<int64_t>& w, int stages, int64_t limit, std::vector<size_t>* bounds) {
  std::vector<size_t> b{0};
  const size_t n = w.size();
  int64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {
    // Taking layer i into the current part must leave a layer for every later stage.
    const size_t stages_left = static_cast<size_t>(stages) - b.size();  // stages after the current one
    const bool must_cut = n - i <= stages_left && i > b.back();
    if (i > b.back() && (sum + w[i] > limit || must_cut)) {
      b.push_back(i);
      sum = 0;
      if (static_cast<int>(b.size()) > stages) return false;
    }
    if (w[i] > limit) return false;
    sum += w[i];
  }
  b.push_back(n);
  if (static_cast<int>(b.size()) != stages + 1) return false;
  if (bounds) *bounds = std::move(b);
  return true;
}

}  // namespace

std::vector<size_t> partition_balanced(const std::vector<int64_t>& weights, int stages) {
  TS_CHECK(stages >= 1, "pipeline.stages must be >= 1, got ", stages);
  TS_CHECK(static_cast<size_t>(stages) <= weights.size(), "pipeline.stages ", stages, " exceeds the model's ",
           weights.size(), " layers; every stage needs at least one layer");
  int64_t lo = 0, hi = std::accumulate(weights.begin(), weights.end(), int64_t{0});
  for (int64_t w : weights) lo = std::max(lo, w);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fits(weights, stages, mid, nullptr)) hi = mid;
    else lo = mid + 1;
  }
  std::vector<size_t> bounds;
  TS_INTERNAL_ASSERT(fits(weights, stages, lo, &bounds), "no partition at the searched limit ", lo);
  return bounds;
}

std::vector<size_t> partition(const nn::StackSpec& spec, int stages, const std::string& method) {
  const size_t n = spec.size();
  std::vector<int64_t> w(n, 1);
  if (method == "uniform") {
    // DeepSpeed's partition_uniform: equal counts, the remainder to the first stages.
    TS_CHECK(static_cast<size_t>(stages) <= n, "pipeline.stages ", stages, " exceeds the model's ", n, " layers");
    std::vector<size_t> b{0};
    for (int s = 0; s < stages; ++s) b.push_back(b.back() + n / stages + (static_cast<size_t>(s) < n % stages ? 1 : 0));
    return b;
  }
  if (method == "parameters") {
    for (size_t i = 0; i < n; ++i) w[i] = spec.layer_params(i);
  } else if (method.rfind("type:", 0) == 0) {
    std::regex re;
    try {
      re = std::regex(method.substr(5), std::regex::icase);
    } catch (const std::regex_error& e) {
      TS_CHECK(false, "pipeline.partition_method '", method, "': invalid regular expression: ", e.what());
    }
    int64_t matched = 0;
    for (size_t i = 0; i < n; ++i) {
      w[i] = std::regex_search(spec.layers[i].name, re) ? 1 : 0;
      matched += w[i];
    }
    TS_CHECK(matched >= stages, "pipeline.partition_method '", method, "' matches ", matched, " layers, fewer than the ",
             stages, " stages");
  } else {
    TS_CHECK(false, "pipeline.partition_method '", method, "': expected uniform, parameters or type:REGEX");
  }
  return partition_balanced(w, stages);
}

}  // namespace torchspeed::pipeline
