// JSON schemas compiled into the matcher's nodes (json_schema.h); the matcher is in
// json_matcher.cpp.
#include "server/json_schema.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <set>

namespace recur::server {

namespace {

// Keywords that constrain values in ways the matcher does not follow: refused by name, since
// ignoring one would let through text the client's schema forbids. Other keywords the compiler
// does not read are annotations (title, description, default, format, ...) or unknown, and are
// ignored, as JSON Schema asks.
const std::set<std::string_view> kUnsupported = {"pattern",
                                                 "minimum",
                                                 "maximum",
                                                 "exclusiveMinimum",
                                                 "exclusiveMaximum",
                                                 "multipleOf",
                                                 "allOf",
                                                 "not",
                                                 "if",
                                                 "then",
                                                 "else",
                                                 "prefixItems",
                                                 "contains",
                                                 "minContains",
                                                 "maxContains",
                                                 "uniqueItems",
                                                 "patternProperties",
                                                 "propertyNames",
                                                 "minProperties",
                                                 "maxProperties",
                                                 "dependentRequired",
                                                 "dependentSchemas",
                                                 "unevaluatedProperties",
                                                 "unevaluatedItems",
                                                 "dependencies",
                                                 "additionalItems",
                                                 "$dynamicRef",
                                                 "$recursiveRef"};

// Whether a JSON Schema type name admits v (an integer may be written 1.0).
bool type_admits(const std::string& type, const ojson& v) {
  if (type == "integer") {
    return v.is_number_integer() ||
           (v.is_number_float() && std::nearbyint(v.get<double>()) == v.get<double>());
  }
  if (type == "number") return v.is_number();
  if (type == "string") return v.is_string();
  if (type == "boolean") return v.is_boolean();
  if (type == "null") return v.is_null();
  if (type == "object") return v.is_object();
  return type == "array" && v.is_array();
}

// The JSON text of a string without its quotes, as a property name is written.
std::string name_text(const std::string& name) {
  const std::string dumped = ojson(name).dump();
  return dumped.substr(1, dumped.size() - 2);
}

class Compiler {
 public:
  Compiler(const ojson& root, std::string field) : root_(root), field_(std::move(field)) {}

  ApiResult<int> compile(const ojson& s, const std::string& path) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return any();
      return fail(path, "the schema 'false' accepts nothing");
    }
    if (!s.is_object()) return fail(path, "a schema must be an object or a boolean");
    for (const auto& [key, value] : s.items()) {
      if (kUnsupported.count(key)) {
        return fail(path, fmt::format("'{}' is not supported in structured outputs", key));
      }
    }
    if (const ojson* ref = field(s, "$ref")) return compile_ref(*ref, path);
    if (field(s, "enum") || s.contains("const")) return enumerated(s, path);
    for (const char* key : {"anyOf", "oneOf"}) {
      if (const ojson* options = field(s, key)) return any_of(*options, path + "." + key);
    }
    const ojson* type = field(s, "type");
    if (!type) {
      if (field(s, "properties") || field(s, "additionalProperties") || field(s, "required")) {
        return typed(s, "object", path);
      }
      if (field(s, "items")) return typed(s, "array", path);
      return any();
    }
    if (type->is_string()) return typed(s, type->get<std::string>(), path);
    if (!type->is_array() || type->empty()) {
      return fail(path + ".type", "'type' must be a type name or a list of them");
    }
    std::vector<int> options;
    for (const ojson& t : *type) {
      if (!t.is_string()) return fail(path + ".type", "'type' lists type names");
      RECUR_API_ASSIGN(const int n, typed(s, t.get<std::string>(), path));
      options.push_back(n);
    }
    if (options.size() == 1) return options[0];
    const int n = add_any_of(path + ".type");
    out_->nodes[size_t(n)].options = std::move(options);
    return n;
  }

  // The compiled schema with `root` as its root, once the checks on the whole graph pass.
  ApiResult<std::shared_ptr<const CompiledSchema>> finish(int root) {
    out_->root = root;
    std::vector<uint8_t> state(out_->nodes.size(), 0);
    for (size_t n = 0; n < out_->nodes.size(); ++n) {
      if (any_of_cycle(int(n), state)) {
        return fail("",
                    "a definition refers to itself with no object or array between, so no "
                    "value can match it");
      }
    }
    RECUR_API_CHECK(flatten_any_ofs());
    const int depth = set_min_depths();
    if (depth == kUnbounded) {
      return fail("",
                  "every value would nest objects or arrays without end (a definition always "
                  "holds another of itself), so none can be written");
    }
    if (depth > JsonMatcher::kMaxDepth) {
      return fail("", fmt::format("every value nests objects and arrays {} levels deep or more: "
                                  "deeper than {} levels, the most structured outputs follow",
                                  depth, JsonMatcher::kMaxDepth));
    }
    return std::shared_ptr<const CompiledSchema>(std::move(out_));
  }

