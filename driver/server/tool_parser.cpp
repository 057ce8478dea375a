#include "driver/server/tool_parser.h"

#include <nlohmann/json.hpp>
#include <random>

namespace tessera::server {

namespace {

constexpr const char* kOpen = "<tool_call>";
constexpr const char* kClose = "</tool_call>";

std::string call_id() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng()));
  return std::string("chatcmpl-tool-") + buf;
}

// One block's JSON as a call, or nullopt when it is not {"name": string, "arguments": ...}.
std::optional<ToolCall> to_call(const std::string& body) {
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return std::nullopt;
  ToolCall c;
  c.id = call_id();
  c.name = j["name"].get<std::string>();
  const auto args = j.contains("arguments") ? j["arguments"] : nlohmann::json::object();
  c.arguments = args.is_string() ? args.get<std::string>() : args.dump();
  return c;
}

// Length of the longest suffix of `s` that is a proper prefix of `tag`.
size_t partial_tag(const std::string& s, const std::string& tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n) {
    if (s.compare(s.size() - n, n, tag, 0, n) == 0) return n;
  }
  return 0;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return {};
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

}  // namespace

ToolOutput parse_hermes(const std::string& text) {
  ToolOutput out;
  const size_t first = text.find(kOpen);
  if (first == std::string::npos) {
    out.content = text;
    return out;
  }
  std::string content = text.substr(0, first);
  size_t at = first;
  while (at != std::string::npos) {
    const size_t body = at + std::char_traits<char>::length(kOpen);
    const size_t end = text.find(kClose, body);
    std::optional<ToolCall> call =
        end == std::string::npos ? std::nullopt : to_call(trim(text.substr(body, end - body)));
    if (!call) {
      // Not a call after all: the rest is text.
      content += text.substr(at);
      break;
    }
    out.calls.push_back(std::move(*call));
    at = text.find(kOpen, end);
  }
  if (!trim(content).empty()) out.content = content;
  return out;
}

HermesStream::Delta HermesStream::push(const std::string& text) {
  Delta d;
  pending_ += text;
  while (true) {
    if (!in_block_) {
      const size_t open = pending_.find(kOpen);
      if (open == std::string::npos) {
        const size_t keep = partial_tag(pending_, kOpen);
        if (!seen_call_) d.content += pending_.substr(0, pending_.size() - keep);
        pending_.erase(0, pending_.size() - keep);
        return d;
      }
      if (!seen_call_) d.content += pending_.substr(0, open);
      pending_.erase(0, open + std::char_traits<char>::length(kOpen));
      in_block_ = true;
    }
    const size_t close = pending_.find(kClose);
    if (close == std::string::npos) return d;
    auto call = to_call(trim(pending_.substr(0, close)));
    if (call) {
      d.calls.push_back(std::move(*call));
      ++calls_;
      seen_call_ = true;
    } else if (!seen_call_) {
      d.content += std::string(kOpen) + pending_.substr(0, close) + kClose;
    }
    pending_.erase(0, close + std::char_traits<char>::length(kClose));
    in_block_ = false;
  }
}

HermesStream::Delta HermesStream::finish() {
  Delta d;
  if (!seen_call_) d.content = (in_block_ ? std::string(kOpen) : std::string()) + pending_;
  pending_.clear();
  in_block_ = false;
  return d;
}

}  // namespace tessera::server
