// The chat-template interpreter's builtins: jinja2's filters and tests, and the str / dict / list
// methods templates call (chat_template_internal.h).
#include <algorithm>
#include <climits>
#include <charconv>
#include <cmath>
#include <ctime>
#include <functional>
#include <map>
#include <set>

#include "torchspeed/data/chat_template_internal.h"
#include "torchspeed/base/error.h"

namespace torchspeed::data::jinja {

std::string Renderer::str_arg(const Args& a, size_t i, const char* name, int line, const std::string& dflt) {
  const Value* v = a.get(i, name);
  if (!v || v->undefined() || (v->k == Value::K::kJson && v->j.is_null())) return dflt;
  return to_str(*v);
}

std::string Renderer::strip(const std::string& s, const std::string& chars, bool left, bool right) {
  size_t b = 0, e = s.size();
  auto in = [&](char c) { return chars.empty() ? space(c) : chars.find(c) != std::string::npos; };
  if (left) while (b < e && in(s[b])) ++b;
  if (right) while (e > b && in(s[e - 1])) --e;
  return s.substr(b, e - b);
}

Value Renderer::call_method(const Value& f, const Args& a, int line) {
  const std::string& m = f.builtin;
  const json& self = f.j;
  if (m.rfind("str.", 0) == 0) {
    const std::string& s = self.get_ref<const std::string&>();
    const std::string name = m.substr(4);
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      return Value::of(strip(s, str_arg(a, 0, "chars", line), name != "rstrip", name != "lstrip"));
    }
    if (name == "lower" || name == "upper") {
      std::string r = s;
      for (char& c : r) c = static_cast<char>(name == "lower" ? std::tolower(static_cast<unsigned char>(c)) : std::toupper(static_cast<unsigned char>(c)));
      return Value::of(r);
    }
    if (name == "title" || name == "capitalize") return filter("title" == name ? "title" : "capitalize", Value::of(s), {}, line);
    if (name == "startswith" || name == "endswith") {
      const Value* v = a.get(0, "prefix");
      std::vector<std::string> opts;
      if (v && v->k == Value::K::kJson && v->j.is_array()) {
        for (const auto& e : v->j) opts.push_back(py_str(e));
      } else {
        opts.push_back(str_arg(a, 0, "prefix", line));
      }
      bool r = false;
      for (const auto& o : opts) {
        r = r || (name == "startswith" ? s.rfind(o, 0) == 0 : s.size() >= o.size() && s.compare(s.size() - o.size(), o.size(), o) == 0);
      }
      return Value::of(r);
    }
    if (name == "split" || name == "rsplit") {
      const std::string sep = str_arg(a, 0, "sep", line);
      const Value* mx = a.get(1, "maxsplit");
      int64_t maxsplit = mx && mx->k == Value::K::kJson && mx->j.is_number_integer() ? mx->j.get<int64_t>() : -1;
      json out = json::array();
      if (sep.empty()) {
        size_t i = 0;
        while (i < s.size()) {
          while (i < s.size() && space(s[i])) ++i;
          if (i >= s.size()) break;
          size_t j = i;
          if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) j = s.size();
          else while (j < s.size() && !space(s[j])) ++j;
          out.push_back(maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit ? strip(s.substr(i), "", false, true) : s.substr(i, j - i));
          i = j;
        }
        return Value::of(out);
      }
      size_t i = 0;
      for (;;) {
        const size_t j = s.find(sep, i);
        if (j == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit)) {
          out.push_back(s.substr(i));
          break;
        }
        out.push_back(s.substr(i, j - i));
        i = j + sep.size();
      }
      return Value::of(out);
    }
    if (name == "splitlines") {
      json out = json::array();
      size_t i = 0;
      while (i < s.size()) {
        size_t j = s.find('\n', i);
        if (j == std::string::npos) j = s.size();
        std::string l = s.substr(i, j - i);
        if (!l.empty() && l.back() == '\r') l.pop_back();
        out.push_back(l);
        i = j + 1;
      }
      return Value::of(out);
    }
    if (name == "replace") {
      const std::string from = str_arg(a, 0, "old", line), to = str_arg(a, 1, "new", line);
      return Value::of(replace_all(s, from, to, line));
    }
    if (name == "find" || name == "rfind") {
      const std::string sub = str_arg(a, 0, "sub", line);
      const size_t r = name == "find" ? s.find(sub) : s.rfind(sub);
      return Value::of(r == std::string::npos ? int64_t{-1} : static_cast<int64_t>(r));
    }
    if (name == "count") {
      const std::string sub = str_arg(a, 0, "sub", line);
      int64_t c = 0;
      if (!sub.empty()) for (size_t i = s.find(sub); i != std::string::npos; i = s.find(sub, i + sub.size())) ++c;
      return Value::of(c);
    }
    if (name == "join") {
      const Value* v = a.get(0, "iterable");
      std::string r;
      if (v && v->k == Value::K::kJson && v->j.is_array()) {
        for (size_t i = 0; i < v->j.size(); ++i) r += (i ? s : "") + py_str(v->j[i]);
      }
      return Value::of(r);
    }
    if (name == "format") {
      std::string r;
      size_t next = 0;
      for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '{' && i + 1 < s.size() && s[i + 1] == '}') {
          r += next < a.pos.size() ? to_str(a.pos[next++]) : "";
          ++i;
        } else {
          r += s[i];
        }
      }
      return Value::of(r);
    }
  }
  if (m.rfind("dict.", 0) == 0) {
    const std::string name = m.substr(5);
    if (name == "items") {
      json out = json::array();
      for (const auto& [k, v] : self.items()) out.push_back(json::array({key_json(k), v}));
      return Value::of(out);
    }
    if (name == "keys" || name == "values") {
      json out = json::array();
      for (const auto& [k, v] : self.items()) out.push_back(name == "keys" ? key_json(k) : v);
      return Value::of(out);
    }
    if (name == "get") {
      const std::string k = str_arg(a, 0, "key", line);
      if (self.contains(k)) return Value::of(self.at(k));
      const Value* d = a.get(1, "default");
      return d ? *d : Value::of(nullptr);
    }
  }
  if (m.rfind("list.", 0) == 0) {
    if (m == "list.append") fail(line, "list.append: templates cannot change their inputs here; build a new list with +");
    const Value* x = a.get(0, "value");
    int64_t c = 0, first = -1;
    for (size_t i = 0; i < self.size(); ++i) {
      if (x && x->k == Value::K::kJson && self[i] == x->j) {
        ++c;
        if (first < 0) first = static_cast<int64_t>(i);
      }
    }
    if (m == "list.count") return Value::of(c);
    if (first < 0) fail(line, "list.index: the value is not in the list");
    return Value::of(first);
  }
  fail(line, "unknown method " + m);
}

