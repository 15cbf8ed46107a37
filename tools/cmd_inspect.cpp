// `spade inspect PATH`: describe a model file (format, config, tensors) without loading it.
#include <cstdio>

#include "args.h"
#include "command.h"
#include "model/inspect.h"

namespace spade::cli {
namespace {

const char* kHelp = R"(usage: spade inspect PATH

  PATH   GGUF file or Hugging Face model directory (config.json + safetensors)

Prints the architecture, config fields, every tensor's name, type and shape (as stored,
before dequantization), the parameter count and the context length.
)";

int run(int argc, char** argv) {
  Args a(argc, argv, {}, {"--help"});
  if (a.has("--help")) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  SPADE_CHECK(a.positional().size() == 1, "inspect expects exactly one PATH (see --help)");
  std::fputs(describe_model(a.positional()[0]).c_str(), stdout);
  return 0;
}

Registrar reg("inspect", "describe a model file: config, tensors, parameter count", run);

}  // namespace
}  // namespace spade::cli
