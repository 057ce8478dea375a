#include "driver/chat/operators.h"

#include <cmath>

namespace tessera::chat::jinja {
namespace {

const char* symbol(Op op) {
  switch (op) {
    case Op::kAdd:
      return "+";
    case Op::kSub:
      return "-";
    case Op::kMul:
      return "*";
    case Op::kDiv:
      return "/";
    case Op::kFloorDiv:
      return "//";
    case Op::kMod:
      return "%";
    case Op::kPow:
      return "** or pow()";
    default:
      return "?";
  }
}

[[noreturn]] void unsupported(Op op, const Value& a, const Value& b) {
  throw RenderError(std::string("unsupported operand type(s) for ") + symbol(op) + ": '" +
                    type_name(a) + "' and '" + type_name(b) + "'");
}

[[noreturn]] void overflow() {
  throw RenderError("integer overflow (template integers are 64-bit)");
}

int64_t add_int(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) overflow();
  return r;
}
int64_t sub_int(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_sub_overflow(a, b, &r)) overflow();
  return r;
}
int64_t mul_int(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) overflow();
  return r;
}

Value repeat(const Value& seq, int64_t times) {
  if (times < 0) times = 0;
  if (seq.is_string()) {
    const std::string& s = seq.as_string();
    if (!s.empty() && static_cast<uint64_t>(times) > kMaxStringBytes / s.size()) {
      throw RenderError("string too long");
    }
    std::string out;
    out.reserve(s.size() * times);
    for (int64_t i = 0; i < times; ++i) out += s;
    return Value::string(std::move(out));
  }
  const ListData& l = seq.as_list();
  if (!l.items.empty() && static_cast<uint64_t>(times) > kMaxListItems / l.items.size()) {
    throw RenderError("list too long");
  }
  std::vector<Value> out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), l.items.begin(), l.items.end());
  return Value::list(std::move(out), l.tuple);
}

// Python's floor division and modulo of integers (the remainder takes the divisor's sign).
int64_t floor_div(int64_t a, int64_t b) {
  if (a == INT64_MIN && b == -1) overflow();
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
int64_t floor_mod(int64_t a, int64_t b) {
  if (b == -1) return 0;
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

Value power(const Value& a, const Value& b) {
  if (!a.is_float() && !b.is_float() && b.as_int() >= 0) {
    int64_t base = a.as_int(), exp = b.as_int(), result = 1;
    while (exp > 0) {
      if (exp & 1) result = mul_int(result, base);
      exp >>= 1;
      if (exp > 0) base = mul_int(base, base);
    }
    return Value::integer(result);
  }
  double x = a.as_float(), y = b.as_float();
  if (x == 0.0 && y < 0) throw RenderError("0.0 cannot be raised to a negative power");
  return Value::number(std::pow(x, y));
}

// Python's printf-style `format % args` for %s, %r, %d, %i and %%.
Value percent_format(const std::string& format, const Value& args) {
  std::vector<Value> values;
  if (args.is_list() && args.as_list().tuple) {
    values = args.as_list().items;
  } else {
    values.push_back(args);
  }
  std::string out;
  size_t next = 0;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      out += format[i];
      continue;
    }
    if (++i == format.size()) throw RenderError("incomplete format");
    char spec = format[i];
    if (spec == '%') {
      out += '%';
      continue;
    }
    if (next >= values.size()) throw RenderError("not enough arguments for format string");
    const Value& v = values[next++];
    if (spec == 's') {
      out += to_str(v);
    } else if (spec == 'r') {
      out += repr(v);
    } else if (spec == 'd' || spec == 'i') {
      if (!v.is_number()) {
        throw RenderError("%" + std::string(1, spec) + " format: a real number is required, not " +
                          type_name(v));
      }
      out += std::to_string(v.is_float() ? static_cast<int64_t>(v.as_float()) : v.as_int());
    } else {
      throw RenderError("unsupported format character '" + std::string(1, spec) + "'");
    }
  }
  if (next < values.size()) {
    throw RenderError("not all arguments converted during string formatting");
  }
  return Value::string(std::move(out));
}

}  // namespace