std::string Renderer::replace_all(const std::string& s, const std::string& from, const std::string& to, int line) {
  if (from.empty()) return s;
  std::string r;
  size_t i = 0;
  for (size_t j = s.find(from); j != std::string::npos; j = s.find(from, i)) {
    r += s.substr(i, j - i) + to;
    i = j + from.size();
    if (r.size() > kMaxOutput) fail(line, "replace: the result passes the output limit");
  }
  return r + s.substr(i);
}

bool Renderer::test(const std::string& name, const Value& v, const Args& a, int line) {
  const bool is_j = v.k == Value::K::kJson;
  const json& j = v.j;
  if (name == "defined") return !v.undefined();
  if (name == "undefined") return v.undefined();
  if (name == "none") return is_j && j.is_null();
  if (name == "string") return is_j && j.is_string();
  if (name == "number") return is_j && j.is_number();
  if (name == "integer") return is_j && j.is_number_integer();
  if (name == "float") return is_j && j.is_number_float();
  if (name == "boolean") return is_j && j.is_boolean();
  if (name == "true") return is_j && j.is_boolean() && j.get<bool>();
  if (name == "false") return is_j && j.is_boolean() && !j.get<bool>();
  if (name == "mapping") return is_j && j.is_object();
  if (name == "sequence" || name == "iterable") return is_j && (j.is_array() || j.is_string() || j.is_object());
  if (name == "callable") return v.k == Value::K::kMacro || v.k == Value::K::kBuiltin;
  if (name == "lower" || name == "upper") {
    if (!is_j || !j.is_string()) return false;
    const auto& s = j.get_ref<const std::string&>();
    return std::none_of(s.begin(), s.end(), [&](char c) { return name == "lower" ? std::isupper(static_cast<unsigned char>(c)) : std::islower(static_cast<unsigned char>(c)); });
  }
  const Value* arg = a.get(0, "value");
  if (name == "eq" || name == "equalto" || name == "==" || name == "sameas") {
    return arg && is_j && arg->k == Value::K::kJson && j == arg->j;
  }
  if (name == "ne" || name == "!=") return !(arg && is_j && arg->k == Value::K::kJson && j == arg->j);
  if (name == "in") {
    Node fake;
    fake.k = Node::K::kBinary;
    fake.name = "in";
    fake.line = line;
    return arg && truthy(binary(fake, v, *arg));
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    if (!is_j || !j.is_number_integer()) fail(line, "test '" + name + "' needs an integer");
    const int64_t x = j.get<int64_t>();
    if (name == "odd") return x % 2 != 0;
    if (name == "even") return x % 2 == 0;
    if (!arg || arg->k != Value::K::kJson || !arg->j.is_number_integer() || arg->j.get<int64_t>() == 0) fail(line, "divisibleby needs a non-zero integer");
    return x % arg->j.get<int64_t>() == 0;
  }
  if (name == "gt" || name == "ge" || name == "lt" || name == "le" || name == "greaterthan" || name == "lessthan") {
    Node fake;
    fake.k = Node::K::kBinary;
    fake.line = line;
    fake.name = name == "gt" || name == "greaterthan" ? ">" : name == "ge" ? ">=" : name == "lt" || name == "lessthan" ? "<" : "<=";
    return arg && truthy(binary(fake, v, *arg));
  }
  fail(line, "unknown test '" + name + "'");
}