 private:
  ApiError fail(const std::string& path, const std::string& what) const {
    return bad_request(field_, fmt::format("{}{}: {}", field_, path, what));
  }

  ApiResult<int> check_size() const {
    if (out_->nodes.size() >= size_t(kMaxSchemaNodes)) {
      return fail("", fmt::format("the schema is larger than {} nodes", kMaxSchemaNodes));
    }
    return 0;
  }

  int add(SchemaNode::Kind kind) {
    out_->nodes.emplace_back();
    out_->nodes.back().kind = kind;
    return int(out_->nodes.size()) - 1;
  }

  // An anyOf, with the schema path its errors name.
  int add_any_of(const std::string& path) {
    const int n = add(SchemaNode::Kind::kAnyOf);
    any_of_paths_[n] = path;
    return n;
  }

  // Any JSON value: one node set, made once (its object and array refer back to it).
  int any() {
    if (any_ >= 0) return any_;
    any_ = add(SchemaNode::Kind::kAnyOf);
    const int object = add(SchemaNode::Kind::kObject);
    out_->nodes[size_t(object)].additional = any_;
    const int array = add(SchemaNode::Kind::kArray);
    out_->nodes[size_t(array)].items = any_;
    const int string = add(SchemaNode::Kind::kString);
    const int number = add(SchemaNode::Kind::kNumber);
    const int lits = add(SchemaNode::Kind::kLiterals);
    out_->nodes[size_t(lits)].literals = {"true", "false", "null"};
    out_->nodes[size_t(any_)].options = {object, array, string, number, lits};
    return any_;
  }

