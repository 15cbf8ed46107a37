// Lexer and parser of the Jinja subset, with the whitespace handling transformers uses
// (trim_blocks, lstrip_blocks, '-' / '+' markers, newlines normalized, one trailing newline
// dropped). Unsupported syntax fails with spade::Error naming the construct and line.
#pragma once
#include <string>

#include "tokenizer/jinja/ast.h"

namespace spade::jinja {

Body parse_template(const std::string& source);

}  // namespace spade::jinja
