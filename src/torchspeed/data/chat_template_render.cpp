// The chat-template interpreter's renderer: scopes, expressions, statements, macros and calls
// (chat_template_internal.h; filters, tests and methods in chat_template_builtins.cpp).
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

Value Renderer::lookup(const std::string& name) const {
  for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
    auto f = it->find(name);
    if (f != it->end()) return f->second;
  }
  static const std::set<std::string> builtins = {"range", "namespace", "raise_exception", "strftime_now", "dict",
                                                 "caller", "joiner", "cycler"};
  if (builtins.count(name)) {
    Value v;
    v.k = Value::K::kBuiltin;
    v.builtin = name;
    return v;
  }
  return {};
}

Value* Renderer::find_var(const std::string& name) {
  for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
    auto f = it->find(name);
    if (f != it->end()) return &f->second;
  }
  return nullptr;
}

void Renderer::step(int line, int64_t n) {
  steps_ += n;
  if (steps_ > kMaxSteps) fail(line, concat("rendering took more than ", kMaxSteps, " steps"));
}

const json& Renderer::need_json(const Value& v, int line, const char* what) const {
  if (v.k != Value::K::kJson) fail(line, concat(what, ": the value is ", v.undefined() ? "undefined" : "a callable"));
  return v.j;
}

Value Renderer::binary(const Node& n, const Value& a, const Value& b) {
  const std::string& op = n.name;
  if (op == "~") return Value::of(to_str(a) + to_str(b));
  if (op == "==" || op == "!=") {
    bool eq;
    if (a.undefined() || b.undefined()) eq = a.undefined() && b.undefined();
    else if (a.k != Value::K::kJson || b.k != Value::K::kJson) eq = false;
    else eq = a.j == b.j;
    return Value::of(op == "==" ? eq : !eq);
  }
  if (op == "in") {
    bool r = false;
    if (!b.undefined()) {
      const json& c = need_json(b, n.line, "'in'");
      if (c.is_string()) r = a.k == Value::K::kJson && a.j.is_string() &&
                             c.get_ref<const std::string&>().find(a.j.get_ref<const std::string&>()) != std::string::npos;
      else if (c.is_array()) r = a.k == Value::K::kJson && std::find(c.begin(), c.end(), a.j) != c.end();
      else if (c.is_object()) r = a.k == Value::K::kJson && (a.j.is_string() || a.j.is_number_integer()) && c.contains(dict_key(a.j));
      else fail(n.line, concat("'in' needs a string, list or mapping on the right, got ", c.type_name()));
    }
    return Value::of(n.negate ? !r : r);
  }
  const json& x = need_json(a, n.line, op.c_str());
  const json& y = need_json(b, n.line, op.c_str());
  if (op == "<" || op == "<=" || op == ">" || op == ">=") {
    bool r;
    if (is_num(x) && is_num(y)) {
      const double p = num(x), q = num(y);
      r = op == "<" ? p < q : op == "<=" ? p <= q : op == ">" ? p > q : p >= q;
    } else if (x.is_string() && y.is_string()) {
      const auto& p = x.get_ref<const std::string&>();
      const auto& q = y.get_ref<const std::string&>();
      r = op == "<" ? p < q : op == "<=" ? p <= q : op == ">" ? p > q : p >= q;
    } else {
      fail(n.line, concat("cannot compare ", x.type_name(), " and ", y.type_name(), " with ", op));
    }
    return Value::of(r);
  }
  if (op == "+") {
    if (x.is_string() && y.is_string()) {
      if (!a.safe && !b.safe) return Value::of(x.get<std::string>() + y.get<std::string>());
      // Markup.__add__ / __radd__: the plain operand is escaped, the result is Markup.
      Value r = Value::of((a.safe ? x.get<std::string>() : html_escape(x.get<std::string>())) +
                          (b.safe ? y.get<std::string>() : html_escape(y.get<std::string>())));
      r.safe = true;
      return r;
    }
    if (x.is_array() && y.is_array()) {
      json r = x;
      for (const auto& e : y) r.push_back(e);
      return Value::of(r);
    }
  }
  if (op == "*" && ((x.is_string() && y.is_number_integer()) || (y.is_string() && x.is_number_integer()))) {
    const std::string& s = x.is_string() ? x.get_ref<const std::string&>() : y.get_ref<const std::string&>();
    const int64_t times = x.is_string() ? y.get<int64_t>() : x.get<int64_t>();
    if (times > 0 && s.size() * static_cast<size_t>(times) > kMaxOutput) fail(n.line, "a string repeated past the output limit");
    std::string r;
    for (int64_t i = 0; i < times; ++i) r += s;
    return Value::of(r);
  }
  if (!(is_num(x) || x.is_boolean()) || !(is_num(y) || y.is_boolean())) {
    fail(n.line, concat("unsupported operand types for ", op, ": ", x.type_name(), " and ", y.type_name()));
  }
  const bool ints = (x.is_number_integer() || x.is_boolean()) && (y.is_number_integer() || y.is_boolean());
  auto as_int = [](const json& j) { return j.is_boolean() ? int64_t{j.get<bool>()} : j.get<int64_t>(); };
  auto as_dbl = [](const json& j) { return j.is_boolean() ? double{j.get<bool>() ? 1.0 : 0.0} : j.get<double>(); };
  if (ints && op != "/" && op != "**") {
    const int64_t p = as_int(x), q = as_int(y);
    // Python's integers have no bound; ours are 64 bits, and a result past them is an error.
    int64_t r = 0;
    const bool over = op == "+" ? __builtin_add_overflow(p, q, &r) : op == "-" ? __builtin_sub_overflow(p, q, &r)
                      : op == "*" ? __builtin_mul_overflow(p, q, &r) : (p == INT64_MIN && q == -1);
    if (over) fail(n.line, concat("integer overflow: ", p, " ", op, " ", q, " does not fit in 64 bits"));
    if (op == "+" || op == "-" || op == "*") return Value::of(r);
    if (q == 0) fail(n.line, "division by zero");
    if (op == "//") return Value::of(p / q - ((p % q != 0) && ((p < 0) != (q < 0)) ? 1 : 0));
    if (op == "%") {
      int64_t r = p % q;
      if (r != 0 && ((r < 0) != (q < 0))) r += q;
      return Value::of(r);
    }
  }
  const double p = as_dbl(x), q = as_dbl(y);
  if (op == "+") return Value::of(p + q);
  if (op == "-") return Value::of(p - q);
  if (op == "*") return Value::of(p * q);
  if (op == "**") {
    if (ints && as_int(y) >= 0) {
      const double v = std::pow(p, q);
      if (!(std::fabs(v) < 9.2e18)) fail(n.line, concat("integer overflow: ", as_int(x), " ** ", as_int(y), " does not fit in 64 bits"));
      return Value::of(static_cast<int64_t>(std::llround(v)));
    }
    return Value::of(std::pow(p, q));
  }
  if (q == 0) fail(n.line, "division by zero");
  if (op == "/") return Value::of(p / q);
  if (op == "//") return Value::of(std::floor(p / q));
  if (op == "%") return Value::of(p - q * std::floor(p / q));
  fail(n.line, "unknown operator " + op);
}

