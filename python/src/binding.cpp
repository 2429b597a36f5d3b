// Module `_recur`: the engine, tokenizer and chat template for the `recur` package, whose Python
// side (python/recur/) gives them mlx-lm's shapes. Engine errors become Python exceptions
// carrying the engine's message; the GIL is released while the engine computes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <nlohmann/json.hpp>

#include "model/weights.h"
#include "session.h"

namespace pyb = pybind11;
using recur::ErrorCode;

namespace {

[[noreturn]] void raise(const recur::Error& e) {
  switch (e.code) {
    case ErrorCode::kInvalidArgument:
      throw pyb::value_error(e.message);
    case ErrorCode::kNotFound:
      PyErr_SetString(PyExc_FileNotFoundError, e.message.c_str());
      throw pyb::error_already_set();
    default:
      throw std::runtime_error(e.to_string());
  }
}

template <typename T>
T unwrap(recur::Result<T> r) {
  if (!r.ok()) raise(r.error());
  return std::move(*r);
}

// The value among `values` whose CLI name (name_of) is `name`, or a ValueError naming `option`
// and every choice.
template <typename E, size_t N>
E from_name(const char* option, const std::string& name, const char* (*name_of)(E),
            const E (&values)[N]) {
  std::string choices;
  for (size_t i = 0; i < N; ++i) {
    if (name == name_of(values[i])) return values[i];
    choices += std::string(i == 0 ? "" : i + 1 == N ? " or " : ", ") + name_of(values[i]);
  }
  throw pyb::value_error(std::string(option) + ": " + choices + ", not '" + name + "'");
}

const recur::Tokenizer& need_tokenizer(const recur::py::Session& s) {
  if (!s.tokenizer()) {
    throw pyb::value_error(
        "this model directory has no tokenizer.json or tiktoken.model: give prompts as token "
        "lists");
  }
  return *s.tokenizer();
}

}  // namespace

