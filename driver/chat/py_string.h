// Python `str` semantics over UTF-8 strings: lengths, indices and slices count code points,
// whitespace is Python's str.isspace(), and the methods behave as Python's do.
//
// Bytes that are not valid UTF-8 decode to U+DC80..U+DCFF and encode back to the same byte
// (Python's surrogateescape), so no input is ever lost or refused.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::chat::jinja::py {

std::u32string decode(std::string_view s);
// The character at byte `i` of `s` (i < s.size()); *size is its length in bytes.
char32_t decode_at(std::string_view s, size_t i, size_t* size);
std::string encode(std::u32string_view s);
void append_utf8(std::string& out, char32_t c);

// Number of code points.
size_t length(std::string_view s);
// Python's str.isspace() for one character.
bool is_space(char32_t c);
// True when every character of `s` is Python whitespace (false for "").
bool all_space(std::string_view s);

// str.strip/lstrip/rstrip: `chars` absent strips whitespace.
std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left,
                  bool right);
// str.split(sep, maxsplit) and str.rsplit; `sep` absent splits on runs of whitespace.
// Throws RenderError for an empty separator.
std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep,
                               int64_t maxsplit);
std::vector<std::string> rsplit(std::string_view s, const std::optional<std::string>& sep,
                                int64_t maxsplit);
std::vector<std::string> splitlines(std::string_view s, bool keepends);
// str.replace(old, new, count); count < 0 replaces all.
std::string replace(std::string_view s, std::string_view old_part, std::string_view new_part,
                    int64_t count);
// str.find / str.count (indices in code points; -1 when absent).
int64_t find(std::string_view s, std::string_view part, bool reverse);
int64_t count(std::string_view s, std::string_view part);

// Case mapping: ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic (the rest unchanged).
std::string upper(std::string_view s);
std::string lower(std::string_view s);
// str.capitalize() and str.title().
std::string capitalize(std::string_view s);
std::string title(std::string_view s);

// Python's repr() of a string, with its choice of quotes.
std::string repr(std::string_view s);

// A resolved Python slice over a sequence of `length`: the indices start, start+step, ...
// (`count` of them).
struct SliceIndices {
  int64_t start = 0;
  int64_t step = 1;
  int64_t count = 0;
};
// Precondition: step is not 0.
SliceIndices resolve_slice(int64_t length, std::optional<int64_t> start,
                           std::optional<int64_t> stop, int64_t step);
std::string slice(std::string_view s, const SliceIndices& indices);

}  // namespace tessera::chat::jinja::py