std::string Renderer::to_str(const Value& v) const {
  if (v.undefined()) return "";
  if (v.k != Value::K::kJson) return "<callable>";
  return py_str(v.j);
}

Value Renderer::attr(const Value& base, const std::string& name, int line) {
  if (base.k != Value::K::kJson) return {};
  const json& b = base.j;
  if (b.is_object()) {
    if (b.contains(name)) return Value::of(b.at(name));
    static const std::set<std::string> dict_methods = {"items", "keys", "values", "get"};
    if (dict_methods.count(name)) return bound("dict." + name, b);
    return {};
  }
  if (b.is_string()) {
    static const std::set<std::string> str_methods = {"strip", "lstrip", "rstrip", "split", "startswith", "endswith",
                                                      "replace", "lower", "upper", "title", "capitalize", "find",
                                                      "rfind", "count", "splitlines", "join", "format", "rsplit"};
    if (str_methods.count(name)) return bound("str." + name, b);
    return {};
  }
  if (b.is_array()) {
    if (name == "append" || name == "index" || name == "count") return bound("list." + name, b);
    // A digit attribute (x.0) indexes, as Jinja's getattr falls back to items.
    if (!name.empty() && std::all_of(name.begin(), name.end(), ::isdigit)) return item(base, Value::of(std::stoll(name)), line);
  }
  return {};
}

