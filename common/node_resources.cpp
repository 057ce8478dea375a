#include "common/node_resources.h"

#include <algorithm>

#include "common/status.h"

namespace tessera {

std::string gpu_label(const GpuDevice& gpu) { return "GPU" + std::to_string(gpu.index); }

const GpuLink& gpu_link(const NodeResources& r, size_t a, size_t b) {
  const size_t n = r.gpus.size();
  TESSERA_CHECK(a < n && b < n && r.links.size() == n * n, "GPU link index out of range");
  return r.links[a * n + b];
}

std::string link_name(const GpuLink& link) {
  switch (link.kind) {
    case LinkKind::kSelf:
      return "X";
    case LinkKind::kNvlink:
      return "NV" + std::to_string(link.nvlinks);
    case LinkKind::kPix:
      return "PIX";
    case LinkKind::kPxb:
      return "PXB";
    case LinkKind::kPhb:
      return "PHB";
    case LinkKind::kNode:
      return "NODE";
    case LinkKind::kSys:
      return "SYS";
    case LinkKind::kUnknown:
      break;
  }
  return "N/A";
}

std::string format_link_matrix(const NodeResources& r) {
  const size_t n = r.gpus.size();
  if (n == 0) return "";
  std::vector<std::string> labels;
  size_t width = 0;
  for (const GpuDevice& gpu : r.gpus) {
    labels.push_back(gpu_label(gpu));
    width = std::max(width, labels.back().size());
  }
  std::vector<std::string> cells;
  for (size_t i = 0; i < n * n; ++i) {
    cells.push_back(i < r.links.size() ? link_name(r.links[i]) : link_name(GpuLink{}));
    width = std::max(width, cells.back().size());
  }
  width += 2;

  std::string out;
  auto append_row = [&](const std::string& first, auto cell) {
    std::string line = first;
    line.resize(width, ' ');
    for (size_t c = 0; c < n; ++c) {
      line += cell(c);
      if (c + 1 < n) line.resize(width * (c + 2), ' ');
    }
    out += line;
    out += '\n';
  };
  append_row("", [&](size_t c) { return labels[c]; });
  for (size_t row = 0; row < n; ++row) {
    append_row(labels[row], [&](size_t c) { return cells[row * n + c]; });
  }
  return out;
}

}  // namespace tessera
