// Config keys declared once (Note [Config keys declared once]): a section's plain keys are a
// table of Key<Section> entries, and the reader, Config::to_json and docs/config.md's key
// reference (`torchspeed config --keys`) all come from that table.
//
// Note [Config keys declared once]
// A key is declared by one entry: its DeepSpeed name, the struct member it fills, its other
// spellings, its range or allowed strings, how torchspeed treats it and one line saying what it
// does. Its default is the member's initializer in config.h and nothing else: read_keys takes
// the member's value before reading as the fallback, so a section whose default depends on
// another key (overlap_comm on stage) sets the member first. Keys whose reading needs more than
// a table entry (a type with its own parser, checks across keys) stay in their section's reader
// beside the table, which still lists them for the reference when they map to a member.
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "torchspeed/config/json_reader.h"
#include "torchspeed/base/error.h"

namespace torchspeed::config {

// What torchspeed does with a key.
enum class Treatment {
  kHonoured,  // what DeepSpeed documents
  kWarned,    // a value other than the default changes nothing here: a warning says why
  kNoEffect,  // a tuning knob with no counterpart: a warning whenever it is given
  kRefused,   // a value other than the default is not available: an error says why
};
const char* treatment_name(Treatment t);  // "honoured", "warned", "no effect", "refused"

template <typename S>
struct Key {
  using Member = std::variant<std::monostate, bool S::*, int S::*, int64_t S::*, double S::*, std::string S::*>;

  std::string name;
  Member member;     // monostate: read for its treatment only (no member holds it)
  std::string doc;   // what it does in torchspeed, one line
  std::vector<std::string> aliases;  // other spellings DeepSpeed reads; the first one given wins
  int64_t imin = std::numeric_limits<int64_t>::min(), imax = std::numeric_limits<int64_t>::max();
  double dmin = -std::numeric_limits<double>::infinity(), dmax = std::numeric_limits<double>::infinity();
  std::vector<std::string> allowed;  // strings: the canonical spellings, compared case-insensitively
  Treatment treatment = Treatment::kHonoured;
  std::string why;       // kWarned, kNoEffect, kRefused: the message
  bool refused_bool = false;  // a member-less kRefused key: the one bool value accepted
  bool by_section = false;    // read by the section's own code (listed for to_json and the reference)

  Key(std::string n, Member m, std::string d) : name(std::move(n)), member(m), doc(std::move(d)) {}
  Key& range(double lo, double hi = std::numeric_limits<double>::infinity()) {
    dmin = lo;
    dmax = hi;
    imin = lo <= -9.2e18 ? std::numeric_limits<int64_t>::min() : static_cast<int64_t>(lo);
    imax = hi >= 9.2e18 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(hi);
    return *this;
  }
  Key& one_of(std::vector<std::string> values) {
    allowed = std::move(values);
    return *this;
  }
  Key& alias(std::string other) {
    aliases.push_back(std::move(other));
    return *this;
  }
  Key& warned(std::string message) {
    treatment = Treatment::kWarned;
    why = std::move(message);
    return *this;
  }
  Key& no_effect(std::string message) {
    treatment = Treatment::kNoEffect;
    why = std::move(message);
    return *this;
  }
  Key& refused(std::string message) {
    treatment = Treatment::kRefused;
    why = std::move(message);
    return *this;
  }
  // Read by the section's reader, not read_keys (a value that needs more than the table).
  Key& read_by_section() {
    by_section = true;
    return *this;
  }
  // A member-less boolean of which only `value` is available.
  Key& only(bool value, std::string message) {
    refused_bool = value;
    return refused(std::move(message));
  }
};

template <typename S>
using KeyTable = std::vector<Key<S>>;

namespace detail {
// One key of any member type (keys.cpp); `fallback` and the result are the member's value.
bool read_key(JsonReader& r, const std::string& name, const std::vector<std::string>& aliases, bool fallback,
              int64_t, int64_t, double, double, const std::vector<std::string>&);
int64_t read_key(JsonReader& r, const std::string& name, const std::vector<std::string>& aliases, int64_t fallback,
                 int64_t imin, int64_t imax, double, double, const std::vector<std::string>&);
double read_key(JsonReader& r, const std::string& name, const std::vector<std::string>& aliases, double fallback,
                int64_t, int64_t, double dmin, double dmax, const std::vector<std::string>&);
std::string read_key(JsonReader& r, const std::string& name, const std::vector<std::string>& aliases,
                     std::string fallback, int64_t, int64_t, double, double, const std::vector<std::string>& allowed);
// A member-less key: its treatment only.
void treat_key(JsonReader& r, const std::string& name, Treatment t, const std::string& why, bool refused_bool);
std::string show_value(const nlohmann::json& v);
std::string escape_cell(const std::string& s);  // for a Markdown table cell
// "lo .. hi", ">= lo", "<= hi" or "any" ("" for an open end).
std::string show_range(const std::string& lo, const std::string& hi);
}  // namespace detail

// Reads every key of the table into `s`, each member's current value its default, and applies
// the keys' treatments.
template <typename S>
void read_keys(JsonReader& r, S& s, const KeyTable<S>& keys) {
  static const S defaults{};  // (static: GCC -O3 takes a local for uninitialised)
  for (const auto& k : keys) {
    if (k.by_section) continue;
    if (k.member.index() == 0) {
      detail::treat_key(r, k.name, k.treatment, k.why, k.refused_bool);
      continue;
    }
    std::visit(
        [&](auto m) {
          if constexpr (!std::is_same_v<decltype(m), std::monostate>) {
            auto& v = s.*m;
            using T = std::decay_t<decltype(v)>;
            if constexpr (std::is_same_v<T, int>) {
              v = static_cast<int>(detail::read_key(r, k.name, k.aliases, int64_t{v}, k.imin, k.imax, k.dmin, k.dmax, k.allowed));
            } else {
              v = detail::read_key(r, k.name, k.aliases, v, k.imin, k.imax, k.dmin, k.dmax, k.allowed);
            }
            if (k.treatment == Treatment::kWarned && v != defaults.*m) r.warn(k.name, k.why);
            if (k.treatment == Treatment::kRefused && v != defaults.*m) r.error(k.name, k.why);
            if (k.treatment == Treatment::kNoEffect) {  // each spelling given, by its name
              if (r.has(k.name)) r.warn(k.name, concat("has no effect in torchspeed: ", k.why));
              for (const auto& a : k.aliases)
                if (r.has(a)) r.warn(a, concat("has no effect in torchspeed: ", k.why));
            }
          }
        },
        k.member);
  }
}

// The table's members of `s` as DeepSpeed JSON (member-less keys are left out).
template <typename S>
nlohmann::json keys_to_json(const S& s, const KeyTable<S>& keys) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& k : keys) {
    std::visit(
        [&](auto m) {
          if constexpr (!std::is_same_v<decltype(m), std::monostate>) j[k.name] = s.*m;
        },
        k.member);
  }
  return j;
}

