// Reading the JSON files of a tokenizer directory, with errors that name the file.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace tessera::tokenizer {

// The contents of `path`. NOT_FOUND "<path>: no such file" when it does not exist,
// INVALID_ARGUMENT when it cannot be read.
Expected<std::string> read_text_file(const std::string& path);

// Parses `text`. INVALID_ARGUMENT "<origin>: malformed JSON: <parser message>" on a syntax
// error.
Expected<nlohmann::json> parse_json(std::string_view text, std::string_view origin);

// `v` as an integer in [lo, hi]. INVALID_ARGUMENT "<what> must be an integer in [lo, hi], got
// <v>" for anything else: a float (whose conversion to an integer type would be undefined when
// out of range), a string, an integer out of range.
Expected<int64_t> json_integer(const nlohmann::json& v, int64_t lo, int64_t hi,
                               std::string_view what);

}  // namespace tessera::tokenizer
