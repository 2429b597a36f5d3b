// The JSON matcher (json_schema.h): a pushdown automaton over the compiled schema's nodes. A
// stack's frames are the values being written, innermost last. An anyOf splits a stack into
// one per option at the value's first byte; stacks a byte refuses drop out.
#include <algorithm>
#include <cstring>

#include "server/json_schema.h"
#include "tokenizer/utf8_util.h"

namespace recur::server {

namespace {

using Frame = JsonMatcher::Frame;
using Kind = SchemaNode::Kind;

enum FrameKind : uint8_t { kRoot, kValue, kObject, kArray, kString, kNumber, kLiteral };
// Object phases: after '{', in a key, before ':', after a value (the value frame is above it
// meanwhile), after ','.
enum : uint8_t { kObjFirst, kObjKey, kObjColon, kObjAfter, kObjNext };
// Array phases: after '[', after an item (the item's frame is above it meanwhile), after ','.
enum : uint8_t { kArrFirst, kArrAfter, kArrNext };
// Number phases, JSON's grammar: start, after '-', a leading 0, integer digits, after '.',
// fraction digits, after 'e', after the exponent's sign, exponent digits.
enum : uint8_t {
  kNumStart,
  kNumMinus,
  kNumZero,
  kNumInt,
  kNumDot,
  kNumFrac,
  kNumE,
  kNumESign,
  kNumExp
};

bool is_ws(uint8_t b) {
  return b == ' ' || b == '\n' || b == '\r' || b == '\t';
}
bool is_digit(uint8_t b) {
  return b >= '0' && b <= '9';
}
bool is_hex(uint8_t b) {
  return is_digit(b) || (b >= 'a' && b <= 'f') || (b >= 'A' && b <= 'F');
}

// One byte inside a string (value or key): -1 refused, 0 continues a character, 1 starts one,
// 2 the closing quote.
int string_byte(Frame& f, uint8_t b) {
  if (f.esc == 1) {  // after '\'
    if (b == 'u') {
      f.esc = 5;  // four hex digits
      f.hex = 0;
      return 0;
    }
    if (std::strchr("\"\\/bfnrt", b) && b != 0 && !f.low_next) {
      f.esc = 0;
      return 0;
    }
    return -1;
  }
  if (f.esc > 1) {
    if (!is_hex(b)) return -1;
    f.hex = uint16_t(f.hex << 4 | (is_digit(b) ? b - '0' : (b | 0x20) - 'a' + 10));
    f.esc = f.esc == 2 ? 0 : uint8_t(f.esc - 1);
    if (f.esc == 0) {
      // Escapes spell whole code points (strict parsers refuse a lone surrogate): a high
      // surrogate is followed by a low one, and a low one comes only so.
      const bool high = f.hex >= 0xD800 && f.hex <= 0xDBFF;
      const bool low = f.hex >= 0xDC00 && f.hex <= 0xDFFF;
      if (low != f.low_next) return -1;
      f.low_next = high;
    }
    return 0;
  }
  if (f.low_next && b != '\\') return -1;
  if (f.utf8_left > 0) {
    if (b < f.lo || b > f.hi) return -1;
    --f.utf8_left;
    f.lo = 0x80, f.hi = 0xBF;
    return 0;
  }
  if (b == '"') return 2;
  if (b == '\\') {
    f.esc = 1;
    return 1;
  }
  if (b < 0x20) return -1;
  if (b < 0x80) return 1;
  Utf8Lead lead;  // a multi-byte character's first byte
  if (!utf8_lead(b, &lead)) return -1;
  f.utf8_left = uint8_t(lead.continuations), f.lo = lead.lo, f.hi = lead.hi;
  return 1;
}

bool number_accepts_end(const Frame& f) {
  return f.phase == kNumZero || f.phase == kNumInt || f.phase == kNumFrac || f.phase == kNumExp;
}

// The number grammar's next phase after b, or -1.
int number_next(uint8_t phase, uint8_t b, bool integer) {
  const bool d = is_digit(b);
  switch (phase) {
    case kNumStart:
      return b == '-' ? kNumMinus : b == '0' ? kNumZero : d ? kNumInt : -1;
    case kNumMinus:
      return b == '0' ? kNumZero : d ? kNumInt : -1;
    case kNumZero:
    case kNumInt:
      if (phase == kNumInt && d) return kNumInt;
      if (integer) return -1;
      return b == '.' ? kNumDot : (b == 'e' || b == 'E') ? kNumE : -1;
    case kNumDot:
    case kNumFrac:
      if (d) return kNumFrac;
      return phase == kNumFrac && (b == 'e' || b == 'E') ? kNumE : -1;
    case kNumE:
      return (b == '+' || b == '-') ? kNumESign : d ? kNumExp : -1;
    case kNumESign:
    case kNumExp:
      return d ? kNumExp : -1;
  }
  return -1;
}

// Whether a value of `node` can be written whole inside `open` objects and arrays.
bool fits(int open, const SchemaNode& node) {
  return open + node.min_depth <= JsonMatcher::kMaxDepth;
}

bool frames_equal(const Frame& a, const Frame& b) {
  return a.node == b.node && a.kind == b.kind && a.phase == b.phase && a.gap == b.gap &&
         a.esc == b.esc && a.lo == b.lo && a.hi == b.hi && a.utf8_left == b.utf8_left &&
         a.free_key == b.free_key && a.low_next == b.low_next && a.hex == b.hex && a.key == b.key &&
         a.pos == b.pos && a.count == b.count && a.cand == b.cand && a.seen == b.seen;
}

}  // namespace

struct JsonMatcher::Stack {
  Frame f[kMaxDepth + 2];
  int n = 0;
  Frame& top() { return f[n - 1]; }
};

JsonMatcher::JsonMatcher(const CompiledSchema* schema) {
  reset(schema);
}

void JsonMatcher::reset(const CompiledSchema* schema) {
  schema_ = schema;
  Frame root;
  root.kind = kRoot;
  root.node = uint16_t(schema->root);
  frames_[0] = root;
  start_[0] = 0, start_[1] = 1;
  n_alt_ = 1;
}

void JsonMatcher::copy_from(const JsonMatcher& other) {
  schema_ = other.schema_;
  n_alt_ = other.n_alt_;
  std::copy(other.start_.begin(), other.start_.begin() + n_alt_ + 1, start_.begin());
  std::copy(other.frames_.begin(), other.frames_.begin() + start_[size_t(n_alt_)], frames_.begin());
}

void JsonMatcher::emit(const Stack& s) {
  const int used = next_start_[size_t(next_alt_)];
  if (next_alt_ == kMaxAlternatives || used + s.n > kMaxFrames) return;  // past the bounds
  for (int a = 0; a < next_alt_; ++a) {  // an equal stack is there already
    const int b0 = next_start_[size_t(a)], len = next_start_[size_t(a) + 1] - b0;
    if (len != s.n) continue;
    bool same = true;
    for (int i = 0; i < len && same; ++i) same = frames_equal(next_frames_[size_t(b0 + i)], s.f[i]);
    if (same) return;
  }
  std::copy(s.f, s.f + s.n, next_frames_.begin() + used);
  ++next_alt_;
  next_start_[size_t(next_alt_)] = uint8_t(used + s.n);
}

bool JsonMatcher::feed(uint8_t b) {
  next_alt_ = 0;
  next_start_[0] = 0;
  Stack s;
  for (int a = 0; a < n_alt_; ++a) {
    s.n = start_[size_t(a) + 1] - start_[size_t(a)];
    std::copy(frames_.begin() + start_[size_t(a)], frames_.begin() + start_[size_t(a) + 1], s.f);
    apply(s, b);
  }
  if (next_alt_ == 0) return false;
  n_alt_ = next_alt_;
  std::copy(next_start_.begin(), next_start_.begin() + n_alt_ + 1, start_.begin());
  std::copy(next_frames_.begin(), next_frames_.begin() + start_[size_t(n_alt_)], frames_.begin());
  return true;
}

bool JsonMatcher::feed(std::string_view bytes) {
  for (char c : bytes) {
    if (!feed(uint8_t(c))) return false;
  }
  return true;
}

bool JsonMatcher::can_end() const {
  for (int a = 0; a < n_alt_; ++a) {
    const Frame* st = frames_.data() + start_[size_t(a)];
    const int n = start_[size_t(a) + 1] - start_[size_t(a)];
    if (n == 1 && st[0].phase == 1) return true;  // the root's value is whole
    if (n != 2) continue;
    // A number or literal ends where the text does.
    const Frame& t = st[1];
    if (t.kind == kNumber && number_accepts_end(t)) return true;
    if (t.kind == kLiteral) {
      const auto& lits = schema_->nodes[t.node].literals;
      for (size_t i = 0; i < lits.size(); ++i) {
        if ((t.cand >> i & 1) && lits[i].size() == t.pos) return true;
      }
    }
  }
  return false;
}

int JsonMatcher::free_string_room() const {
  int room = INT_MAX;
  for (int a = 0; a < n_alt_; ++a) {
    const Frame& t = frames_[size_t(start_[size_t(a) + 1]) - 1];
    if (t.esc != 0 || t.utf8_left != 0 || t.low_next) return -1;
    if (t.kind == kString) {
      const int64_t max = schema_->nodes[t.node].max_length;
      if (max != INT_MAX) room = int(std::min<int64_t>(room, max - int64_t(t.count)));
    } else if (!(t.kind == kObject && t.phase == kObjKey && t.free_key)) {
      return -1;
    }
  }
  return n_alt_ > 0 ? room : -1;
}

// The frame on top is done: it goes, and its parent takes note.
static void child_done(JsonMatcher::Frame* f, int* n) {
  --*n;
  Frame& p = f[*n - 1];
  p.gap = 0;
  if (p.kind == kRoot) {
    p.phase = 1;
  } else if (p.kind == kObject) {
    if (p.key >= 0) p.seen |= uint64_t(1) << p.key;
  } else if (p.kind == kArray) {
    ++p.count;
  }
}

void JsonMatcher::apply(Stack& s, uint8_t b) {
  Frame& t = s.top();
  const SchemaNode& node = schema_->nodes[t.node];
  // Whitespace between tokens, where a frame waits for the next one.
  const bool between = t.kind == kRoot || t.kind == kValue || t.kind == kArray ||
                       (t.kind == kObject && t.phase != kObjKey);
  if (between && is_ws(b)) {
    if (t.gap >= kMaxGap) return;
    ++t.gap;
    emit(s);
    return;
  }
  // Pushes a value of `child` to come; false past the nesting bound.
  auto push = [&](int child) {
    if (s.n >= kMaxDepth + 2) return false;
    Frame v;
    v.kind = kValue;
    v.node = uint16_t(child);
    s.f[s.n++] = v;
    return true;
  };
  // Pushes a value of `child` that b starts.
  auto push_value = [&](int child) {
    if (push(child)) apply(s, b);
  };
  switch (t.kind) {
    case kRoot:
      if (t.phase == 0) push_value(t.node);  // after a whole value only whitespace may come
      return;
    case kValue: {
      Frame v = t;
      v.gap = 0;
      switch (node.kind) {
        case Kind::kAnyOf:
          // Each option starts the value on this stack in turn: starting one changes only the
          // top frame. The options are flat (compile_json_schema), so this is one fork each.
          for (int o : node.options) {
            s.top() = v;
            s.top().node = uint16_t(o);
            apply(s, b);
          }
          return;
        case Kind::kObject:
          // Containers nest kMaxDepth deep (the stack: the root, them, this value), and the
          // value's own nesting must fit too.
          if (b != '{' || !fits(s.n - 2, node)) return;
          v.kind = kObject, v.phase = kObjFirst, v.seen = 0, v.key = -1;
          break;
        case Kind::kArray:
          if (b != '[' || !fits(s.n - 2, node)) return;
          v.kind = kArray, v.phase = kArrFirst, v.count = 0;
          break;
        case Kind::kString:
          if (b != '"') return;
          v.kind = kString, v.count = 0;
          break;
        case Kind::kNumber:
        case Kind::kInteger: {
          const int next = number_next(kNumStart, b, node.kind == Kind::kInteger);
          if (next < 0) return;
          v.kind = kNumber, v.phase = uint8_t(next), v.count = 1;
          break;
        }
        case Kind::kLiterals: {
          uint64_t cand = 0;
          for (size_t i = 0; i < node.literals.size(); ++i) {
            if (uint8_t(node.literals[i][0]) == b) cand |= uint64_t(1) << i;
          }
          if (!cand) return;
          v.kind = kLiteral, v.cand = cand, v.pos = 1;
          break;
        }
      }
      t = v;
      emit(s);
      return;
    }
    case kObject: {
      const int n_names = int(node.names.size());
      const uint64_t all = n_names == 64 ? ~uint64_t(0) : (uint64_t(1) << n_names) - 1;
      const bool required_seen = (node.required & ~t.seen) == 0;
      // Only properties whose values fit in the levels left may be named (the required ones
      // do: the object's own min_depth counts them).
      const int open = s.n - 1;  // the objects and arrays around a property's value
      auto fitting = [&] {
        if (open + node.deepest_value <= kMaxDepth) return all;  // far from the bound: all do
        uint64_t bits = 0;
        for (int i = 0; i < n_names; ++i) {
          if (fits(open, schema_->nodes[size_t(node.props[size_t(i)])])) bits |= uint64_t(1) << i;
        }
        return bits;
      };
      const bool other_names =
          node.additional >= 0 && fits(open, schema_->nodes[size_t(node.additional)]);
      // A key may still come: a property not given yet, or any other name.
      auto key_possible = [&] { return (all & fitting() & ~t.seen) != 0 || other_names; };
      switch (t.phase) {
        case kObjFirst:
        case kObjNext:
          if (b == '}' && t.phase == kObjFirst && required_seen) {
            child_done(s.f, &s.n);
            emit(s);
          } else if (b == '"' && key_possible()) {
            t.phase = kObjKey, t.gap = 0, t.pos = 0, t.esc = 0, t.utf8_left = 0, t.low_next = false;
            t.lo = 0x80, t.hi = 0xBF;
            t.free_key = other_names;
            // Other names may repeat no property: all names stay candidates to be caught.
            t.cand = t.free_key ? all : all & fitting() & ~t.seen;
            emit(s);
          }
          return;
        case kObjKey: {
          const int kind = string_byte(t, b);
          if (kind < 0) return;
          if (kind == 2) {  // the key is whole
            int match = -1;
            for (int i = 0; i < n_names; ++i) {
              if ((t.cand >> i & 1) && node.names[size_t(i)].size() == t.pos) match = i;
            }
            if (match >= 0 && (t.seen >> match & 1)) return;      // a property given twice
            if (match >= 0 && !(fitting() >> match & 1)) return;  // its value would not fit
            if (match < 0 && !t.free_key) return;
            t.key = int16_t(match);
            t.phase = kObjColon, t.gap = 0;
            emit(s);
            return;
          }
          uint64_t cand = 0;
          for (int i = 0; i < n_names; ++i) {
            const std::string& name = node.names[size_t(i)];
            if ((t.cand >> i & 1) && t.pos < name.size() && uint8_t(name[t.pos]) == b) {
              cand |= uint64_t(1) << i;
            }
          }
          if (!t.free_key && (cand & ~t.seen) == 0) return;
          t.cand = cand;
          if (t.pos < 0xFFFF) ++t.pos;
          emit(s);
          return;
        }
        case kObjColon:
          if (b != ':') return;
          t.phase = kObjAfter, t.gap = 0;
          if (push(t.key >= 0 ? node.props[size_t(t.key)] : node.additional)) emit(s);
          return;
        case kObjAfter:
          if (b == '}' && required_seen) {
            child_done(s.f, &s.n);
            emit(s);
          } else if (b == ',' && key_possible()) {
            t.phase = kObjNext, t.gap = 0;
            emit(s);
          }
          return;
      }
      return;
    }
    case kArray:
      if (t.phase == kArrAfter) {
        if (b == ']' && int64_t(t.count) >= node.min_items) {
          child_done(s.f, &s.n);
          emit(s);
        } else if (b == ',' && int64_t(t.count) < node.max_items) {
          t.phase = kArrNext, t.gap = 0;
          emit(s);
        }
        return;
      }
      if (b == ']' && t.phase == kArrFirst && node.min_items == 0) {
        child_done(s.f, &s.n);
        emit(s);
        return;
      }
      if (int64_t(t.count) >= node.max_items) return;
      t.phase = kArrAfter, t.gap = 0;
      push_value(node.items);
      return;
    case kString: {
      const int kind = string_byte(t, b);
      if (kind < 0) return;
      if (kind == 2) {
        if (int64_t(t.count) < node.min_length) return;
        child_done(s.f, &s.n);
      } else if (kind == 1) {
        if (int64_t(t.count) >= node.max_length) return;
        ++t.count;
      }
      emit(s);
      return;
    }
    case kNumber: {
      const int next = number_next(t.phase, b, node.kind == Kind::kInteger);
      if (next >= 0) {
        if (t.count >= uint32_t(kMaxNumberBytes)) return;
        // At most two exponent digits: the value stays finite as a double (strict parsers,
        // nlohmann's, Go's and serde's, refuse 1e999).
        if (next == kNumExp && (t.phase == kNumExp ? ++t.pos : (t.pos = 1)) > 2) return;
        t.phase = uint8_t(next);
        ++t.count;
        emit(s);
      } else if (number_accepts_end(t)) {  // the number ended before b: b is its parent's
        child_done(s.f, &s.n);
        apply(s, b);
      }
      return;
    }
    case kLiteral: {
      uint64_t cand = 0;
      bool whole = false;
      for (size_t i = 0; i < node.literals.size(); ++i) {
        if (!(t.cand >> i & 1)) continue;
        const std::string& lit = node.literals[i];
        if (t.pos < lit.size() && uint8_t(lit[t.pos]) == b) cand |= uint64_t(1) << i;
        whole = whole || lit.size() == t.pos;
      }
      if (cand) {
        t.cand = cand;
        ++t.pos;
        emit(s);
      } else if (whole) {  // the literal ended before b
        child_done(s.f, &s.n);
        apply(s, b);
      }
      return;
    }
  }
}

}  // namespace recur::server