Value Renderer::bound(const std::string& method, const json& self) {
  Value v;
  v.k = Value::K::kBuiltin;
  v.builtin = method;
  v.j = self;
  return v;
}

Value Renderer::item(const Value& base, const Value& key, int line) {
  if (base.k != Value::K::kJson || key.k != Value::K::kJson) return {};
  const json& b = base.j;
  const json& k = key.j;
  if (b.is_object()) {
    if ((k.is_string() || k.is_number_integer()) && b.contains(dict_key(k))) return Value::of(b.at(dict_key(k)));
    if (k.is_string()) return attr(base, k.get<std::string>(), line);
    return {};
  }
  if ((b.is_array() || b.is_string()) && k.is_number_integer()) {
    int64_t i = k.get<int64_t>();
    const int64_t size = b.is_array() ? static_cast<int64_t>(b.size()) : static_cast<int64_t>(b.get_ref<const std::string&>().size());
    if (i < 0) i += size;
    if (i < 0 || i >= size) return {};
    if (b.is_array()) return Value::of(b[static_cast<size_t>(i)]);
    return Value::of(std::string(1, b.get_ref<const std::string&>()[static_cast<size_t>(i)]));
  }
  if (k.is_string()) return attr(base, k.get<std::string>(), line);
  return {};
}

Value Renderer::slice(const Value& base, const Value& lo, const Value& hi, const Value& st, int line) {
  const json& b = need_json(base, line, "slice");
  if (!b.is_array() && !b.is_string()) fail(line, concat("cannot slice a ", b.type_name()));
  const int64_t size = b.is_array() ? static_cast<int64_t>(b.size()) : static_cast<int64_t>(b.get_ref<const std::string&>().size());
  int64_t step = st.k == Value::K::kJson && !st.j.is_null() ? st.j.get<int64_t>() : 1;
  if (step == 0) fail(line, "slice step cannot be zero");
  auto norm = [&](const Value& v, int64_t dflt) {
    if (v.k != Value::K::kJson || v.j.is_null()) return dflt;
    int64_t i = v.j.get<int64_t>();
    if (i < 0) i += size;
    if (step > 0) return std::clamp<int64_t>(i, 0, size);
    return std::clamp<int64_t>(i, -1, size - 1);
  };
  const int64_t start = norm(lo, step > 0 ? 0 : size - 1), stop = norm(hi, step > 0 ? size : -1);
  json out = b.is_array() ? json::array() : json("");
  std::string s;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (b.is_array()) out.push_back(b[static_cast<size_t>(i)]);
    else s += b.get_ref<const std::string&>()[static_cast<size_t>(i)];
  }
  return Value::of(b.is_array() ? out : json(s));
}

Renderer::Args Renderer::eval_args(const Node& n, size_t first) {
  Args a;
  const size_t n_kw = n.kw_names.size();
  const size_t n_pos = n.kids.size() - first - n_kw;
  for (size_t i = 0; i < n_pos; ++i) a.pos.push_back(eval(*n.kids[first + i]));
  for (size_t i = 0; i < n_kw; ++i) a.kw[n.kw_names[i]] = eval(*n.kids[first + n_pos + i]);
  return a;
}

Value Renderer::call(const Node& n) {
  const Value f = eval(*n.kids[0]);
  Args a = eval_args(n, 1);
  return invoke(f, a, n.line);
}