  ApiResult<int> compile_ref(const ojson& ref, const std::string& path) {
    if (!ref.is_string()) return fail(path + ".$ref", "'$ref' must be a string");
    const std::string r = ref.get<std::string>();
    if (r == "#") return root_node();
    std::string group, name;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      if (r.rfind(prefix, 0) == 0) {
        group = std::string(prefix).substr(2, std::string(prefix).size() - 3);
        name = r.substr(std::string(prefix).size());
      }
    }
    const ojson* defs = group.empty() ? nullptr : field(root_, group);
    const ojson* target = defs && defs->is_object() ? field(*defs, name) : nullptr;
    if (!target) {
      return fail(path + ".$ref",
                  fmt::format("'{}' is not a definition of this schema (#/$defs/NAME)", r));
    }
    if (auto it = refs_.find(r); it != refs_.end()) return it->second;
    // A placeholder first, so that a definition may refer to itself.
    RECUR_API_CHECK(check_size());
    const int slot = add_any_of("." + group + "." + name);
    refs_[r] = slot;
    RECUR_API_ASSIGN(const int n, compile(*target, "." + group + "." + name));
    out_->nodes[size_t(slot)].options = {n};
    return slot;
  }

  ApiResult<int> root_node() {
    if (root_slot_ < 0) {
      root_slot_ = add_any_of("");
      RECUR_API_ASSIGN(const int n, compile(root_, ""));
      out_->nodes[size_t(root_slot_)].options = {n};
    }
    return root_slot_;
  }

  // enum and const: the values both allow, of the schema's type (allowed_values).
  ApiResult<int> enumerated(const ojson& s, const std::string& path) {
    const ojson* e = field(s, "enum");
    if (e && (!e->is_array() || e->empty())) {
      return fail(path + ".enum", "must be a non-empty array");
    }
    if (const ojson* type = field(s, "type"); type && !type->is_string() && !type->is_array()) {
      return fail(path + ".type", "'type' must be a type name or a list of them");
    }
    const ojson values = allowed_values(s);
    if (values.empty()) {
      return fail(path,
                  "no value of its 'enum' / 'const' is also of its 'type': it accepts nothing");
    }
    return literals_of(values, path + (e ? ".enum" : ".const"));
  }

  ApiResult<int> literals_of(const ojson& values, const std::string& path) {
    if (values.size() > size_t(kMaxSchemaLiterals)) {
      return fail(path, fmt::format("more than {} values", kMaxSchemaLiterals));
    }
    RECUR_API_CHECK(check_size());
    const int n = add(SchemaNode::Kind::kLiterals);
    for (const ojson& v : values) {
      std::string text = v.dump();
      if (text.size() > size_t(kMaxLiteralBytes)) {
        return fail(path, fmt::format("a value longer than {} bytes as JSON", kMaxLiteralBytes));
      }
      out_->nodes[size_t(n)].literals.push_back(std::move(text));
    }
    return n;
  }

  ApiResult<int> any_of(const ojson& options, const std::string& path) {
    if (!options.is_array() || options.empty()) return fail(path, "must be a non-empty array");
    RECUR_API_CHECK(check_size());
    const int n = add_any_of(path);
    std::vector<int> compiled;
    for (size_t i = 0; i < options.size(); ++i) {
      RECUR_API_ASSIGN(const int o, compile(options[i], fmt::format("{}[{}]", path, i)));
      compiled.push_back(o);
    }
    out_->nodes[size_t(n)].options = std::move(compiled);
    return n;
  }

  ApiResult<int> count_of(const ojson& s, const char* key, const std::string& path, int dflt) {
    const ojson* v = field(s, key);
    if (!v) return dflt;
    if (!v->is_number_integer() || v->get<int64_t>() < 0) {
      return fail(path + "." + key, "must be a non-negative integer");
    }
    return int(std::min<int64_t>(v->get<int64_t>(), INT_MAX));
  }

  ApiResult<int> typed(const ojson& s, const std::string& type, const std::string& path) {
    RECUR_API_CHECK(check_size());
    using K = SchemaNode::Kind;
    if (type == "string") {
      const int n = add(K::kString);
      RECUR_API_ASSIGN(const int lo, count_of(s, "minLength", path, 0));
      RECUR_API_ASSIGN(const int hi, count_of(s, "maxLength", path, INT_MAX));
      if (lo > hi) return fail(path, "minLength is above maxLength");
      out_->nodes[size_t(n)].min_length = lo, out_->nodes[size_t(n)].max_length = hi;
      return n;
    }
    if (type == "number" || type == "integer")
      return add(type == "number" ? K::kNumber : K::kInteger);
    if (type == "boolean" || type == "null") {
      const int n = add(K::kLiterals);
      out_->nodes[size_t(n)].literals = type == "null" ? std::vector<std::string>{"null"}
                                                       : std::vector<std::string>{"true", "false"};
      return n;
    }
    if (type == "array") {
      const int n = add(K::kArray);
      RECUR_API_ASSIGN(const int lo, count_of(s, "minItems", path, 0));
      RECUR_API_ASSIGN(const int hi, count_of(s, "maxItems", path, INT_MAX));
      if (lo > hi) return fail(path, "minItems is above maxItems");
      int items = -1;
      if (const ojson* it = field(s, "items")) {
        RECUR_API_ASSIGN(items, compile(*it, path + ".items"));
      } else {
        items = any();
      }
      SchemaNode& node = out_->nodes[size_t(n)];
      node.min_items = lo, node.max_items = hi, node.items = items;
      return n;
    }
    if (type == "object") return object(s, path);
    return fail(path + ".type", fmt::format("'{}' is not a JSON Schema type", type));
  }

  ApiResult<int> object(const ojson& s, const std::string& path) {
    const int n = add(SchemaNode::Kind::kObject);
    std::vector<std::string> names;
    std::vector<int> props;
    if (const ojson* p = field(s, "properties")) {
      if (!p->is_object()) return fail(path + ".properties", "must be an object");
      if (p->size() > size_t(kMaxSchemaProperties)) {
        return fail(path + ".properties",
                    fmt::format("more than {} properties", kMaxSchemaProperties));
      }
      for (const auto& [name, sub] : p->items()) {
        RECUR_API_ASSIGN(const int c, compile(sub, path + ".properties." + name));
        names.push_back(name);
        props.push_back(c);
      }
    }
    uint64_t required = 0;
    if (const ojson* r = field(s, "required")) {
      if (!r->is_array()) return fail(path + ".required", "must be an array of names");
      for (const ojson& name : *r) {
        const auto it =
            name.is_string() ? std::find(names.begin(), names.end(), name) : names.end();
        if (it == names.end()) {
          return fail(path + ".required",
                      fmt::format("{} is not one of the object's properties", name.dump()));
        }
        required |= uint64_t(1) << (it - names.begin());
      }
    }
    int additional = -1;
    const ojson* a = field(s, "additionalProperties");
    if (!a || (a->is_boolean() && a->get<bool>())) {
      additional = any();
    } else if (!a->is_boolean()) {
      RECUR_API_ASSIGN(additional, compile(*a, path + ".additionalProperties"));
    }
    SchemaNode& node = out_->nodes[size_t(n)];
    for (const std::string& name : names) node.names.push_back(name_text(name));
    node.props = std::move(props);
    node.required = required;
    node.additional = additional;
    return n;
  }

  // Whether an anyOf reaches itself through anyOfs alone ({"$defs": {"a": {"$ref":
  // "#/$defs/a"}}}): a value of it could never start. state: 0 unseen, 1 on the path, 2 done.
  bool any_of_cycle(int n, std::vector<uint8_t>& state) const {
    const SchemaNode& node = out_->nodes[size_t(n)];
    if (node.kind != SchemaNode::Kind::kAnyOf || state[size_t(n)] == 2) return false;
    if (state[size_t(n)] == 1) return true;
    state[size_t(n)] = 1;
    for (int o : node.options) {
      if (any_of_cycle(o, state)) return true;
    }
    state[size_t(n)] = 2;
    return false;
  }

  // Lists each anyOf's options through its nested anyOfs (and $refs), each node once, so that
  // the matcher forks a value once per option: a chain of k anyOfs of two options that lead to
  // the same next level had 2^k ways to its end. The anyOfs make no cycle (any_of_cycle).
  ApiResult<int> flatten_any_ofs() {
    const size_t n_nodes = out_->nodes.size();
    std::vector<std::vector<int>> flat(n_nodes);
    std::vector<uint8_t> done(n_nodes, 0);
    std::vector<int> listed_in(n_nodes, -1);  // the anyOf whose list has the node
    for (size_t n = 0; n < n_nodes; ++n) {
      RECUR_API_CHECK(flatten(int(n), flat, done, listed_in));
    }
    for (size_t n = 0; n < n_nodes; ++n) {
      if (done[n]) out_->nodes[n].options = merge_literals(std::move(flat[n]));
    }
    return 0;
  }

  // An anyOf's literal options (consts, enums) as few literal nodes as hold them (each text
  // once, kMaxSchemaLiterals a node): as separate options, a union of many literals that start
  // alike (strings: '"') would open more alternatives at once than the matcher keeps.
  std::vector<int> merge_literals(std::vector<int> options) {
    using K = SchemaNode::Kind;
    std::vector<int> kept;
    std::vector<std::string> texts;
    for (int o : options) {
      if (out_->nodes[size_t(o)].kind != K::kLiterals) {
        kept.push_back(o);
        continue;
      }
      for (const std::string& t : out_->nodes[size_t(o)].literals) {
        if (std::find(texts.begin(), texts.end(), t) == texts.end()) texts.push_back(t);
      }
    }
    const size_t literal_options = options.size() - kept.size();
    if (literal_options < 2) return options;
    for (size_t i = 0; i < texts.size(); i += size_t(kMaxSchemaLiterals)) {
      const int n = add(K::kLiterals);
      const size_t end = std::min(texts.size(), i + size_t(kMaxSchemaLiterals));
      out_->nodes[size_t(n)].literals.assign(texts.begin() + long(i), texts.begin() + long(end));
      kept.push_back(n);
    }
    return kept;
  }

  ApiResult<int> flatten(int n, std::vector<std::vector<int>>& flat, std::vector<uint8_t>& done,
                         std::vector<int>& listed_in) {
    const SchemaNode& node = out_->nodes[size_t(n)];
    if (node.kind != SchemaNode::Kind::kAnyOf || done[size_t(n)]) return 0;
    for (int o : node.options) RECUR_API_CHECK(flatten(o, flat, done, listed_in));
    std::vector<int> list;
    auto note = [&](int leaf) {
      if (listed_in[size_t(leaf)] == n) return;
      listed_in[size_t(leaf)] = n;
      list.push_back(leaf);
    };
    for (int o : node.options) {
      if (!done[size_t(o)]) {
        note(o);
        continue;
      }
      for (int leaf : flat[size_t(o)]) note(leaf);
    }
    if (list.size() > size_t(kMaxSchemaAlternatives)) {
      const auto path = any_of_paths_.find(n);
      return fail(path == any_of_paths_.end() ? "" : path->second,
                  fmt::format("more than {} options, counting those of nested anyOf, oneOf, "
                              "type lists and $ref",
                              kMaxSchemaAlternatives));
    }
    flat[size_t(n)] = std::move(list);
    done[size_t(n)] = 1;
    return 0;
  }

  // Sets each node's min_depth and returns the root's (kUnbounded: it has no finite value).
  // Depths settle in increasing order, as distances do in Dijkstra's: an anyOf at its first
  // option's, an object one past its last required property's, an array of at least one item
  // one past its items'.
  int set_min_depths() {
    using K = SchemaNode::Kind;
    std::vector<SchemaNode>& nodes = out_->nodes;
    std::vector<int> depth(nodes.size(), kUnbounded);
    std::vector<int> unsettled(nodes.size(), 0);  // containers: the parts their depth awaits
    std::vector<std::vector<int>> parents(nodes.size());
    std::deque<int> settled;  // at the depth being settled in front, one more behind
    for (size_t n = 0; n < nodes.size(); ++n) {
      const SchemaNode& node = nodes[n];
      if (node.kind == K::kAnyOf) {
        for (int o : node.options) parents[size_t(o)].push_back(int(n));
        continue;
      }
      if (node.kind == K::kObject) {
        for (size_t i = 0; i < node.props.size(); ++i) {
          if (!(node.required >> i & 1)) continue;
          parents[size_t(node.props[i])].push_back(int(n));
          ++unsettled[n];
        }
      } else if (node.kind == K::kArray && node.min_items > 0) {
        parents[size_t(node.items)].push_back(int(n));
        ++unsettled[n];
      }
      if (unsettled[n] > 0) continue;
      if (node.kind == K::kObject || node.kind == K::kArray) {
        depth[n] = 1;
        settled.push_back(int(n));
      } else {
        depth[n] = 0;
        settled.push_front(int(n));
      }
    }
    while (!settled.empty()) {
      const int c = settled.front();
      settled.pop_front();
      for (int p : parents[size_t(c)]) {
        if (nodes[size_t(p)].kind == K::kAnyOf) {
          if (depth[size_t(p)] != kUnbounded) continue;
          depth[size_t(p)] = depth[size_t(c)];
          settled.push_front(p);
        } else if (--unsettled[size_t(p)] == 0) {
          depth[size_t(p)] = depth[size_t(c)] + 1;
          settled.push_back(p);
        }
      }
    }
    for (size_t n = 0; n < nodes.size(); ++n) {
      nodes[n].min_depth = std::min(depth[n], JsonMatcher::kMaxDepth + 1);
    }
    for (SchemaNode& node : nodes) {
      if (node.kind != K::kObject) continue;
      for (int p : node.props)
        node.deepest_value = std::max(node.deepest_value, nodes[size_t(p)].min_depth);
      if (node.additional >= 0) {
        node.deepest_value = std::max(node.deepest_value, nodes[size_t(node.additional)].min_depth);
      }
    }
    return depth[size_t(out_->root)];
  }

  static constexpr int kUnbounded = INT_MAX;

  const ojson& root_;
  std::string field_;
  std::shared_ptr<CompiledSchema> out_ = std::make_shared<CompiledSchema>();
  std::map<std::string, int> refs_;
  std::map<int, std::string> any_of_paths_;
  int any_ = -1;
  int root_slot_ = -1;
};

}  // namespace

