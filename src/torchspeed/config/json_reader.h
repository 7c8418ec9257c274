// JsonReader: reads one JSON object of a config, key by key, into typed values. Every problem is
// recorded with its JSON path ("zero_optimization.stage: expected an integer ..."); keys nobody
// read are reported at finish() with the nearest known key as a suggestion.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace torchspeed::config {

// Errors and warnings collected while reading a config, so all of them are shown at once.
struct Diagnostics {
  std::vector<std::string> errors;
  std::vector<std::string> warnings;
  // Keys nobody reads (TorchspeedConfig::unknown_keys): kTypos refuses those near a known key and
  // warns about the rest; kError refuses all, kWarn none.
  enum class UnknownKeys { kTypos, kError, kWarn };
  UnknownKeys unknown_keys = UnknownKeys::kTypos;
};

// Edit distance between two keys (for "did you mean").
int edit_distance(const std::string& a, const std::string& b);
// The closest candidate within a distance that scales with the key length, or "".
std::string nearest_key(const std::string& key, const std::vector<std::string>& candidates);

class JsonReader {
 public:
  // `j` must outlive the reader. `path` is the JSON path of `j` ("" for the root).
  JsonReader(const nlohmann::json& j, std::string path, Diagnostics& diag);

  bool has(const std::string& key) const;
  std::string path_of(const std::string& key) const;

  bool get_bool(const std::string& key, bool fallback);
  int64_t get_int(const std::string& key, int64_t fallback,
                  int64_t min = std::numeric_limits<int64_t>::min(),
                  int64_t max = std::numeric_limits<int64_t>::max());
  std::optional<int64_t> get_opt_int(const std::string& key,
                                     int64_t min = std::numeric_limits<int64_t>::min(),
                                     int64_t max = std::numeric_limits<int64_t>::max());
  double get_double(const std::string& key, double fallback,
                    double min = -std::numeric_limits<double>::infinity(),
                    double max = std::numeric_limits<double>::infinity());
  std::optional<double> get_opt_double(const std::string& key);
  // `allowed` (compared case-insensitively) is empty for any string; the canonical spelling
  // from `allowed` is returned.
  std::string get_string(const std::string& key, const std::string& fallback,
                         const std::vector<std::string>& allowed = {});
  std::vector<double> get_double_list(const std::string& key, std::vector<double> fallback,
                                      size_t size);
  // A nested object; nullopt (and an error when it is not an object) otherwise.
  std::optional<JsonReader> child(const std::string& key);
  // The raw value of a key (marked known), or nullptr.
  const nlohmann::json* raw(const std::string& key);

  // Marks keys as understood without reading them.
  void accept(const std::string& key) { known_.insert(key); }
  // An old spelling: warns with the replacement.
  void deprecated(const std::string& key, const std::string& replacement);
  void error(const std::string& key, const std::string& message);
  void warn(const std::string& key, const std::string& message);

  // Reports every key of the object that was not read or accepted.
  void finish();

 private:
  const nlohmann::json* find(const std::string& key);
  void type_error(const std::string& key, const char* expected);

  const nlohmann::json& j_;
  std::string path_;
  Diagnostics& diag_;
  std::set<std::string> known_;
};

std::string json_type_name(const nlohmann::json& v);

}  // namespace torchspeed::config
