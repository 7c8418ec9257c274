// Grammars from JSON Schemas, choices and regular expressions (Note [Structured output] in
// structured.cpp says how they are matched).
#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "torchspeed/inference/structured.h"
#include "torchspeed/inference/structured_regex.h"

namespace torchspeed::inference {

namespace {
using Kind = Grammar::Kind;
using Node = Grammar::Node;

// ----- building grammars

struct Builder {
  Grammar g;
  const nlohmann::ordered_json* root_schema = nullptr;
  std::map<std::string, int32_t> refs;
  int32_t any_value = -1;

  int32_t add(Node n) {
    g.nodes.push_back(std::move(n));
    return static_cast<int32_t>(g.nodes.size() - 1);
  }
  int32_t literal(std::string text) {
    Node n;
    n.kind = Kind::kLiteral;
    n.text = std::move(text);
    return add(std::move(n));
  }
  int32_t alt(std::vector<int32_t> kids) {
    if (kids.size() == 1) return kids[0];
    Node n;
    n.kind = Kind::kAlt;
    n.kids = std::move(kids);
    return add(std::move(n));
  }
  int32_t string(int64_t min = 0, int64_t max = -1) {
    Node n;
    n.kind = Kind::kString;
    n.min = min;
    n.max = max;
    return add(std::move(n));
  }
  int32_t regex(const std::string& pattern, bool json_string, const std::string& path) {
    try {
      g.dfas.push_back(detail::compile_regex(pattern, json_string));
    } catch (const GrammarError& e) {
      refuse(path, e.what());
    }
    Node n;
    n.kind = Kind::kRegex;
    n.dfa = static_cast<int32_t>(g.dfas.size() - 1);
    return add(std::move(n));
  }
  int32_t number(bool integer) {
    Node n;
    n.kind = Kind::kNumber;
    n.integer = integer;
    return add(std::move(n));
  }
  int32_t key_string() {
    if (g.key_string < 0) g.key_string = string();
    return g.key_string;
  }
  int32_t free_object(int32_t value) {
    key_string();
    Node n;
    n.kind = Kind::kObject;
    n.free_keys = true;
    n.kids = {value};
    return add(std::move(n));
  }
  int32_t array(int32_t item, int64_t min = 0, int64_t max = -1) {
    Node n;
    n.kind = Kind::kArray;
    n.kids = {item};
    n.min = min;
    n.max = max;
    return add(std::move(n));
  }
  // Any JSON value (recursive: objects and arrays of any values).
  int32_t any() {
    if (any_value >= 0) return any_value;
    any_value = add(Node{});  // filled below: an alternative
    const int32_t obj = free_object(any_value), arr = array(any_value);
    Node n;
    n.kind = Kind::kAlt;
    n.kids = {obj, arr, string(), number(false), literal("true"), literal("false"), literal("null")};
    g.nodes[static_cast<size_t>(any_value)] = std::move(n);
    return any_value;
  }
  int32_t finish(int32_t value) {
    Node r;
    r.kind = Kind::kRoot;
    r.kids = {value};
    g.root = add(std::move(r));
    return g.root;
  }

  [[noreturn]] static void refuse(const std::string& path, const std::string& what) { throw GrammarError(path, what); }
  static std::string join(const std::string& path, const std::string& key) { return path.empty() ? key : path + "." + key; }

  static int64_t count(const nlohmann::ordered_json& s, const char* k, const std::string& path) {
    if (!s.contains(k)) return -1;
    const auto& v = s.at(k);
    if (!v.is_number_integer() || v.get<int64_t>() < 0) refuse(join(path, k), "expected a non-negative integer");
    return v.get<int64_t>();
  }