Value Renderer::invoke(const Value& f, const Args& a, int line) {
  if (f.k == Value::K::kMacro) return call_macro(*f.macro, a, line, nullptr);
  if (f.k != Value::K::kBuiltin) fail(line, "the value called is not callable");
  const std::string& b = f.builtin;
  if (b.find('.') != std::string::npos) return call_method(f, a, line);
  if (b == "raise_exception") fail(line, "raise_exception: " + str_arg(a, 0, "message", line));
  if (b == "range") {
    std::vector<int64_t> v;
    for (const auto& x : a.pos) {
      if (x.k != Value::K::kJson || !x.j.is_number_integer()) fail(line, "range: arguments must be integers");
      v.push_back(x.j.get<int64_t>());
    }
    int64_t lo = 0, hi = 0, st = 1;
    if (v.size() == 1) hi = v[0];
    else if (v.size() >= 2) lo = v[0], hi = v[1];
    if (v.size() == 3) st = v[2];
    if (st == 0 || v.empty() || v.size() > 3) fail(line, "range: bad arguments");
    // In 128 bits: the span and the count of 64-bit bounds and steps do not overflow.
    const __int128 span = st > 0 ? static_cast<__int128>(hi) - lo : static_cast<__int128>(lo) - hi;
    const __int128 stride = st > 0 ? static_cast<__int128>(st) : -static_cast<__int128>(st);
    const __int128 n128 = span > 0 ? (span + stride - 1) / stride : 0;
    const int64_t count = n128 > kMaxSteps ? kMaxSteps + 1 : static_cast<int64_t>(n128);
    step(line, count);  // a list's elements cost a step each, so the step bound covers them
    json out = json::array();
    for (int64_t k = 0; k < count; ++k) out.push_back(static_cast<int64_t>(lo + static_cast<__int128>(k) * st));
    return Value::of(out);
  }
  if (b == "namespace" || b == "dict") {
    json o = json::object();
    for (const auto& [k, v] : a.kw) o[k] = v.k == Value::K::kJson ? v.j : json(nullptr);
    return Value::of(o);
  }
  if (b == "strftime_now") {
    const std::string fmt = str_arg(a, 0, "format", line);
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[256];
    const size_t len = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
    return Value::of(std::string(buf, len));
  }
  if (b == "caller") {
    if (callers_.empty()) fail(line, "caller() outside a call block");
    const auto* body = callers_.back();
    callers_.pop_back();
    std::string out;
    render_body(*body, out);
    callers_.push_back(body);
    return Value::of(out);
  }
  fail(line, "'" + b + "' cannot be called here");
}

Value Renderer::call_macro(const Macro& m, const Args& a, int line, const std::vector<NodeP>* caller_body) {
  if (++depth_ > kMaxDepth) fail(line, "macro calls nested too deeply");
  std::map<std::string, Value> scope;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const Value* v = a.get(i, m.params[i].c_str());
    if (v) scope[m.params[i]] = *v;
    else if (m.defaults[i]) scope[m.params[i]] = eval(*m.defaults[i]);
  }
  scopes_.push_back(std::move(scope));
  if (caller_body) callers_.push_back(caller_body);
  std::string out;
  render_body(m.body, out);
  if (caller_body) callers_.pop_back();
  scopes_.pop_back();
  --depth_;
  return Value::of(out);
}

