// Help for people typing `tessera` commands: the nearest valid name to a mistyped flag or
// subcommand, and an example line at the end of every subcommand's --help.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace tessera {

// The candidate nearest to `wrong` by edit distance when it is close enough to be a typo (at
// most 3 edits and at most a third of the longer name), else "". Ties go to the first.
std::string nearest_name(const std::string& wrong, const std::vector<std::string>& candidates);

// After a failed parse of `app`: one "did you mean ...?" line per argument nobody expected: a
// flag against the long flags of the subcommand it followed and of that subcommand's parents, a
// word against that subcommand's subcommands. "" when there is nothing to suggest.
std::string unknown_argument_hints(const CLI::App& app);

// Ends `cmd`'s --help with "Example:" and the given command lines.
void add_examples(CLI::App* cmd, const std::vector<std::string>& lines);

}  // namespace tessera