  int32_t compile(const nlohmann::ordered_json& s, const std::string& path, int depth) {
    if (depth > 64) refuse(path, "nests deeper than 64 schemas");
    if (s.is_boolean()) {
      if (!s.get<bool>()) refuse(path, "false admits no value");
      return any();
    }
    if (!s.is_object()) refuse(path, "a schema must be an object or a boolean");
    static const std::set<std::string> annotations{"title", "description", "default", "examples", "$schema", "$id",
                                                   "$comment", "deprecated", "readOnly", "writeOnly", "$defs",
                                                   "definitions"};
    static const std::set<std::string> known{"type", "properties", "required", "additionalProperties", "items",
                                             "minItems", "maxItems", "minLength", "maxLength", "pattern", "enum", "const",
                                             "anyOf", "oneOf", "allOf", "$ref"};
    for (const auto& [k, v] : s.items()) {
      if (!annotations.count(k) && !known.count(k)) refuse(join(path, k), "this keyword is not supported");
    }
    if (s.contains("$ref")) {
      if (s.size() > 1) {
        for (const auto& [k, v] : s.items()) {
          if (k != "$ref" && !annotations.count(k)) refuse(join(path, k), "beside $ref only annotations are supported");
        }
      }
      return ref(s.at("$ref"), join(path, "$ref"), depth);
    }
    if (s.contains("const")) return literal(s.at("const").dump());
    if (s.contains("enum")) {
      const auto& e = s.at("enum");
      if (!e.is_array() || e.empty()) refuse(join(path, "enum"), "expected a non-empty list");
      std::vector<int32_t> kids;
      for (const auto& v : e) kids.push_back(literal(v.dump()));
      return alt(kids);
    }
    for (const char* k : {"anyOf", "oneOf"}) {
      if (!s.contains(k)) continue;
      const auto& list = s.at(k);
      if (!list.is_array() || list.empty()) refuse(join(path, k), "expected a non-empty list of schemas");
      std::vector<int32_t> kids;
      for (size_t i = 0; i < list.size(); ++i) kids.push_back(compile(list[i], join(path, k) + "[" + std::to_string(i) + "]", depth + 1));
      return alt(kids);
    }
    if (s.contains("allOf")) {
      const auto& list = s.at("allOf");
      if (!list.is_array() || list.size() != 1) refuse(join(path, "allOf"), "only a list of one schema is supported");
      return compile(list[0], join(path, "allOf") + "[0]", depth + 1);
    }
    if (!s.contains("type")) {
      if (s.contains("properties")) return object(s, path, depth);
      if (s.contains("items")) return array_of(s, path, depth);
      return any();
    }
    const auto& t = s.at("type");
    if (t.is_array()) {
      if (t.empty()) refuse(join(path, "type"), "expected a type or a non-empty list of types");
      std::vector<int32_t> kids;
      for (const auto& one : t) kids.push_back(typed(s, one, path, depth));
      return alt(kids);
    }
    return typed(s, t, path, depth);
  }

  int32_t typed(const nlohmann::ordered_json& s, const nlohmann::ordered_json& t, const std::string& path, int depth) {
    if (!t.is_string()) refuse(join(path, "type"), "expected a type name");
    const std::string name = t.get<std::string>();
    if (name == "string") {
      if (s.contains("pattern")) {
        // JSON Schema's pattern is a search: unanchored ends match anything.
        if (!s.at("pattern").is_string()) refuse(join(path, "pattern"), "expected a string");
        if (s.contains("minLength") || s.contains("maxLength")) refuse(join(path, "pattern"), "pattern with minLength or maxLength is not supported");
        std::string p = s.at("pattern").get<std::string>();
        const bool head = !p.empty() && p[0] == '^';
        const bool tail = p.size() > 1 && p.back() == '$' && p[p.size() - 2] != '\\';
        if (head) p = p.substr(1);
        if (tail) p.pop_back();
        p = (head ? "" : ".*") + std::string("(?:") + p + ")" + (tail ? "" : ".*");
        return regex(p, /*json_string=*/true, join(path, "pattern"));
      }
      return string(std::max<int64_t>(0, count(s, "minLength", path)), count(s, "maxLength", path));
    }
    if (name == "integer") return number(true);
    if (name == "number") return number(false);
    if (name == "boolean") return alt({literal("true"), literal("false")});
    if (name == "null") return literal("null");
    if (name == "object") return object(s, path, depth);
    if (name == "array") return array_of(s, path, depth);
    refuse(join(path, "type"), "unknown type \"" + name + "\"");
  }

  int32_t object(const nlohmann::ordered_json& s, const std::string& path, int depth) {
    std::set<std::string> required;
    if (s.contains("required")) {
      const auto& r = s.at("required");
      if (!r.is_array()) refuse(join(path, "required"), "expected a list of property names");
      for (const auto& x : r) {
        if (!x.is_string()) refuse(join(path, "required"), "expected property names");
        required.insert(x.get<std::string>());
      }
    }
    if (s.contains("additionalProperties")) {
      const auto& a = s.at("additionalProperties");
      if (!a.is_boolean() && !a.is_object()) refuse(join(path, "additionalProperties"), "expected a boolean or a schema");
    }
    if (!s.contains("properties")) {
      if (!required.empty()) refuse(join(path, "required"), "names properties the schema does not list");
      // Free keys; values as additionalProperties says (absent or true: any).
      const auto* a = s.contains("additionalProperties") ? &s.at("additionalProperties") : nullptr;
      if (a && a->is_boolean() && !a->get<bool>()) return literal("{}");
      const int32_t value = a && a->is_object() ? compile(*a, join(path, "additionalProperties"), depth + 1) : any();
      return free_object(value);
    }
    const auto& props = s.at("properties");
    if (!props.is_object()) refuse(join(path, "properties"), "expected an object of schemas");
    Node n;
    n.kind = Kind::kObject;
    for (const auto& [name, sub] : props.items()) {
      n.keys.push_back(literal(nlohmann::json(name).dump() + ":"));
      n.kids.push_back(compile(sub, join(join(path, "properties"), name), depth + 1));
      n.required.push_back(required.count(name) ? 1 : 0);
      required.erase(name);
    }
    if (!required.empty()) refuse(join(path, "required"), "names \"" + *required.begin() + "\", which properties does not list");
    return add(std::move(n));
  }