Value Renderer::eval(const Node& n) {
  step(n.line);
  if (++depth_ > kMaxDepth * 2) fail(n.line, "expression evaluated too deeply");
  struct D {
    int& d;
    ~D() { --d; }
  } guard{depth_};
  switch (n.k) {
    case Node::K::kLit: return Value::of(n.lit);
    case Node::K::kName: return lookup(n.name);
    case Node::K::kList: {
      json out = json::array();
      for (const auto& k : n.kids) {
        Value v = eval(*k);
        out.push_back(v.k == Value::K::kJson ? v.j : json());
      }
      return Value::of(out);
    }
    case Node::K::kDict: {
      json out = json::object();
      for (size_t i = 0; i + 1 < n.kids.size(); i += 2) {
        Value k = eval(*n.kids[i]), v = eval(*n.kids[i + 1]);
        out[k.k == Value::K::kJson ? dict_key(k.j) : to_str(k)] = v.k == Value::K::kJson ? v.j : json();
      }
      return Value::of(out);
    }
    case Node::K::kAttr: return attr(eval(*n.kids[0]), n.name, n.line);
    case Node::K::kItem: return item(eval(*n.kids[0]), eval(*n.kids[1]), n.line);
    case Node::K::kSlice: {
      auto opt = [&](size_t i) { return n.kids[i] ? eval(*n.kids[i]) : Value(); };
      return slice(eval(*n.kids[0]), opt(1), opt(2), opt(3), n.line);
    }
    case Node::K::kCall: return call(n);
    case Node::K::kFilter: {
      Value v = eval(*n.kids[0]);
      return filter(n.name, v, eval_args(n, 1), n.line);
    }
    case Node::K::kTest: {
      Value v = eval(*n.kids[0]);
      const bool r = test(n.name, v, eval_args(n, 1), n.line);
      return Value::of(n.negate ? !r : r);
    }
    case Node::K::kUnary: {
      const Value operand = eval(*n.kids[0]);  // held: need_json returns a reference into it
      const json& j = need_json(operand, n.line, "unary -");
      if (j.is_number_integer()) {
        if (j.get<int64_t>() == INT64_MIN) fail(n.line, "integer overflow: -(-2**63) does not fit in 64 bits");
        return Value::of(-j.get<int64_t>());
      }
      if (j.is_number()) return Value::of(-j.get<double>());
      fail(n.line, concat("bad operand for unary -: ", j.type_name()));
    }
    case Node::K::kBinary: {
      Value a = eval(*n.kids[0]);
      return binary(n, a, eval(*n.kids[1]));
    }
    case Node::K::kAnd: {
      Value a = eval(*n.kids[0]);
      return truthy(a) ? eval(*n.kids[1]) : a;
    }
    case Node::K::kOr: {
      Value a = eval(*n.kids[0]);
      return truthy(a) ? a : eval(*n.kids[1]);
    }
    case Node::K::kNot: return Value::of(!truthy(eval(*n.kids[0])));
    case Node::K::kCond:
      if (truthy(eval(*n.kids[0]))) return eval(*n.kids[1]);
      return n.kids[2] ? eval(*n.kids[2]) : Value();
    default: break;
  }
  fail(n.line, "not an expression");
}

void Renderer::emit(std::string& out, const std::string& s, int line) {
  out += s;
  if (out.size() > kMaxOutput) fail(line, concat("the output passes ", kMaxOutput, " bytes"));
}

void Renderer::assign(const std::string& name, const std::string& attr_name, const Value& v, int line) {
  if (attr_name.empty()) {
    scopes_.back()[name] = v;
    return;
  }
  Value* ns = find_var(name);
  if (!ns || ns->k != Value::K::kJson || !ns->j.is_object()) fail(line, "set " + name + "." + attr_name + ": " + name + " is not a namespace");
  ns->j[attr_name] = v.k == Value::K::kJson ? v.j : json();
}

void Renderer::render_body(const std::vector<NodeP>& body, std::string& out) {
  for (const auto& n : body) render(*n, out);
}

