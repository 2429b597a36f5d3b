// `recur generate`: the batching engine's command-line front end. All prompts are submitted at
// once and run concurrently up to --max-batch; results are printed in input order.
#include <fmt/format.h>
#include <sys/resource.h>

#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "cli/commands.h"
#include "cli/engine_options.h"
#include "engine/engine.h"
#include "io/mapped_file.h"
#include "server/json_constraint.h"

namespace recur::cli {

namespace {

using json = nlohmann::json;

struct GenerateOptions {
  EngineOptions engine;  // --model, --device, --max-batch, --seed, ...
  std::string prompt, prompt_ids, prompts_file;
  int max_tokens = 16;
  std::optional<float> temperature, top_p;
  std::optional<int> top_k;
  bool ignore_eos = false;
  bool stats = false;
  int64_t stats_every = 0;
  bool text = false;
  std::string prompt_cache;  // the prefix cache's file: read first, written at the end
  std::string json_schema;   // structured outputs: a JSON schema's file, or "object"
};

Result<std::vector<int32_t>> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      long v = std::stol(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(item);
      ids.push_back(int32_t(v));
    } catch (const std::exception&) {
      return make_error(ErrorCode::kInvalidArgument, "--prompt-ids: '{}' is not a token id", item);
    }
  }
  if (ids.empty()) return make_error(ErrorCode::kInvalidArgument, "--prompt-ids is empty");
  return ids;
}

struct Input {
  std::vector<int32_t> ids;
  int max_tokens;
};

Result<std::vector<Input>> read_inputs(const GenerateOptions& o, const Tokenizer* tok) {
  std::vector<Input> inputs;
  auto encode = [&](const std::string& text,
                    const std::string& where) -> Result<std::vector<int32_t>> {
    if (!tok) {
      return make_error(
          ErrorCode::kInvalidArgument,
          "{}: text prompts need tokenizer.json or tiktoken.model in the model directory", where);
    }
    return tok->encode(text);
  };
  const int given = !o.prompt.empty() + !o.prompt_ids.empty() + !o.prompts_file.empty();
  if (given != 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "give exactly one of --prompt, --prompt-ids, --prompts");
  }
  if (!o.prompt_ids.empty()) {
    RECUR_ASSIGN_OR_RETURN(auto ids, parse_ids(o.prompt_ids));
    inputs.push_back({std::move(ids), o.max_tokens});
  } else if (!o.prompt.empty()) {
    RECUR_ASSIGN_OR_RETURN(auto ids, encode(o.prompt, "--prompt"));
    inputs.push_back({std::move(ids), o.max_tokens});
  } else {
    std::ifstream in(o.prompts_file);
    if (!in) return make_error(ErrorCode::kNotFound, "cannot open {}", o.prompts_file);
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = fmt::format("{}:{}", o.prompts_file, n);
      json j = json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.is_object()) {
        return make_error(ErrorCode::kInvalidArgument, "{}: not a JSON object", where);
      }
      Input input{{}, o.max_tokens};
      if (j.contains("ids") && j["ids"].is_array()) {
        for (auto& v : j["ids"]) {
          if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
            return make_error(ErrorCode::kInvalidArgument, "{}: ids must be token ids", where);
          }
          input.ids.push_back(int32_t(v.get<int64_t>()));
        }
      } else if (j.contains("prompt") && j["prompt"].is_string()) {
        RECUR_ASSIGN_OR_RETURN(input.ids, encode(j["prompt"].get<std::string>(), where));
      } else if (j.contains("ids") || j.contains("prompt")) {
        return make_error(ErrorCode::kInvalidArgument,
                          "{}: \"ids\" must be a list of token ids, \"prompt\" a string", where);
      } else {
        return make_error(ErrorCode::kInvalidArgument, "{}: needs \"ids\" or \"prompt\"", where);
      }
      if (j.contains("max_tokens")) {
        if (!j["max_tokens"].is_number_integer()) {
          return make_error(ErrorCode::kInvalidArgument, "{}: max_tokens must be an integer",
                            where);
        }
        input.max_tokens = j["max_tokens"].get<int>();
      }
      inputs.push_back(std::move(input));
    }
  }
  return inputs;
}

json stats_json(const EngineStats& s) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return json{
      {"prompt_tokens", s.prompt_tokens},
      {"generated_tokens", s.generated_tokens},
      {"prefill_tok_s", s.prefill_seconds > 0 ? double(s.prompt_tokens) / s.prefill_seconds : 0.0},
      {"decode_tok_s",
       s.decode_seconds > 0 ? double(s.decode_step_tokens) / s.decode_seconds : 0.0},
      {"live_buffers", s.alloc.live_buffers},
      {"live_bytes", s.alloc.live_bytes},
      {"allocs_total", s.alloc.allocs_total},
      {"kv_blocks_used", s.kv_blocks_used},
      {"kv_blocks_total", s.kv_blocks_total},
      {"state_slots_used", s.slots_used},
      {"state_slots_total", s.slots_total},
      {"steps", s.steps},
      {"prefix_cache_hit_tokens", s.prefix_hit_tokens},
      {"prefix_cache_snapshots", s.prefix_snapshots},
      {"peak_rss_bytes", int64_t(ru.ru_maxrss) * 1024}};
}

