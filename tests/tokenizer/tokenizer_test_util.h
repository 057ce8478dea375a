// Shared by the tokenizer tests: where the real tokenizers and their goldens are, and loading
// them once per test binary.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "common/tokenizer/tokenizer.h"

namespace tessera::testing {

inline const char* const kTokenizerNames[] = {"llama3", "qwen3", "llama2"};

inline std::string tokenizer_dir(const std::string& name) {
  return std::string(TESSERA_SOURCE_DIR) + "/tests/assets/tokenizers/" + name;
}

inline std::string golden_path(const std::string& name) {
  return std::string(TESSERA_SOURCE_DIR) + "/tests/assets/goldens/tokenizer_" + name + ".json";
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The real tokenizer `name` as Tokenizer::load reads its directory (tokenizer_config.json's flags
// applied, as transformers does), loaded once. Fails the test (null) when the assets are missing.
inline const Tokenizer* real_tokenizer(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Tokenizer>> loaded;
  std::lock_guard lock(mu);
  if (auto it = loaded.find(name); it != loaded.end()) return it->second.get();
  std::string dir = tokenizer_dir(name);
  if (!std::filesystem::exists(dir + "/tokenizer.json")) {
    ADD_FAILURE() << dir << "/tokenizer.json is missing: run scripts/fetch-test-assets";
    return nullptr;
  }
  auto tok = Tokenizer::load(dir);
  if (!tok) {
    ADD_FAILURE() << "loading " << dir << ": " << tok.status().to_string();
    return nullptr;
  }
  return (loaded[name] = std::move(tok).value()).get();
}

// The tokenizer.json of `name` alone, loaded once: what the `tokenizers` library's
// Tokenizer.from_file builds, without tokenizer_config.json's flags (real_tokenizer has them).
inline const Tokenizer* raw_tokenizer(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Tokenizer>> loaded;
  std::lock_guard lock(mu);
  if (auto it = loaded.find(name); it != loaded.end()) return it->second.get();
  std::string path = tokenizer_dir(name) + "/tokenizer.json";
  if (!std::filesystem::exists(path)) {
    ADD_FAILURE() << path << " is missing: run scripts/fetch-test-assets";
    return nullptr;
  }
  auto tok = Tokenizer::from_json(read_file(path), {}, path);
  if (!tok) {
    ADD_FAILURE() << "loading " << path << ": " << tok.status().to_string();
    return nullptr;
  }
  return (loaded[name] = std::move(tok).value()).get();
}

// The goldens of `name` (tests/assets/goldens/tokenizer_<name>.json), parsed once.
inline const nlohmann::json& golden(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, nlohmann::json> parsed;
  std::lock_guard lock(mu);
  if (auto it = parsed.find(name); it != parsed.end()) return it->second;
  std::string path = golden_path(name);
  // Without the file: no cases (the tests that need more check for it).
  nlohmann::json j = {{"cases", nlohmann::json::array()},
                      {"decode_cases", nlohmann::json::array()}};
  if (!std::filesystem::exists(path)) {
    ADD_FAILURE() << path << " is missing (scripts/goldens/tokenizer_goldens.py writes it)";
  } else {
    j = nlohmann::json::parse(read_file(path));
  }
  return parsed[name] = std::move(j);
}

// True if `s` is well-formed UTF-8.
inline bool valid_utf8(const std::string& s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    auto b = static_cast<unsigned char>(s[i]);
    size_t len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > n) return false;
    uint32_t cp = len == 1 ? b : b & (0x7F >> len);
    for (size_t k = 1; k < len; ++k) {
      auto c = static_cast<unsigned char>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    static const uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

// Printable form of a text for failure messages.
inline std::string show(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace tessera::testing