Value binary_op(Op op, const Value& a, const Value& b) {
  if (op == Op::kConcat) {
    std::string s = to_str(a);
    s += to_str(b);
    return Value::string(std::move(s));
  }
  if (a.is_undefined()) a.fail_undefined();
  if (b.is_undefined()) b.fail_undefined();
  bool numbers = a.is_number() && b.is_number();
  bool any_float = a.is_float() || b.is_float();
  switch (op) {
    case Op::kAdd:
      if (numbers) {
        if (any_float) return Value::number(a.as_float() + b.as_float());
        return Value::integer(add_int(a.as_int(), b.as_int()));
      }
      if (a.is_string() && b.is_string()) {
        if (a.as_string().size() + b.as_string().size() > kMaxStringBytes) {
          throw RenderError("string too long");
        }
        return Value::string(a.as_string() + b.as_string());
      }
      if (a.is_list() && b.is_list() && a.as_list().tuple == b.as_list().tuple) {
        std::vector<Value> items = a.as_list().items;
        items.insert(items.end(), b.as_list().items.begin(), b.as_list().items.end());
        return Value::list(std::move(items), a.as_list().tuple);
      }
      if (a.is_string() || a.is_list()) {
        throw RenderError("can only concatenate " + type_name(a) + " (not \"" + type_name(b) +
                          "\") to " + type_name(a));
      }
      unsupported(op, a, b);
    case Op::kSub:
      if (!numbers) unsupported(op, a, b);
      if (any_float) return Value::number(a.as_float() - b.as_float());
      return Value::integer(sub_int(a.as_int(), b.as_int()));
    case Op::kMul:
      if (numbers) {
        if (any_float) return Value::number(a.as_float() * b.as_float());
        return Value::integer(mul_int(a.as_int(), b.as_int()));
      }
      if ((a.is_string() || a.is_list()) && (b.is_int() || b.is_bool())) {
        return repeat(a, b.as_int());
      }
      if ((b.is_string() || b.is_list()) && (a.is_int() || a.is_bool())) {
        return repeat(b, a.as_int());
      }
      if (a.is_string() || a.is_list() || b.is_string() || b.is_list()) {
        const Value& other = (a.is_string() || a.is_list()) ? b : a;
        throw RenderError("can't multiply sequence by non-int of type '" + type_name(other) + "'");
      }
      unsupported(op, a, b);
    case Op::kDiv:
      if (!numbers) unsupported(op, a, b);
      if (b.as_float() == 0.0) throw RenderError("division by zero");
      return Value::number(a.as_float() / b.as_float());
    case Op::kFloorDiv:
      if (!numbers) unsupported(op, a, b);
      if (any_float) {
        if (b.as_float() == 0.0) throw RenderError("float floor division by zero");
        return Value::number(std::floor(a.as_float() / b.as_float()));
      }
      if (b.as_int() == 0) throw RenderError("integer division or modulo by zero");
      return Value::integer(floor_div(a.as_int(), b.as_int()));
    case Op::kMod:
      if (a.is_string()) return percent_format(a.as_string(), b);
      if (!numbers) unsupported(op, a, b);
      if (any_float) {
        double x = a.as_float(), y = b.as_float();
        if (y == 0.0) throw RenderError("float modulo");
        double r = std::fmod(x, y);
        if (r != 0 && ((r < 0) != (y < 0))) r += y;
        return Value::number(r);
      }
      if (b.as_int() == 0) throw RenderError("integer division or modulo by zero");
      return Value::integer(floor_mod(a.as_int(), b.as_int()));
    case Op::kPow:
      if (!numbers) unsupported(op, a, b);
      return power(a, b);
    default:
      throw RenderError("internal error: not an arithmetic operator");
  }
}

Value unary_op(Op op, const Value& v) {
  if (v.is_undefined()) v.fail_undefined();
  if (!v.is_number()) {
    throw RenderError(std::string("bad operand type for unary ") + (op == Op::kNeg ? "-" : "+") +
                      ": '" + type_name(v) + "'");
  }
  if (op == Op::kPos) return v.is_bool() ? Value::integer(v.as_int()) : v;
  if (v.is_float()) return Value::number(-v.as_float());
  if (v.as_int() == INT64_MIN) overflow();
  return Value::integer(-v.as_int());
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kUndefined:
      return false;
    case Value::Kind::kString:
      if (!item.is_string()) {
        throw RenderError("'in <string>' requires string as left operand, not " + type_name(item));
      }
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::kList:
      for (const Value& v : container.as_list().items) {
        if (equals(v, item)) return true;
      }
      return false;
    case Value::Kind::kDict:
      if ((item.is_list() && !item.as_list().tuple) || item.is_dict() || item.is_object()) {
        throw RenderError("unhashable type: '" + type_name(item) + "'");
      }
      return item.is_string() && container.as_dict().find(item.as_string()) != nullptr;
    default:
      throw RenderError("argument of type '" + type_name(container) + "' is not iterable");
  }
}

}  // namespace tessera::chat::jinja