// One row per key of the table for docs/config.md: key (and other spellings), default, values,
// treatment and what it does.
// `defaults`: the section's defaults where they differ from the struct's (offload_optimizer).
template <typename S>
std::string keys_reference(const std::string& section, const KeyTable<S>& keys, const S& defaults = S{}) {
  std::string out = concat("### `", section.empty() ? "(top level)" : section, "`\n\n",
                           "| Key | Default | Values | Treatment | In torchspeed |\n|---|---|---|---|---|\n");
  for (const auto& k : keys) {
    std::string name = concat("`", k.name, "`");
    for (const auto& a : k.aliases) name += concat(" (`", a, "`)");
    std::string def = "", values = "";
    std::visit(
        [&](auto m) {
          if constexpr (std::is_same_v<decltype(m), std::monostate>) {
            values = k.treatment == Treatment::kRefused ? concat("only ", k.refused_bool ? "true" : "false") : "any";
          } else {
            using T = std::decay_t<decltype(defaults.*m)>;
            def = detail::show_value(nlohmann::json(defaults.*m));
            if constexpr (std::is_same_v<T, bool>) {
              values = "true, false";
            } else if constexpr (std::is_same_v<T, std::string>) {
              for (const auto& a : k.allowed) values += concat(values.empty() ? "" : ", ", "`", a, "`");
              if (values.empty()) values = "any string";
            } else if constexpr (std::is_same_v<T, double>) {
              values = detail::show_range(std::isinf(k.dmin) ? "" : detail::show_value(k.dmin),
                                          std::isinf(k.dmax) ? "" : detail::show_value(k.dmax));
            } else {
              values = detail::show_range(k.imin == std::numeric_limits<int64_t>::min() ? "" : std::to_string(k.imin),
                                          k.imax == std::numeric_limits<int64_t>::max() ? "" : std::to_string(k.imax));
            }
          }
        },
        k.member);
    std::string does = k.doc;
    if (k.treatment != Treatment::kHonoured) does += concat(k.doc.empty() ? "" : " ", "(", k.why, ")");
    out += concat("| ", name, " | ", def.empty() ? "" : concat("`", def, "`"), " | ", values, " | ",
                  treatment_name(k.treatment), " | ", detail::escape_cell(does), " |\n");
  }
  return out + "\n";
}

}  // namespace torchspeed::config
