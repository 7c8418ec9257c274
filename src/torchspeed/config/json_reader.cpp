// Typed, path-aware reading of JSON objects for the config loader.
#include "torchspeed/config/json_reader.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "torchspeed/base/error.h"

namespace torchspeed::config {
namespace {
std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}
}  // namespace

int edit_distance(const std::string& a, const std::string& b) {
  std::vector<int> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = static_cast<int>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = static_cast<int>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      int sub = prev[j - 1] + (std::tolower(a[i - 1]) == std::tolower(b[j - 1]) ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string nearest_key(const std::string& key, const std::vector<std::string>& candidates) {
  std::string best;
  int best_d = std::max<int>(2, static_cast<int>(key.size()) / 3) + 1;
  for (const auto& c : candidates) {
    int d = edit_distance(key, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

std::string json_type_name(const nlohmann::json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return concat("boolean ", v.dump());
  if (v.is_number()) return concat("number ", v.dump());
  if (v.is_string()) return concat("string ", v.dump());
  if (v.is_array()) return "an array";
  return "an object";
}

JsonReader::JsonReader(const nlohmann::json& j, std::string path, Diagnostics& diag)
    : j_(j), path_(std::move(path)), diag_(diag) {}

bool JsonReader::has(const std::string& key) const { return j_.is_object() && j_.contains(key); }

std::string JsonReader::path_of(const std::string& key) const {
  return path_.empty() ? key : path_ + "." + key;
}

const nlohmann::json* JsonReader::find(const std::string& key) {
  known_.insert(key);
  if (!j_.is_object()) return nullptr;
  auto it = j_.find(key);
  if (it == j_.end()) return nullptr;
  return &*it;
}

const nlohmann::json* JsonReader::raw(const std::string& key) { return find(key); }

void JsonReader::type_error(const std::string& key, const char* expected) {
  diag_.errors.push_back(concat(path_of(key), ": expected ", expected, ", found ",
                             json_type_name(j_.at(key))));
}

void JsonReader::error(const std::string& key, const std::string& message) {
  diag_.errors.push_back(concat(path_of(key), ": ", message));
}

void JsonReader::warn(const std::string& key, const std::string& message) {
  diag_.warnings.push_back(concat(path_of(key), ": ", message));
}

bool JsonReader::get_bool(const std::string& key, bool fallback) {
  const auto* v = find(key);
  if (!v || v->is_null()) return fallback;
  if (!v->is_boolean()) {
    type_error(key, "true or false");
    return fallback;
  }
  return v->get<bool>();
}

std::optional<int64_t> JsonReader::get_opt_int(const std::string& key, int64_t min, int64_t max) {
  const auto* v = find(key);
  if (!v || v->is_null()) return std::nullopt;
  if (!v->is_number()) {
    type_error(key, "an integer");
    return std::nullopt;
  }
  int64_t x;
  if (v->is_number_float()) {
    // Real configs write integers as floats: 5e8, 1e12, 2.0.
    double d = v->get<double>();
    if (!std::isfinite(d) || std::floor(d) != d || std::fabs(d) > 9.0e18) {
      type_error(key, "an integer");
      return std::nullopt;
    }
    x = static_cast<int64_t>(d);
  } else if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    type_error(key, "an integer below 2^63");
    return std::nullopt;
  } else {
    x = v->get<int64_t>();
  }
  if (x < min || x > max) {
    std::string range = max == std::numeric_limits<int64_t>::max() ? concat(">= ", min)
                                                                    : concat("in [", min, ", ", max, "]");
    error(key, concat("must be ", range, ", got ", x));
    return std::nullopt;
  }
  return x;
}

int64_t JsonReader::get_int(const std::string& key, int64_t fallback, int64_t min, int64_t max) {
  return get_opt_int(key, min, max).value_or(fallback);
}

std::optional<double> JsonReader::get_opt_double(const std::string& key) {
  const auto* v = find(key);
  if (!v || v->is_null()) return std::nullopt;
  if (!v->is_number()) {
    type_error(key, "a number");
    return std::nullopt;
  }
  return v->get<double>();
}

double JsonReader::get_double(const std::string& key, double fallback, double min, double max) {
  auto v = get_opt_double(key);
  if (!v) return fallback;
  if (*v < min || *v > max) {
    error(key, concat("must be in [", min, ", ", max, "], got ", *v));
    return fallback;
  }
  return *v;
}

std::string JsonReader::get_string(const std::string& key, const std::string& fallback,
                                   const std::vector<std::string>& allowed) {
  const auto* v = find(key);
  if (!v || v->is_null()) return fallback;
  if (!v->is_string()) {
    type_error(key, "a string");
    return fallback;
  }
  std::string s = v->get<std::string>();
  if (allowed.empty()) return s;
  for (const auto& a : allowed)
    if (lower(a) == lower(s)) return a;
  std::string list;
  for (const auto& a : allowed) list += concat(list.empty() ? "" : ", ", "\"", a, "\"");
  std::string near = nearest_key(s, allowed);
  error(key, concat("\"", s, "\" is not one of ", list,
                 near.empty() ? std::string() : concat(" (did you mean \"", near, "\"?)")));
  return fallback;
}

std::vector<double> JsonReader::get_double_list(const std::string& key,
                                                std::vector<double> fallback, size_t size) {
  const auto* v = find(key);
  if (!v || v->is_null()) return fallback;
  if (!v->is_array() || v->size() != size ||
      !std::all_of(v->begin(), v->end(), [](const nlohmann::json& x) { return x.is_number(); })) {
    type_error(key, concat("a list of ", size, " numbers").c_str());
    return fallback;
  }
  std::vector<double> out;
  for (const auto& x : *v) out.push_back(x.get<double>());
  return out;
}

std::optional<JsonReader> JsonReader::child(const std::string& key) {
  const auto* v = find(key);
  if (!v || v->is_null()) return std::nullopt;
  if (!v->is_object()) {
    type_error(key, "an object");
    return std::nullopt;
  }
  return JsonReader(*v, path_of(key), diag_);
}

void JsonReader::deprecated(const std::string& key, const std::string& replacement) {
  if (has(key)) warn(key, concat("is deprecated; use ", replacement, " instead"));
}

void JsonReader::finish() {
  if (!j_.is_object()) return;
  std::vector<std::string> candidates(known_.begin(), known_.end());
  for (const auto& item : j_.items()) {
    if (known_.count(item.key())) continue;
    const std::string near = nearest_key(item.key(), candidates);
    using UK = Diagnostics::UnknownKeys;
    if (!near.empty() && diag_.unknown_keys != UK::kWarn) {
      error(item.key(), concat("unknown key; did you mean \"", near, "\"? (a key this close to a known one is taken for a "
                               "typo; \"torchspeed\": {\"unknown_keys\": \"warn\"} accepts it)"));
    } else if (diag_.unknown_keys == UK::kError) {
      error(item.key(), "unknown key (\"torchspeed\": {\"unknown_keys\": \"error\"} refuses every unknown key)");
    } else {
      warn(item.key(), concat("unknown key, ignored as DeepSpeed ignores it",
                              near.empty() ? std::string() : concat(" (did you mean \"", near, "\"?)")));
    }
  }
}

}  // namespace torchspeed::config
