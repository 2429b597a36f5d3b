// `recur tokenize`: placeholder until the tokenizer lands.
#include "cli/commands.h"

namespace recur::cli {
void register_tokenize(CLI::App& app) { (void)app; }
}  // namespace recur::cli
