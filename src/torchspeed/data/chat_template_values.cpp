// Values of the chat-template interpreter as Python shows them: str, repr, json.dumps (chat_template_internal.h).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <functional>
#include <map>
#include <set>

#include "torchspeed/data/chat_template_internal.h"
#include "torchspeed/base/error.h"

namespace torchspeed::data::jinja {

// Dict keys: JSON objects key by string, Python dicts by any value; an integer key (a template's
// {4096: 512}) is kept as "\x01" + its digits and comes back as an integer.
std::string dict_key(const json& k) { return k.is_number_integer() ? "\x01" + std::to_string(k.get<int64_t>()) : py_str(k); }
json key_json(const std::string& k) {
  if (k.size() > 1 && k[0] == '\x01') {
    try {
      return std::stoll(k.substr(1));
    } catch (const std::exception&) {
    }
  }
  return k;
}

// markupsafe's escape.
std::string html_escape(const std::string& s) {
  std::string r;
  for (char c : s) {
    switch (c) {
      case '&': r += "&amp;"; break;
      case '<': r += "&lt;"; break;
      case '>': r += "&gt;"; break;
      case '"': r += "&#34;"; break;
      case '\'': r += "&#39;"; break;
      default: r += c;
    }
  }
  return r;
}

// Python's repr of a float: the shortest text that reads back, with ".0" on whole numbers.
std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), d);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".eE") == std::string::npos && s.find("inf") == std::string::npos) s += ".0";
  // to_chars writes 1e+20 as "1e+20"; Python writes "1e+20" too.
  return s;
}

std::string py_repr(const json& v);

std::string py_str(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "None";
    case json::value_t::boolean: return v.get<bool>() ? "True" : "False";
    case json::value_t::number_integer: return std::to_string(v.get<int64_t>());
    case json::value_t::number_unsigned: return std::to_string(v.get<uint64_t>());
    case json::value_t::number_float: return py_float(v.get<double>());
    case json::value_t::string: return v.get<std::string>();
    default: return py_repr(v);
  }
}

std::string py_repr(const json& v) {
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
    std::string out(1, dq ? '"' : '\'');
    for (char c : s) {
      if (c == '\\') out += "\\\\";
      else if (c == '\n') out += "\\n";
      else if (c == '\t') out += "\\t";
      else if (c == '\r') out += "\\r";
      else if (c == (dq ? '"' : '\'')) out += std::string("\\") + c;
      else out += c;
    }
    return out + (dq ? '"' : '\'');
  }
  if (v.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + py_repr(v[i]);
    return out + "]";
  }
  if (v.is_object()) {
    std::string out = "{";
    bool first = true;
    for (const auto& [k, x] : v.items()) {
      out += (first ? "" : ", ") + py_repr(key_json(k)) + ": " + py_repr(x);
      first = false;
    }
    return out + "}";
  }
  return py_str(v);
}

bool truthy(const Value& v) {
  if (v.k == Value::K::kUndef) return false;
  if (v.k != Value::K::kJson) return true;
  const json& j = v.j;
  switch (j.type()) {
    case json::value_t::null: return false;
    case json::value_t::boolean: return j.get<bool>();
    case json::value_t::number_integer: return j.get<int64_t>() != 0;
    case json::value_t::number_unsigned: return j.get<uint64_t>() != 0;
    case json::value_t::number_float: return j.get<double>() != 0.0;
    case json::value_t::string: return !j.get_ref<const std::string&>().empty();
    case json::value_t::array:
    case json::value_t::object: return !j.empty();
    default: return true;
  }
}

// The next code point of UTF-8 text at i (a stray byte stands for itself).
uint32_t next_cp(const std::string& s, size_t& i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (len == 1 || i + len > s.size()) {
    ++i;
    return c;
  }
  uint32_t cp = c & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += len;
  return cp;
}

void py_json(const json& v, const JsonStyle& st, int level, std::string& out) {
  const int indent = st.indent;
  auto nl = [&](int lv) {
    if (indent >= 0) {
      out += '\n';
      out.append(static_cast<size_t>(indent * lv), ' ');
    }
  };
  switch (v.type()) {
    case json::value_t::null: out += "null"; return;
    case json::value_t::boolean: out += v.get<bool>() ? "true" : "false"; return;
    case json::value_t::number_integer: out += std::to_string(v.get<int64_t>()); return;
    case json::value_t::number_unsigned: out += std::to_string(v.get<uint64_t>()); return;
    case json::value_t::number_float: {
      const double d = v.get<double>();
      out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : py_float(d);
      return;
    }
    case json::value_t::string: {
      out += '"';
      const std::string& str = v.get_ref<const std::string&>();
      for (size_t i = 0; i < str.size();) {
        if (st.ensure_ascii && static_cast<unsigned char>(str[i]) >= 0x80) {
          uint32_t cp = next_cp(str, i);
          char buf[16];
          if (cp >= 0x10000) {
            cp -= 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
          } else {
            std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
          }
          out += buf;
          continue;
        }
        const auto c = static_cast<unsigned char>(str[i++]);
        switch (c) {
          case '"': out += "\\\""; break;
          case '\\': out += "\\\\"; break;
          case '\n': out += "\\n"; break;
          case '\r': out += "\\r"; break;
          case '\t': out += "\\t"; break;
          case '\b': out += "\\b"; break;
          case '\f': out += "\\f"; break;
          default:
            if (c < 0x20) {
              char buf[8];
              std::snprintf(buf, sizeof(buf), "\\u%04x", c);
              out += buf;
            } else {
              out += static_cast<char>(c);
            }
        }
      }
      out += '"';
      return;
    }
    case json::value_t::array: {
      if (v.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < v.size(); ++i) {
        if (i) out += st.item_sep;
        nl(level + 1);
        py_json(v[i], st, level + 1, out);
      }
      nl(level);
      out += ']';
      return;
    }
    case json::value_t::object: {
      if (v.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      std::vector<std::string> keys;
      for (const auto& [k, x] : v.items()) keys.push_back(k);
      if (st.sort_keys) std::sort(keys.begin(), keys.end());
      for (size_t i = 0; i < keys.size(); ++i) {
        if (i) out += st.item_sep;
        nl(level + 1);
        py_json(json(key_json(keys[i]).is_string() ? key_json(keys[i]) : json(py_str(key_json(keys[i])))), st, level + 1, out);
        out += st.key_sep;
        py_json(v.at(keys[i]), st, level + 1, out);
      }
      nl(level);
      out += '}';
      return;
    }
    default: out += "null"; return;
  }
}

// A JSON value with its keys in order (no text round trip: strings need not be UTF-8).
json ordered(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::object: {
      json o = json::object();
      for (const auto& [k, v] : j.items()) o[k] = ordered(v);
      return o;
    }
    case nlohmann::json::value_t::array: {
      json a = json::array();
      for (const auto& v : j) a.push_back(ordered(v));
      return a;
    }
    case nlohmann::json::value_t::string: return j.get<std::string>();
    case nlohmann::json::value_t::boolean: return j.get<bool>();
    case nlohmann::json::value_t::number_integer: return j.get<int64_t>();
    case nlohmann::json::value_t::number_unsigned: return j.get<uint64_t>();
    case nlohmann::json::value_t::number_float: return j.get<double>();
    default: return nullptr;
  }
}
}  // namespace torchspeed::data::jinja
