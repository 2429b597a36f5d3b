// `recur chat-template`: placeholder until the chat template engine lands.
#include "cli/commands.h"

namespace recur::cli {
void register_chat_template(CLI::App& app) { (void)app; }
}  // namespace recur::cli
