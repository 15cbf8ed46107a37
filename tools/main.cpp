// `spade` CLI entry: dispatches to the registered sub-commands; every spade::Error becomes
// a one-line message on stderr and exit status 1.
#include <cstdio>
#include <cstring>
#include <exception>

#include "command.h"
#include "core/error.h"
#include "spade_version.h"  // generated: SPADE_VERSION, SPADE_COMMIT

namespace spade::cli {
std::map<std::string, Command>& commands() {
  static std::map<std::string, Command> m;
  return m;
}
}  // namespace spade::cli

static void usage() {
  std::fprintf(stderr, "usage: spade <command> [options]\n\ncommands:\n");
  for (auto& [name, c] : spade::cli::commands())
    std::fprintf(stderr, "  %-10s %s\n", name.c_str(), c.summary.c_str());
  std::fprintf(stderr, "\n'spade <command> --help' describes a command's options.\n");
}

int main(int argc, char** argv) {
  if (argc >= 2 && (!std::strcmp(argv[1], "--version") || !std::strcmp(argv[1], "version"))) {
    std::printf("spade %s (commit %s)\n", SPADE_VERSION, SPADE_COMMIT);
    return 0;
  }
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  auto& cmds = spade::cli::commands();
  auto it = cmds.find(argv[1]);
  if (it == cmds.end()) {
    std::fprintf(stderr, "spade: unknown command '%s'\n", argv[1]);
    usage();
    return 2;
  }
  try {
    return it->second.run(argc - 1, argv + 1);
  } catch (const spade::Error& e) {
    std::fprintf(stderr, "spade %s: error: %s\n", argv[1], e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spade %s: internal error: %s\n", argv[1], e.what());
    return 1;
  }
}
