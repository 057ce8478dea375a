// Typed reading of a JSON object's fields for the config.json parsers (model_config.cpp,
// quantization.cpp): every error names the file and the field ("config.json: hidden_size must be
// a positive integer, got -1"). Internal to common/checkpoint.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace tessera::json_fields {

inline std::string type_name(const nlohmann::json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_string()) return "\"" + v.get<std::string>() + "\"";
  if (v.is_number()) return v.dump();
  if (v.is_array()) return "a list";
  return "an object";
}

// Typed access to one JSON object's fields; every error names the file and the field.
class Fields {
 public:
  Fields(const nlohmann::json& obj, const std::string& file, std::string prefix = "")
      : obj_(obj), file_(file), prefix_(std::move(prefix)) {}

  bool has(const char* key) const { return obj_.contains(key); }
  // Present and not null.
  bool given(const char* key) const { return has(key) && !obj_.at(key).is_null(); }
  const nlohmann::json& at(const char* key) const { return obj_.at(key); }

  Status error(const char* key, const std::string& what) const {
    return invalid_argument(file_ + ": " + prefix_ + key + " " + what);
  }

  // An integer (an integral float such as 4096.0 is accepted too).
  Expected<int64_t> integer(const char* key) const {
    const nlohmann::json& v = obj_.at(key);
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) {
        return error(key, "is out of range, got " + v.dump());
      }
      return v.get<int64_t>();
    }
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) {
        return static_cast<int64_t>(d);
      }
    }
    return error(key, "must be an integer, got " + type_name(v));
  }

  // Required positive integer.
  Expected<int64_t> positive(const char* key) const {
    if (!has(key)) return error(key, "is missing (a positive integer is required)");
    TESSERA_ASSIGN_OR_RETURN(int64_t v, integer(key));
    if (v <= 0) return error(key, "must be a positive integer, got " + std::to_string(v));
    return v;
  }

  // Positive integer, or `fallback` when absent or null.
  Expected<int64_t> positive_or(const char* key, int64_t fallback) const {
    if (!given(key)) return fallback;
    return positive(key);
  }

  Expected<double> number_or(const char* key, double fallback) const {
    if (!given(key)) return fallback;
    const nlohmann::json& v = obj_.at(key);
    if (!v.is_number()) return error(key, "must be a number, got " + type_name(v));
    return v.get<double>();
  }

  Expected<double> positive_number_or(const char* key, double fallback) const {
    TESSERA_ASSIGN_OR_RETURN(double v, number_or(key, fallback));
    if (!(v > 0) || !std::isfinite(v)) {
      return error(key, "must be a positive number, got " + obj_.at(key).dump());
    }
    return v;
  }

  Expected<bool> boolean_or(const char* key, bool fallback) const {
    if (!given(key)) return fallback;
    const nlohmann::json& v = obj_.at(key);
    if (!v.is_boolean()) return error(key, "must be true or false, got " + type_name(v));
    return v.get<bool>();
  }

  // A token id: a non-negative integer, or unset when absent/null.
  Expected<std::optional<int64_t>> token_id(const char* key) const {
    if (!given(key)) return std::optional<int64_t>();
    TESSERA_ASSIGN_OR_RETURN(int64_t v, integer(key));
    if (v < 0) return error(key, "must be a non-negative token id, got " + std::to_string(v));
    return std::optional<int64_t>(v);
  }

  // eos_token_id: an int or a list of ints; empty when absent/null.
  Expected<std::vector<int64_t>> token_ids(const char* key) const {
    std::vector<int64_t> ids;
    if (!given(key)) return ids;
    const nlohmann::json& v = obj_.at(key);
    if (v.is_array()) {
      for (size_t i = 0; i < v.size(); ++i) {
        const nlohmann::json& e = v[i];
        if (!e.is_number_integer() || e.get<int64_t>() < 0) {
          return error(key, "must be a token id or a list of token ids; element " +
                                std::to_string(i) + " is " + type_name(e));
        }
        ids.push_back(e.get<int64_t>());
      }
      return ids;
    }
    TESSERA_ASSIGN_OR_RETURN(std::optional<int64_t> id, token_id(key));
    ids.push_back(*id);
    return ids;
  }

  // An integer, or `fallback` when absent or null.
  Expected<int64_t> integer_or(const char* key, int64_t fallback) const {
    if (!given(key)) return fallback;
    return integer(key);
  }

  // A string, or `fallback` when absent or null.
  Expected<std::string> text_or(const char* key, const std::string& fallback) const {
    if (!given(key)) return fallback;
    const nlohmann::json& v = obj_.at(key);
    if (!v.is_string()) return error(key, "must be a string, got " + type_name(v));
    return v.get<std::string>();
  }

  // A list of strings; empty when absent or null.
  Expected<std::vector<std::string>> strings(const char* key) const {
    std::vector<std::string> out;
    if (!given(key)) return out;
    const nlohmann::json& v = obj_.at(key);
    if (!v.is_array()) return error(key, "must be a list of strings, got " + type_name(v));
    for (const nlohmann::json& e : v) {
      if (!e.is_string()) return error(key, "must hold strings, got " + type_name(e));
      out.push_back(e.get<std::string>());
    }
    return out;
  }

 private:
  const nlohmann::json& obj_;
  const std::string& file_;
  std::string prefix_;
};

}  // namespace tessera::json_fields
