// Reading one declared key (Note [Config keys declared once] in keys.h).
#include "torchspeed/config/keys.h"

#include <optional>

#include "torchspeed/config/detail/sections.h"

namespace torchspeed::config {

const char* treatment_name(Treatment t) {
  switch (t) {
    case Treatment::kHonoured: return "honoured";
    case Treatment::kWarned: return "warned";
    case Treatment::kNoEffect: return "no effect";
    case Treatment::kRefused: return "refused";
  }
  return "honoured";
}

namespace detail {
namespace {
// Every spelling given is read (and checked); the first one given wins; absent ones are known.
template <typename T, typename Read>
T read_spellings(JsonReader& r, const std::string& name, const std::vector<std::string>& aliases, T fallback, Read&& read) {
  std::optional<T> found;
  auto one = [&](const std::string& key) {
    if (!r.has(key)) return r.accept(key);
    T v = read(key);
    if (!found) found = std::move(v);
  };
  one(name);
  for (const auto& a : aliases) one(a);
  return found ? std::move(*found) : std::move(fallback);
}
}  // namespace

bool read_key(JsonReader& r, const std::string& name, const std::vector<std::string>& aliases, bool fallback, int64_t,
              int64_t, double, double, const std::vector<std::string>&) {
  return read_spellings(r, name, aliases, fallback, [&](const std::string& k) { return r.get_bool(k, fallback); });
}

int64_t read_key(JsonReader& r, const std::string& name, const std::vector<std::string>& aliases, int64_t fallback,
                 int64_t imin, int64_t imax, double, double, const std::vector<std::string>&) {
  return read_spellings(r, name, aliases, fallback, [&](const std::string& k) { return r.get_int(k, fallback, imin, imax); });
}

double read_key(JsonReader& r, const std::string& name, const std::vector<std::string>& aliases, double fallback, int64_t,
                int64_t, double dmin, double dmax, const std::vector<std::string>&) {
  return read_spellings(r, name, aliases, fallback, [&](const std::string& k) { return r.get_double(k, fallback, dmin, dmax); });
}

std::string read_key(JsonReader& r, const std::string& name, const std::vector<std::string>& aliases,
                     std::string fallback, int64_t, int64_t, double, double, const std::vector<std::string>& allowed) {
  return read_spellings(r, name, aliases, fallback,
                        [&](const std::string& k) { return r.get_string(k, fallback, allowed); });
}

void treat_key(JsonReader& r, const std::string& name, Treatment t, const std::string& why, bool refused_bool) {
  switch (t) {
    case Treatment::kHonoured: r.accept(name); break;
    case Treatment::kWarned:
      r.accept(name);
      if (r.has(name)) r.warn(name, why);
      break;
    case Treatment::kNoEffect: no_effect(r, name, why); break;
    case Treatment::kRefused: r.accept(name); only(r, name, refused_bool, refused_bool, why); break;
  }
}

std::string show_value(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>().empty() ? "\"\"" : v.get<std::string>();
  return v.dump();
}

std::string show_range(const std::string& lo, const std::string& hi) {
  if (lo.empty() && hi.empty()) return "any";
  if (hi.empty()) return ">= " + lo;
  if (lo.empty()) return "<= " + hi;
  return lo + " .. " + hi;
}

std::string escape_cell(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}
}  // namespace detail

}  // namespace torchspeed::config