ApiResult<std::shared_ptr<const CompiledSchema>> compile_json_schema(const ojson& schema,
                                                                     const std::string& field) {
  Compiler c(schema, field);
  RECUR_API_ASSIGN(const int root, c.compile(schema, ""));
  return c.finish(root);
}

std::shared_ptr<const CompiledSchema> any_json_object_schema() {
  static const std::shared_ptr<const CompiledSchema> any_object =
      compile_json_schema(ojson{{"type", "object"}}, "response_format").value();
  return any_object;  // compiled once, shared by every request that asks for it
}

ojson allowed_values(const ojson& schema) {
  const ojson* e = field(schema, "enum");
  ojson values = e && e->is_array()         ? *e
                 : schema.contains("const") ? ojson::array({schema["const"]})
                                            : ojson::array();
  ojson kept = ojson::array();
  const ojson* type = field(schema, "type");
  std::vector<std::string> types;
  if (type) {
    for (const ojson& t : type->is_array() ? *type : ojson::array({*type})) {
      if (t.is_string()) types.push_back(t.get<std::string>());
    }
  }
  // With enum, const applies too (a const of null included, which field() would skip).
  const ojson* also_const = e && schema.contains("const") ? &schema.at("const") : nullptr;
  for (const ojson& v : values) {
    if (also_const && v != *also_const) continue;
    if (type && std::none_of(types.begin(), types.end(),
                             [&](const std::string& t) { return type_admits(t, v); })) {
      continue;
    }
    kept.push_back(v);
  }
  return kept;
}

}  // namespace recur::server