  int32_t array_of(const nlohmann::ordered_json& s, const std::string& path, int depth) {
    const int32_t item = s.contains("items") ? compile(s.at("items"), join(path, "items"), depth + 1) : any();
    const int64_t lo = std::max<int64_t>(0, count(s, "minItems", path)), hi = count(s, "maxItems", path);
    if (hi >= 0 && hi < lo) refuse(join(path, "maxItems"), "is less than minItems");
    return array(item, lo, hi);
  }

  int32_t ref(const nlohmann::ordered_json& r, const std::string& path, int depth) {
    if (!r.is_string()) refuse(path, "expected a string");
    const std::string target = r.get<std::string>();
    auto it = refs.find(target);
    if (it != refs.end()) return it->second;
    std::string section, name;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      if (target.rfind(prefix, 0) == 0) {
        section = std::string(prefix).substr(2, std::strlen(prefix) - 3);
        name = target.substr(std::strlen(prefix));
      }
    }
    if (target == "#") {
      section.clear();
    } else if (section.empty() || name.empty() || name.find('/') != std::string::npos) {
      refuse(path, "only \"#\" and references into #/$defs/ or #/definitions/ are supported, got \"" + target + "\"");
    }
    const nlohmann::ordered_json* sub = root_schema;
    if (!section.empty()) {
      if (!root_schema->contains(section) || !root_schema->at(section).contains(name)) {
        refuse(path, "\"" + target + "\" names no schema");
      }
      sub = &root_schema->at(section).at(name);
    }
    // A placeholder first, so a schema that refers to itself refers to this node.
    const int32_t id = add(Node{});
    refs[target] = id;
    const int32_t body = compile(*sub, section.empty() ? "" : section + "." + name, depth + 1);
    Node n;
    n.kind = Kind::kAlt;
    n.kids = {body};
    g.nodes[static_cast<size_t>(id)] = std::move(n);
    return id;
  }
};

std::shared_ptr<const Grammar> done_grammar(Builder& b, int32_t value) {
  // An alternative that reaches itself through alternatives alone ({"anyOf": [{"$ref": "#"}]})
  // admits no text (it would have to begin with itself): refused.
  const auto& nodes = b.g.nodes;
  for (size_t start = 0; start < nodes.size(); ++start) {
    if (nodes[start].kind != Kind::kAlt) continue;
    std::vector<int32_t> todo(nodes[start].kids.begin(), nodes[start].kids.end());
    std::vector<uint8_t> seen(nodes.size(), 0);
    while (!todo.empty()) {
      const auto k = static_cast<size_t>(todo.back());
      todo.pop_back();
      if (k == start) Builder::refuse("$ref", "the schema refers to itself with no object or array in between");
      if (seen[k] || nodes[k].kind != Kind::kAlt) continue;
      seen[k] = 1;
      todo.insert(todo.end(), nodes[k].kids.begin(), nodes[k].kids.end());
    }
  }
  b.finish(value);
  return std::make_shared<const Grammar>(std::move(b.g));
}
}  // namespace

std::shared_ptr<const Grammar> Grammar::json_schema(const nlohmann::ordered_json& schema) {
  Builder b;
  b.root_schema = &schema;
  const int32_t value = b.compile(schema, "", 0);
  return done_grammar(b, value);
}

std::shared_ptr<const Grammar> Grammar::json_object() {
  Builder b;
  return done_grammar(b, b.free_object(b.any()));
}

std::shared_ptr<const Grammar> Grammar::regex(const std::string& pattern) {
  Builder b;
  return done_grammar(b, b.regex(pattern, /*json_string=*/false, ""));
}

std::shared_ptr<const Grammar> Grammar::choice(const std::vector<std::string>& options) {
  Builder b;
  std::vector<int32_t> kids;
  for (const auto& o : options) {
    if (o.empty()) Builder::refuse("choice", "an option must not be empty");
    kids.push_back(b.literal(o));
  }
  if (kids.empty()) Builder::refuse("choice", "expected at least one option");
  return done_grammar(b, b.alt(kids));
}


}  // namespace torchspeed::inference
