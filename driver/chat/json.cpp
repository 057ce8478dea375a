// Values to and from JSON: Python's json.dumps (as transformers' tojson filter calls it) and
// the conversion of request data into template values.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "driver/chat/py_string.h"
#include "driver/chat/value.h"

namespace tessera::chat::jinja {
namespace {

void append_json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  for (char32_t c : py::decode(s)) {
    char buf[16];
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || (ensure_ascii && c >= 0x7F)) {
          if (c >= 0x10000) {
            char32_t v = c - 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x",
                          0xD800 + static_cast<unsigned>(v >> 10),
                          0xDC00 + static_cast<unsigned>(v & 0x3FF));
          } else {
            std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          }
          out += buf;
        } else {
          py::append_utf8(out, c);
        }
    }
  }
  out += '"';
}

class JsonWriter {
 public:
  explicit JsonWriter(const JsonOptions& options) : options_(options) {}

  void write(const Value& v, int level) {
    if (level > kMaxValueDepth) throw RenderError("value nests too deeply for tojson");
    if (out_.size() > kMaxStringBytes) throw RenderError("tojson: output too long");
    switch (v.kind()) {
      case Value::Kind::kNone:
        out_ += "null";
        return;
      case Value::Kind::kBool:
        out_ += v.as_bool() ? "true" : "false";
        return;
      case Value::Kind::kInt:
        out_ += std::to_string(v.as_int());
        return;
      case Value::Kind::kFloat: {
        double d = v.as_float();
        if (std::isnan(d)) {
          out_ += "NaN";
        } else if (std::isinf(d)) {
          out_ += d > 0 ? "Infinity" : "-Infinity";
        } else {
          out_ += format_float(d);
        }
        return;
      }
      case Value::Kind::kString:
        append_json_string(out_, v.as_string(), options_.ensure_ascii);
        return;
      case Value::Kind::kList: {
        const auto& items = v.as_list().items;
        if (items.empty()) {
          out_ += "[]";
          return;
        }
        out_ += '[';
        for (size_t i = 0; i < items.size(); ++i) {
          if (i > 0) out_ += options_.item_separator;
          newline(level + 1);
          write(items[i], level + 1);
        }
        newline(level);
        out_ += ']';
        return;
      }
      case Value::Kind::kDict: {
        std::vector<const std::pair<std::string, Value>*> items;
        for (const auto& kv : v.as_dict().items) items.push_back(&kv);
        if (items.empty()) {
          out_ += "{}";
          return;
        }
        if (options_.sort_keys) {
          std::stable_sort(items.begin(), items.end(),
                           [](auto* a, auto* b) { return a->first < b->first; });
        }
        out_ += '{';
        for (size_t i = 0; i < items.size(); ++i) {
          if (i > 0) out_ += options_.item_separator;
          newline(level + 1);
          append_json_string(out_, items[i]->first, options_.ensure_ascii);
          out_ += options_.key_separator;
          write(items[i]->second, level + 1);
        }
        newline(level);
        out_ += '}';
        return;
      }
      default:
        throw RenderError("Object of type " + type_name(v) + " is not JSON serializable");
    }
  }

  std::string take() { return std::move(out_); }

 private:
  void newline(int level) {
    if (!options_.indent) return;
    out_ += '\n';
    for (int i = 0; i < level; ++i) out_ += *options_.indent;
  }

  const JsonOptions& options_;
  std::string out_;
};

template <typename Json>
Value convert(const Json& j, int depth) {
  if (depth > kMaxValueDepth) throw RenderError("JSON input nests too deeply");
  switch (j.type()) {
    case Json::value_t::null:
      return Value::none();
    case Json::value_t::boolean:
      return Value::boolean(j.template get<bool>());
    case Json::value_t::number_integer:
      return Value::integer(j.template get<int64_t>());
    case Json::value_t::number_unsigned: {
      auto u = j.template get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Value::integer(static_cast<int64_t>(u));
      return Value::number(static_cast<double>(u));
    }
    case Json::value_t::number_float:
      return Value::number(j.template get<double>());
    case Json::value_t::string:
      return Value::string(j.template get<std::string>());
    case Json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(convert(item, depth + 1));
      return Value::list(std::move(items));
    }
    case Json::value_t::object: {
      std::vector<std::pair<std::string, Value>> items;
      items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) {
        items.emplace_back(it.key(), convert(it.value(), depth + 1));
      }
      return Value::dict(std::move(items));
    }
    default:  // binary, discarded
      throw RenderError("unsupported JSON value");
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonOptions& options) {
  JsonWriter writer(options);
  writer.write(v, 0);
  return writer.take();
}

Value from_json(const nlohmann::json& j) { return convert(j, 0); }
Value from_json(const nlohmann::ordered_json& j) { return convert(j, 0); }

}  // namespace tessera::chat::jinja
