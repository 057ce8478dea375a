// Helpers shared by the checkpoint tests: a temporary directory, file I/O, the test tokenizers.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace tessera::ckpt_test {

// A fresh directory under $TMPDIR, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "tessera-ckpt-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data()) ? tmpl : "";
    EXPECT_FALSE(path_.empty()) << "mkdtemp failed";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const {
    return (std::filesystem::path(path_) / name).string();
  }

 private:
  std::string path_;
};

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// The source tree: $TESSERA_SOURCE_DIR, else the one this test was built from.
inline std::string source_dir() {
  if (const char* env = std::getenv("TESSERA_SOURCE_DIR"); env != nullptr && *env != '\0') {
    return env;
  }
#ifdef TESSERA_SOURCE_DIR
  return TESSERA_SOURCE_DIR;
#else
  return ".";
#endif
}

// tests/assets/tokenizers/<name> (llama3, qwen3, llama2), fetched by scripts/fetch-test-assets;
// "" when absent.
inline std::string tokenizer_dir(const std::string& name) {
  const auto dir = std::filesystem::path(source_dir()) / "tests/assets/tokenizers" / name;
  return std::filesystem::exists(dir / "tokenizer.json") ? dir.string() : "";
}

}  // namespace tessera::ckpt_test