void Renderer::render(const Node& n, std::string& out) {
  step(n.line);
  switch (n.k) {
    case Node::K::kText: emit(out, n.lit.get_ref<const std::string&>(), n.line); return;
    case Node::K::kOutput: emit(out, to_str(eval(*n.kids[0])), n.line); return;
    case Node::K::kIf:
      for (size_t i = 0; i < n.kids.size(); ++i) {
        if (truthy(eval(*n.kids[i]))) {
          render_body(n.bodies[i], out);
          return;
        }
      }
      if (n.bodies.size() > n.kids.size()) render_body(n.bodies.back(), out);
      return;
    case Node::K::kFor: {
      const Value it = eval(*n.kids[0]);
      json items = list_of(it, n.line, "for");
      if (n.kids[1]) {  // the loop filter, with the loop variables bound
        json kept = json::array();
        for (const auto& x : items) {
          scopes_.emplace_back();
          bind_targets(n, x);
          if (truthy(eval(*n.kids[1]))) kept.push_back(x);
          scopes_.pop_back();
        }
        items = kept;
      }
      if (items.empty()) {
        if (n.bodies.size() > 1) render_body(n.bodies[1], out);
        return;
      }
      const int64_t len = static_cast<int64_t>(items.size());
      for (int64_t i = 0; i < len; ++i) {
        step(n.line);
        scopes_.emplace_back();
        bind_targets(n, items[static_cast<size_t>(i)]);
        json loop = {{"index", i + 1}, {"index0", i}, {"revindex", len - i}, {"revindex0", len - i - 1},
                     {"first", i == 0}, {"last", i == len - 1}, {"length", len}, {"depth", 1}, {"depth0", 0}};
        if (i > 0) loop["previtem"] = items[static_cast<size_t>(i - 1)];
        if (i + 1 < len) loop["nextitem"] = items[static_cast<size_t>(i + 1)];
        scopes_.back()["loop"] = Value::of(loop);
        bool stop = false;
        try {
          render_body(n.bodies[0], out);
        } catch (const BreakSignal&) {
          stop = true;
        } catch (const ContinueSignal&) {
        }
        scopes_.pop_back();
        if (stop) break;
      }
      return;
    }
    case Node::K::kSet: {
      Value v = eval(*n.kids[0]);
      if (n.targets.size() == 1) {
        assign(n.targets[0], n.name, v, n.line);
      } else {
        const json l = list_of(v, n.line, "set");
        if (l.size() != n.targets.size()) fail(n.line, "set: wrong number of values to unpack");
        for (size_t i = 0; i < l.size(); ++i) assign(n.targets[i], "", Value::of(l[i]), n.line);
      }
      return;
    }
    case Node::K::kSetBlock: {
      std::string s;
      render_body(n.bodies[0], s);
      Value v = Value::of(s);
      if (!n.kids.empty()) v = filter(n.kids[0]->name, v, eval_args(*n.kids[0], 0), n.line);
      assign(n.targets[0], n.name, v, n.line);
      return;
    }
    case Node::K::kMacro: {
      Value v;
      v.k = Value::K::kMacro;
      v.macro = n.macro;
      scopes_.back()[n.name] = v;
      return;
    }
    case Node::K::kCallBlock: {
      const Node& c = *n.kids[0];
      if (c.k != Node::K::kCall) fail(n.line, "call block: expected a macro call");
      const Value f = eval(*c.kids[0]);
      if (f.k != Value::K::kMacro) fail(n.line, "call block: not a macro");
      emit(out, to_str(call_macro(*f.macro, eval_args(c, 1), n.line, &n.bodies[0])), n.line);
      return;
    }
    case Node::K::kFilterBlock: {
      std::string s;
      render_body(n.bodies[0], s);
      emit(out, to_str(filter(n.kids[0]->name, Value::of(s), eval_args(*n.kids[0], 0), n.line)), n.line);
      return;
    }
    case Node::K::kBreak: throw BreakSignal{};
    case Node::K::kContinue: throw ContinueSignal{};
    default: fail(n.line, "not a statement");
  }
}

void Renderer::bind_targets(const Node& n, const json& x) {
  if (n.targets.size() == 1) {
    scopes_.back()[n.targets[0]] = Value::of(x);
    return;
  }
  if (!x.is_array() || x.size() != n.targets.size()) fail(n.line, "for: cannot unpack the item into " + std::to_string(n.targets.size()) + " names");
  for (size_t i = 0; i < n.targets.size(); ++i) scopes_.back()[n.targets[i]] = Value::of(x[i]);
}
}  // namespace torchspeed::data::jinja
