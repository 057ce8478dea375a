#include "driver/cli/cli_help.h"

#include <algorithm>

namespace tessera {

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The subcommand the parse reached: the deepest one that was given.
const CLI::App* deepest(const CLI::App& app) {
  const CLI::App* at = &app;
  for (;;) {
    const std::vector<const CLI::App*> given =
        at->get_subcommands([](const CLI::App* sub) { return sub->parsed(); });
    if (given.empty()) return at;
    at = given.front();
  }
}

}  // namespace

std::string nearest_name(const std::string& wrong, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = 0;
  for (const std::string& c : candidates) {
    const size_t d = edit_distance(wrong, c);
    if (best.empty() || d < best_distance) {
      best = c;
      best_distance = d;
    }
  }
  if (best.empty()) return "";
  const size_t longer = std::max(wrong.size(), best.size());
  return best_distance <= 3 && best_distance * 3 <= longer ? best : "";
}

std::string unknown_argument_hints(const CLI::App& app) {
  const CLI::App* at = deepest(app);
  std::vector<std::string> flags;
  for (const CLI::App* a = at; a != nullptr; a = a->get_parent()) {
    for (const CLI::Option* opt : a->get_options()) {
      for (const std::string& name : opt->get_lnames()) flags.push_back("--" + name);
    }
  }
  std::vector<std::string> words;
  for (const CLI::App* sub : at->get_subcommands([](const CLI::App*) { return true; })) {
    if (!sub->get_name().empty() && !sub->get_group().empty()) words.push_back(sub->get_name());
  }
  std::string out;
  for (const std::string& arg : app.remaining(true)) {
    std::string name = arg;
    std::string hint;
    if (name.rfind("--", 0) == 0) {
      name = name.substr(0, name.find('='));
      hint = nearest_name(name, flags);
    } else if (!name.empty() && name[0] != '-') {
      hint = nearest_name(name, words);
    }
    if (!hint.empty() && hint != name) {
      out += "tessera: unknown argument '" + name + "': did you mean '" + hint + "'?\n";
    }
  }
  return out;
}

void add_examples(CLI::App* cmd, const std::vector<std::string>& lines) {
  std::string text = "\nExample" + std::string(lines.size() > 1 ? "s" : "") + ":";
  for (const std::string& line : lines) text += "\n  " + line;
  cmd->footer(text);
}

}  // namespace tessera