struct Output {
  std::vector<int32_t> ids;
  std::string text;
  std::string finish_reason;
  std::string message;
  bool done = false;
};

int run_generate(const GenerateOptions& o) {
  auto fail = [](const Error& e) {
    fmt::print(stderr, "error: {}\n", e.to_string());
    return 2;
  };
  std::unique_ptr<Tokenizer> tokenizer;
  const std::string& model = o.engine.model;
  std::error_code ec;
  if (!std::filesystem::is_directory(model, ec)) {
    return fail(make_error(ErrorCode::kNotFound, "--model {}: no such directory", model));
  }
  if (!o.prompt_cache.empty()) {  // a file that cannot be written fails now, not after the run
    const auto dir = std::filesystem::absolute(o.prompt_cache, ec).parent_path();
    if (!std::filesystem::is_directory(dir, ec)) {
      return fail(make_error(ErrorCode::kNotFound, "--prompt-cache {}: no directory {}",
                             o.prompt_cache, dir.string()));
    }
  }
  if (Tokenizer::found_in(model)) {
    auto t = Tokenizer::load(model);
    if (!t.ok()) return fail(t.error());
    tokenizer = std::make_unique<Tokenizer>(std::move(*t));
  }
  auto inputs = read_inputs(o, tokenizer.get());
  if (!inputs.ok()) return fail(inputs.error());

  auto ops_r = create_backend(o.engine);
  if (!ops_r.ok()) return fail(ops_r.error());
  Ops& ops = **ops_r;
  EngineConfig config = engine_config(o.engine);
  config.prefix_cache_file = o.prompt_cache;
  auto engine = Engine::create(model, ops, config, tokenizer.get());
  if (!engine.ok()) return fail(engine.error());
  Engine& eng = **engine;
  for (const std::string& note : eng.notes()) fmt::print(stderr, "{}\n", note);

  // The engine ends a completion when the context is full, whatever --max-tokens says: say so
  // now rather than let the output look cut short.
  const int context = eng.config().max_context;
  for (size_t i = 0; i < inputs->size(); ++i) {
    const Input& in = (*inputs)[i];
    if (int64_t(in.ids.size()) + in.max_tokens > context) {
      fmt::print(stderr,
                 "warning: prompt {}: {} prompt tokens + max tokens {} exceed the {}-token "
                 "context; the completion stops when the context is full (finish_reason "
                 "length)\n",
                 i, in.ids.size(), in.max_tokens, context);
    }
  }

  // Structured outputs, as the server's response_format gives them.
  std::shared_ptr<const ConstraintSpec> constraint;
  if (!o.json_schema.empty()) {
    if (!tokenizer)
      return fail(
          make_error(ErrorCode::kInvalidArgument, "--json-schema needs the model's tokenizer"));
    std::shared_ptr<const server::CompiledSchema> schema = server::any_json_object_schema();
    if (o.json_schema != "object") {
      auto text = read_text_file(o.json_schema, 1 << 20);
      if (!text.ok()) return fail(text.error());
      const auto parsed = server::ojson::parse(*text, nullptr, false);
      if (parsed.is_discarded()) {
        return fail(make_error(ErrorCode::kInvalidArgument, "{}: not JSON", o.json_schema));
      }
      auto compiled = server::compile_json_schema(parsed, o.json_schema);
      if (!compiled.ok()) {
        return fail(make_error(ErrorCode::kInvalidArgument, "{}", compiled.error().message));
      }
      schema = *compiled;
    }
    constraint = server::json_constraint(schema, server::VocabularyBytes::build(*tokenizer),
                                         eng.model_info().eos_token_ids, "");
  }

  SamplingParams sp = default_sampling(eng.model_info().generation);
  if (o.temperature) sp.temperature = *o.temperature;
  if (o.top_k) sp.top_k = *o.top_k;
  if (o.top_p) sp.top_p = *o.top_p;
  sp.seed = o.engine.seed;

  std::vector<Output> outputs(inputs->size());
  std::mutex mu;
  std::condition_variable cv;
  size_t finished = 0;
  int64_t tokens_seen = 0;
  for (size_t i = 0; i < inputs->size(); ++i) {
    Request req;
    req.prompt = (*inputs)[i].ids;
    req.max_tokens = (*inputs)[i].max_tokens;
    req.sampling = sp;
    req.stop.ignore_eos = o.ignore_eos;
    req.constraint = constraint;
    auto id = eng.submit(std::move(req), [&, i](const Event& ev) {
      Output& out = outputs[i];
      out.text += ev.text;
      if (ev.kind == Event::Kind::kToken) {
        out.ids.push_back(ev.token);
        if (o.stats_every > 0 && ++tokens_seen % o.stats_every == 0) {
          json j = stats_json(eng.stats());
          j["at_generated_token"] = tokens_seen;
          fmt::print(stderr, "{}\n", j.dump());
        }
        return;
      }
      out.finish_reason = finish_reason_name(ev.reason);
      out.message = ev.message;
      std::lock_guard<std::mutex> lk(mu);
      out.done = true;
      ++finished;
      cv.notify_all();
    });
    if (!id.ok()) {
      return fail(Error{id.error().code, fmt::format("prompt {}: {}", i, id.error().message)});
    }
  }
  eng.start();
  {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return finished == outputs.size(); });
  }
  bool any_error = false;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Output& out = outputs[i];
    if (!o.prompts_file.empty()) {
      json j = {{"index", i}, {"ids", out.ids}, {"finish_reason", out.finish_reason}};
      if (!out.message.empty()) j["finish_detail"] = out.message;
      if (tokenizer) j["text"] = out.text;
      fmt::print("{}\n", j.dump(-1, ' ', false, json::error_handler_t::replace));
    } else {
      if (o.text && tokenizer) {
        fmt::print("{}\n", out.text);
      } else {
        for (size_t k = 0; k < out.ids.size(); ++k) fmt::print("{}{}", k ? "," : "", out.ids[k]);
        fmt::print("\n");
      }
      // Why the completion ended, beside the ids on stdout: "length" alone does not say
      // whether --max-tokens or the context ended it.
      std::fflush(stdout);
      fmt::print(stderr, "prompt {}: finish_reason={}{}, {} tokens\n", i, out.finish_reason,
                 out.message.empty() || out.finish_reason == "error" ? std::string()
                                                                     : " (" + out.message + ")",
                 out.ids.size());
    }
    if (out.finish_reason == "error") {
      fmt::print(stderr, "prompt {}: error: {}\n", i, out.message);
      any_error = true;
    }
  }
  std::fflush(stdout);
  if (o.stats) fmt::print(stderr, "{}\n", stats_json(eng.stats()).dump());
  if (!o.prompt_cache.empty()) {
    const Status saved = eng.save_prefix_cache();
    if (!saved.ok()) return fail(saved.error());
    fmt::print(stderr, "prefix cache written to {}\n", o.prompt_cache);
  }
  return any_error ? 1 : 0;
}

}  // namespace

