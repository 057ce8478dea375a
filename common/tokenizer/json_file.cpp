#include "common/tokenizer/json_file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace tessera::tokenizer {

Expected<std::string> read_text_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return not_found(path + ": no such file");
  if (std::filesystem::is_directory(path, ec)) {
    return invalid_argument(path + ": is a directory, not a file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return invalid_argument(path + ": cannot be read (" + std::strerror(errno) + ")");
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) return invalid_argument(path + ": read failed");
  return contents.str();
}

Expected<nlohmann::json> parse_json(std::string_view text, std::string_view origin) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for 1e999
    return invalid_argument(std::string(origin) + ": malformed JSON: " + e.what());
  }
}

Expected<int64_t> json_integer(const nlohmann::json& v, int64_t lo, int64_t hi,
                               std::string_view what) {
  bool ok = false;
  int64_t value = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    ok = u <= static_cast<uint64_t>(INT64_MAX);
    value = ok ? static_cast<int64_t>(u) : 0;
  } else if (v.is_number_integer()) {
    value = v.get<int64_t>();
    ok = true;
  }
  if (!ok || value < lo || value > hi) {
    return invalid_argument(std::string(what) + " must be an integer in [" + std::to_string(lo) +
                            ", " + std::to_string(hi) + "], got " + v.dump());
  }
  return value;
}

}  // namespace tessera::tokenizer