json Renderer::list_of(const Value& v, int line, const char* what) {
  if (v.undefined()) return json::array();
  const json& j = need_json(v, line, what);
  if (j.is_array()) return j;
  if (j.is_object()) {
    json out = json::array();
    for (const auto& [k, x] : j.items()) out.push_back(key_json(k));
    return out;
  }
  if (j.is_string()) {
    json out = json::array();
    for (char c : j.get_ref<const std::string&>()) out.push_back(std::string(1, c));
    return out;
  }
  fail(line, concat(what, ": a ", j.type_name(), " is not iterable"));
}

json Renderer::attr_of(const json& x, const std::string& path, int line) {
  Value v = Value::of(x);
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('.', i);
    if (j == std::string::npos) j = path.size();
    v = attr(v, path.substr(i, j - i), line);
    i = j + 1;
  }
  return v.k == Value::K::kJson ? v.j : json();
}

Value Renderer::filter(const std::string& name, const Value& v, const Args& a, int line) {
  if (name == "default" || name == "d") {
    const Value* dflt = a.get(0, "default_value");
    const Value* boolean = a.get(1, "boolean");
    const bool use = v.undefined() || (boolean && truthy(*boolean) && !truthy(v));
    return use ? (dflt ? *dflt : Value::of("")) : v;
  }
  if (name == "safe") {
    Value r = v.k == Value::K::kJson && v.j.is_string() ? v : Value::of(to_str(v));
    r.safe = true;
    return r;
  }
  if (name == "string" && v.k == Value::K::kJson && v.j.is_string()) return v;
  if (name == "dictsort") {  // (key, value) pairs sorted by key (case-insensitive) or value
    const json& j = need_json(v, line, "dictsort");
    if (!j.is_object()) fail(line, concat("dictsort of a ", j.type_name()));
    const Value* cs = a.get(0, "case_sensitive");
    const std::string by = str_arg(a, 1, "by", line, "key");
    const Value* rev = a.get(2, "reverse");
    const bool sensitive = cs && truthy(*cs);
    std::vector<std::pair<std::string, json>> items;
    for (const auto& [k, x] : j.items()) items.emplace_back(k, x);
    auto fold = [&](const json& x) {
      if (!x.is_string() || sensitive) return x;
      std::string s = x.get<std::string>();
      for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return json(s);
    };
    std::stable_sort(items.begin(), items.end(), [&](const auto& p, const auto& q) {
      return by == "value" ? fold(p.second) < fold(q.second) : fold(key_json(p.first)) < fold(key_json(q.first));
    });
    if (rev && truthy(*rev)) std::reverse(items.begin(), items.end());
    json out = json::array();
    for (const auto& [k, x] : items) out.push_back(json::array({key_json(k), x}));
    return Value::of(out);
  }
  if (name == "string") return Value::of(to_str(v));
  if (name == "trim") return Value::of(strip(to_str(v), str_arg(a, 0, "chars", line), true, true));
  if (name == "upper" || name == "lower") {
    std::string r = to_str(v);
    for (char& c : r) c = static_cast<char>(name == "lower" ? std::tolower(static_cast<unsigned char>(c)) : std::toupper(static_cast<unsigned char>(c)));
    return Value::of(r);
  }
  if (name == "capitalize" || name == "title") {
    std::string r = to_str(v);
    bool start = true;
    for (size_t i = 0; i < r.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(r[i]);
      if (name == "capitalize") r[i] = static_cast<char>(i == 0 ? std::toupper(c) : std::tolower(c));
      else {
        r[i] = static_cast<char>(start ? std::toupper(c) : std::tolower(c));
        start = !std::isalnum(c);
      }
    }
    return Value::of(r);
  }
  if (name == "length" || name == "count") {
    if (v.undefined()) return Value::of(0);
    const json& j = need_json(v, line, "length");
    if (j.is_string()) {
      int64_t n = 0;  // code points, as Python's len
      for (unsigned char c : j.get_ref<const std::string&>()) n += (c & 0xC0) != 0x80;
      return Value::of(n);
    }
    if (j.is_array() || j.is_object()) return Value::of(static_cast<int64_t>(j.size()));
    fail(line, concat("length of a ", j.type_name()));
  }
  if (name == "first" || name == "last") {
    const json l = list_of(v, line, name.c_str());
    if (l.empty()) return {};
    return Value::of(name == "first" ? l.front() : l.back());
  }
  if (name == "join") {
    const json l = list_of(v, line, "join");
    const std::string sep = str_arg(a, 0, "d", line);
    const std::string at = str_arg(a, 1, "attribute", line);
    std::string r;
    for (size_t i = 0; i < l.size(); ++i) r += (i ? sep : "") + py_str(at.empty() ? l[i] : attr_of(l[i], at, line));
    return Value::of(r);
  }
  if (name == "tojson") {  // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
    const Value* ea = a.get(0, "ensure_ascii");
    const Value* ind = a.get(1, "indent");
    const Value* sep = a.get(2, "separators");
    const Value* sk = a.get(3, "sort_keys");
    const int indent = ind && ind->k == Value::K::kJson && ind->j.is_number_integer() ? static_cast<int>(ind->j.get<int64_t>()) : -1;
    JsonStyle st;
    st.indent = indent;
    st.sort_keys = sk && truthy(*sk);
    st.ensure_ascii = ea && truthy(*ea);
    st.item_sep = indent >= 0 ? "," : ", ";
    if (sep && sep->k == Value::K::kJson && sep->j.is_array() && sep->j.size() == 2) {
      st.item_sep = py_str(sep->j[0]);
      st.key_sep = py_str(sep->j[1]);
    }
    if (v.undefined()) fail(line, "tojson of an undefined value");
    std::string out;
    py_json(need_json(v, line, "tojson"), st, 0, out);
    return Value::of(out);
  }
  if (name == "list") return Value::of(list_of(v, line, "list"));
  if (name == "items") {
    const json& j = need_json(v, line, "items");
    json out = json::array();
    if (j.is_object()) for (const auto& [k, x] : j.items()) out.push_back(json::array({key_json(k), x}));
    return Value::of(out);
  }
  if (name == "int" || name == "float") {
    const json& j = v.k == Value::K::kJson ? v.j : json(0);
    double d = 0;
    if (j.is_number()) d = j.get<double>();
    else if (j.is_boolean()) d = j.get<bool>();
    else if (j.is_string()) {
      try {
        d = std::stod(j.get<std::string>());
      } catch (const std::exception&) {
        d = 0;
      }
    }
    if (name == "int") {
      if (j.is_number_integer()) return Value::of(j.get<int64_t>());
      if (!(std::fabs(d) < 9.2e18)) fail(line, concat("int: ", d, " does not fit in 64 bits"));  // also NaN
      return Value::of(static_cast<int64_t>(d));
    }
    return Value::of(d);
  }
  if (name == "abs") {
    const json& j = need_json(v, line, "abs");
    if (j.is_number_integer()) {
      if (j.get<int64_t>() == INT64_MIN) fail(line, "integer overflow: abs(-2**63) does not fit in 64 bits");
      return Value::of(std::llabs(j.get<int64_t>()));
    }
    return Value::of(std::fabs(j.get<double>()));
  }
  if (name == "round") {
    const json& j = need_json(v, line, "round");
    const Value* pr = a.get(0, "precision");
    const int64_t p = pr && pr->k == Value::K::kJson ? pr->j.get<int64_t>() : 0;
    const double s = std::pow(10.0, static_cast<double>(p));
    return Value::of(std::round(j.get<double>() * s) / s);
  }
  if (name == "replace") {
    return Value::of(replace_all(to_str(v), str_arg(a, 0, "old", line), str_arg(a, 1, "new", line), line));
  }
  if (name == "reverse") {
    if (v.k == Value::K::kJson && v.j.is_string()) {
      std::string s = v.j.get<std::string>();
      std::reverse(s.begin(), s.end());
      return Value::of(s);
    }
    json l = list_of(v, line, "reverse");
    std::reverse(l.begin(), l.end());
    return Value::of(l);
  }
  if (name == "unique") {
    json out = json::array();
    for (const auto& x : list_of(v, line, "unique")) {
      if (std::find(out.begin(), out.end(), x) == out.end()) out.push_back(x);
    }
    return Value::of(out);
  }
  if (name == "sort") {
    json l = list_of(v, line, "sort");
    const std::string at = str_arg(a, 2, "attribute", line);
    const Value* rev = a.get(0, "reverse");
    std::vector<json> items(l.begin(), l.end());
    std::stable_sort(items.begin(), items.end(), [&](const json& x, const json& y) {
      return at.empty() ? x < y : attr_of(x, at, line) < attr_of(y, at, line);
    });
    if (rev && truthy(*rev)) std::reverse(items.begin(), items.end());
    return Value::of(json(items));
  }
  if (name == "map") {
    const json l = truthy(v) ? list_of(v, line, "map") : json::array();  // jinja2: "if value:"
    json out = json::array();
    if (auto it = a.kw.find("attribute"); it != a.kw.end()) {
      for (const auto& x : l) out.push_back(attr_of(x, to_str(it->second), line));
      return Value::of(out);
    }
    const std::string f = str_arg(a, 0, "filter", line);
    Args rest;
    rest.pos.assign(a.pos.size() > 1 ? a.pos.begin() + 1 : a.pos.end(), a.pos.end());
    for (const auto& x : l) {
      Value r = filter(f, Value::of(x), rest, line);
      out.push_back(r.k == Value::K::kJson ? r.j : json());
    }
    return Value::of(out);
  }
  if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
    const json l = truthy(v) ? list_of(v, line, name.c_str()) : json::array();  // jinja2: "if value:"
    const bool by_attr = name == "selectattr" || name == "rejectattr";
    const bool keep = name == "selectattr" || name == "select";
    const size_t t0 = by_attr ? 1 : 0;
    const std::string at = by_attr ? str_arg(a, 0, "attribute", line) : "";
    const std::string tname = a.pos.size() > t0 ? to_str(a.pos[t0]) : "";
    Args targs;
    if (a.pos.size() > t0 + 1) targs.pos.assign(a.pos.begin() + static_cast<long>(t0) + 1, a.pos.end());
    json out = json::array();
    for (const auto& x : l) {
      Value item_v = Value::of(x);
      if (by_attr) {
        item_v = Value::of(x);
        Value got = x.is_object() && x.contains(at) ? Value::of(x.at(at)) : attr(Value::of(x), at, line);
        item_v = got;
      }
      const bool pass = tname.empty() ? truthy(item_v) : test(tname, item_v, targs, line);
      if (pass == keep) out.push_back(x);
    }
    return Value::of(out);
  }
  if (name == "sum") {
    double s = 0;
    int64_t si = 0;
    bool ints = true;
    for (const auto& x : list_of(v, line, "sum")) {
      ints = ints && x.is_number_integer();
      s += x.is_number() ? x.get<double>() : 0;
      if (ints && __builtin_add_overflow(si, x.get<int64_t>(), &si)) fail(line, "integer overflow: sum past 64 bits");
    }
    return ints ? Value::of(si) : Value::of(s);
  }
  if (name == "max" || name == "min") {
    const json l = list_of(v, line, name.c_str());
    if (l.empty()) return {};
    json best = l[0];
    for (const auto& x : l) if (name == "max" ? best < x : x < best) best = x;
    return Value::of(best);
  }
  if (name == "indent") {
    const Value* w = a.get(0, "width");
    std::string pad = w && w->k == Value::K::kJson && w->j.is_string() ? w->j.get<std::string>()
                                                                        : std::string(static_cast<size_t>(w && w->k == Value::K::kJson ? w->j.get<int64_t>() : 4), ' ');
    const Value* first = a.get(1, "first");
    const Value* blank = a.get(2, "blank");
    const std::string s = to_str(v);
    std::string r;
    size_t i = 0;
    bool first_line = true;
    while (i <= s.size()) {
      size_t j = s.find('\n', i);
      const bool last = j == std::string::npos;
      if (last) j = s.size();
      const std::string l = s.substr(i, j - i);
      const bool ind = (first_line ? (first && truthy(*first)) : true) && (!l.empty() || (blank && truthy(*blank)));
      r += (ind ? pad : "") + l + (last ? "" : "\n");
      first_line = false;
      if (last) break;
      i = j + 1;
    }
    return Value::of(r);
  }
  if (name == "e" || name == "escape") {
    if (v.safe) return v;
    Value r = Value::of(html_escape(to_str(v)));
    r.safe = true;
    return r;
  }
  if (name == "wordcount") {
    int64_t n = 0;
    bool in = false;
    for (char c : to_str(v)) {
      if (space(c)) in = false;
      else if (!in) ++n, in = true;
    }
    return Value::of(n);
  }
  fail(line, "unknown filter '" + name + "'");
}
}  // namespace torchspeed::data::jinja
