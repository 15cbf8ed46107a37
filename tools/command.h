// Sub-commands of the `spade` CLI register themselves here: one file per command
// (tools/cmd_<name>.cpp) defines a function and a static Registrar.
#pragma once
#include <functional>
#include <map>
#include <string>

namespace spade::cli {

struct Command {
  std::string summary;
  std::function<int(int argc, char** argv)> run;  // argv[0] is the command name
};

std::map<std::string, Command>& commands();

struct Registrar {
  Registrar(const std::string& name, const std::string& summary,
            std::function<int(int, char**)> run) {
    commands()[name] = Command{summary, std::move(run)};
  }
};

}  // namespace spade::cli