PYBIND11_MODULE(_recur, m) {
  m.doc() = "recur's engine (use the recur package, not this module)";
  using recur::py::Session;
  using recur::py::SessionOptions;

  pyb::class_<SessionOptions>(m, "SessionOptions")
      .def(pyb::init([] {
        SessionOptions o;
        o.prefix_cache_mb = 0;  // off unless asked: a script's prompts rarely share prefixes
        return o;
      }))
      .def_readwrite("device", &SessionOptions::device)
      .def_readwrite("threads", &SessionOptions::threads)
      .def_readwrite("max_batch", &SessionOptions::max_batch)
      .def_readwrite("max_batch_tokens", &SessionOptions::max_batch_tokens)
      .def_readwrite("max_context", &SessionOptions::max_context)
      .def_readwrite("kv_cache_mb", &SessionOptions::kv_cache_mb)
      .def_readwrite("prefix_cache_mb", &SessionOptions::prefix_cache_mb)
      .def_readwrite("snapshot_interval", &SessionOptions::snapshot_interval)
      .def_readwrite("seed", &SessionOptions::seed)
      .def_readwrite("pipeline_decode", &SessionOptions::pipeline_decode)
      .def_readwrite("tensor_parallel", &SessionOptions::tensor_parallel)
      // Matmul weights converted at load, as --quantize spells it.
      .def_property(
          "quantize",
          [](const SessionOptions& o) { return std::string(recur::quantize_name(o.quantize)); },
          [](SessionOptions& o, const std::string& name) {
            using recur::Quantize;
            o.quantize =
                from_name("quantize", name, recur::quantize_name,
                          {Quantize::kNone, Quantize::kFp8, Quantize::kInt8, Quantize::kQ4});
          })
      // The attention cache's element type, as --kv-cache-dtype spells it.
      .def_property(
          "kv_cache_dtype",
          [](const SessionOptions& o) {
            return std::string(o.kv_cache_dtype == recur::DType::BF16      ? "bf16"
                               : o.kv_cache_dtype == recur::DType::F16     ? "f16"
                               : o.kv_cache_dtype == recur::DType::F8_E4M3 ? "fp8"
                                                                           : "f32");
          },
          [](SessionOptions& o, const std::string& name) {
            if (name == "f32") {
              o.kv_cache_dtype = recur::DType::F32;
            } else if (name == "bf16") {
              o.kv_cache_dtype = recur::DType::BF16;
            } else if (name == "f16") {
              o.kv_cache_dtype = recur::DType::F16;
            } else if (name == "fp8") {
              o.kv_cache_dtype = recur::DType::F8_E4M3;
            } else {
              throw pyb::value_error("kv_cache_dtype: f32, bf16, f16 or fp8, not '" + name + "'");
            }
          })
      // How prompts multiply block-FP8 weights on a GPU, as --fp8-activations spells it.
      .def_property(
          "fp8_activations",
          [](const SessionOptions& o) {
            return std::string(recur::fp8_activations_name(o.backend.fp8_activations));
          },
          [](SessionOptions& o, const std::string& name) {
            using recur::Fp8Activations;
            o.backend.fp8_activations =
                from_name("fp8_activations", name, recur::fp8_activations_name,
                          {Fp8Activations::kE4m3, Fp8Activations::kF16});
          })
      // How prompts multiply bf16/f16 weights on a GPU, as --prompt-activations spells it.
      .def_property(
          "prompt_activations",
          [](const SessionOptions& o) {
            return std::string(recur::prompt_activations_name(o.backend.prompt_activations));
          },
          [](SessionOptions& o, const std::string& name) {
            using recur::PromptActivations;
            o.backend.prompt_activations =
                from_name("prompt_activations", name, recur::prompt_activations_name,
                          {PromptActivations::kF16x2, PromptActivations::kF16});
          });

  pyb::class_<Session>(m, "Session")
      .def(pyb::init([](const std::string& dir, const SessionOptions& o) {
             recur::Result<std::unique_ptr<Session>> r = [&] {
               pyb::gil_scoped_release unlocked;
               return Session::open(dir, o);
             }();
             return unwrap(std::move(r));
           }),
           pyb::arg("model_dir"), pyb::arg("options"))
      .def(
          "submit",
          [](Session& s, std::vector<int32_t> prompt, int max_tokens,
             std::optional<float> temperature, std::optional<float> top_p,
             std::optional<float> min_p, std::optional<int> top_k, std::optional<uint64_t> seed,
             std::vector<int32_t> stop_tokens, std::vector<std::vector<int32_t>> stop_sequences,
             bool ignore_eos, int logprobs, bool vocab_logprobs) {
            const recur::py::PySampling sp{.temperature = temperature,
                                           .top_p = top_p,
                                           .min_p = min_p,
                                           .top_k = top_k,
                                           .seed = seed,
                                           .logprobs = logprobs,
                                           .vocab_logprobs = vocab_logprobs};
            recur::StopConditions stop;
            stop.ignore_eos = ignore_eos;
            stop.stop_token_ids = std::move(stop_tokens);
            stop.stop_sequences = std::move(stop_sequences);
            return unwrap(s.submit(std::move(prompt), max_tokens, sp, std::move(stop)));
          },
          pyb::arg("prompt"), pyb::arg("max_tokens"), pyb::arg("temperature") = pyb::none(),
          pyb::arg("top_p") = pyb::none(), pyb::arg("min_p") = pyb::none(),
          pyb::arg("top_k") = pyb::none(), pyb::arg("seed") = pyb::none(),
          pyb::arg("stop_tokens") = std::vector<int32_t>{},
          pyb::arg("stop_sequences") = std::vector<std::vector<int32_t>>{},
          pyb::arg("ignore_eos") = false, pyb::arg("logprobs") = -1,
          pyb::arg("vocab_logprobs") = false)
      .def("cancel", &Session::cancel)
      .def("step", &Session::step, pyb::call_guard<pyb::gil_scoped_release>())
      .def(
          "take_events",
          [](Session& s) {
            // Tuples, not objects: the Python side dispatches them by uid at once. The
            // vocabulary's log-probabilities come as a bytearray of float32 (None when not
            // asked for), which numpy or a memoryview reads in place.
            std::vector<recur::py::PyEvent> events = s.take_events();
            pyb::list out;
            for (const recur::py::PyEvent& e : events) {
              pyb::bytes text(e.text);
              pyb::object row = pyb::none();
              if (!e.vocab_logprobs.empty()) {
                PyObject* b = PyByteArray_FromStringAndSize(
                    reinterpret_cast<const char*>(e.vocab_logprobs.data()),
                    pyb::ssize_t(e.vocab_logprobs.size() * sizeof(float)));
                if (!b) throw pyb::error_already_set();
                row = pyb::reinterpret_steal<pyb::object>(b);
              }
              out.append(pyb::make_tuple(e.uid, e.finish, e.token, e.logprob, text, e.finish_reason,
                                         e.message, e.prompt_tokens, e.generated_tokens, row));
            }
            s.give_back_rows(events);
            return out;
          })
      .def("stats",
           [](const Session& s) {
             const recur::EngineStats st = s.stats();
             pyb::dict d;
             d["prompt_tokens"] = st.prompt_tokens;
             d["generated_tokens"] = st.generated_tokens;
             d["prefill_seconds"] = st.prefill_seconds;
             d["decode_seconds"] = st.decode_seconds;
             d["steps"] = st.steps;
             d["running"] = st.running;
             d["waiting"] = st.waiting;
             d["kv_blocks_used"] = st.kv_blocks_used;
             d["kv_blocks_total"] = st.kv_blocks_total;
             d["requests_finished"] = st.requests_finished;
             d["preemptions"] = st.preemptions;
             d["live_buffers"] = st.alloc.live_buffers;
             d["live_bytes"] = st.alloc.live_bytes;
             d["peak_bytes"] = st.alloc.peak_bytes;
             d["allocs_total"] = st.alloc.allocs_total;
             return d;
           })
      .def_property_readonly("eos_token_ids",
                             [](const Session& s) { return s.info().eos_token_ids; })
      .def_property_readonly("vocab_size", [](const Session& s) { return s.info().vocab_size; })
      .def_property_readonly("architecture", [](const Session& s) { return s.info().architecture; })
      .def_property_readonly("max_context", &Session::max_context)
      .def_property_readonly("has_tokenizer", [](const Session& s) { return !!s.tokenizer(); })
      .def_property_readonly("has_chat_template",
                             [](const Session& s) { return !!s.chat_template(); })
      .def("encode", [](const Session& s,
                        const std::string& text) { return unwrap(need_tokenizer(s).encode(text)); })
      .def(
          "decode",
          [](const Session& s, const std::vector<int32_t>& ids, bool skip_special) {
            return pyb::bytes(need_tokenizer(s).decode(ids, skip_special));
          },
          pyb::arg("ids"), pyb::arg("skip_special_tokens") = false)
      .def(
          "render_chat",
          // request_json: the chat request as ChatTemplate::render takes it, written by
          // json.dumps so that key order is the caller's.
          [](const Session& s, const std::string& request_json, bool tokenize) -> pyb::object {
            const recur::Tokenizer& tok = need_tokenizer(s);
            if (!s.chat_template()) {
              throw pyb::value_error("no chat template: " + s.template_error());
            }
            auto req = nlohmann::ordered_json::parse(request_json, nullptr, false);
            if (req.is_discarded()) throw pyb::value_error("messages are not JSON-serializable");
            recur::RenderedPrompt p = unwrap(s.chat_template()->render_prompt(req));
            if (!tokenize) return pyb::str(p.text);
            return pyb::cast(unwrap(tok.encode(p.text, p.literal)));
          },
          pyb::arg("request_json"), pyb::arg("tokenize"));
}