void register_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Generate from prompts through the batching engine");
  auto o = std::make_shared<GenerateOptions>();
  add_engine_options(cmd, &o->engine, "seed for reproducible sampling");
  cmd->add_option("--prompt", o->prompt, "prompt text (needs tokenizer.json or tiktoken.model)");
  cmd->add_option("--prompt-ids", o->prompt_ids, "prompt as comma-separated token ids");
  cmd->add_option(
      "--prompts", o->prompts_file,
      "JSON lines, each {\"ids\": [...]} or {\"prompt\": \"...\"}, optional max_tokens");
  cmd->add_option("--prompt-cache", o->prompt_cache,
                  "prefix-cache file: prompts starting like those of an earlier run with the same "
                  "file reuse their state; written at the end");
  cmd->add_option("--max-tokens", o->max_tokens, "tokens to generate per prompt")
      ->check(CLI::Range(1, 1 << 30));
  cmd->add_option("--temperature", o->temperature, "0: greedy (default: generation_config.json)");
  cmd->add_option("--top-p", o->top_p, "nucleus sampling")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--top-k", o->top_k, "top-k sampling (0: off)")->check(CLI::Range(0, 1 << 30));
  cmd->add_flag("--ignore-eos", o->ignore_eos, "keep generating past end-of-sequence tokens");
  cmd->add_option("--json-schema", o->json_schema,
                  "structured outputs: only text that a JSON value of this schema file (or "
                  "\"object\": any JSON object) can begin with");
  cmd->add_flag("--stats", o->stats, "print engine statistics as JSON on stderr at the end");
  cmd->add_option("--stats-every", o->stats_every, "print statistics every N generated tokens");
  cmd->add_flag("--text", o->text, "print the generated text instead of ids (single prompt)");
  cmd->callback([o] {
    int rc = run_generate(*o);
    if (rc != 0) exit_with(rc);
  });
}

}  // namespace recur::cli
