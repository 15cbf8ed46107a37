// The Python extension spade._core: a thin pybind11 binding of spade::api::LLM (src/api/llm.h)
// and of the kernel functions of src/api/ops.h (_ops.cpp; python/spade/ops.py wraps them).
// python/spade/__init__.py wraps it in the vLLM-like classes users call; docs/python.md.
// generate() releases the GIL while the engine runs; spade::Error becomes spade.Error
// (a ValueError).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "api/llm.h"
#include "core/error.h"

namespace py = pybind11;
using spade::api::Completion;
using spade::api::GenerateParams;
using spade::api::LLM;
using spade::api::LLMOptions;

void bind_ops(py::module_& m);  // _ops.cpp: the kernel API's functions (spade.ops)

namespace {
// SPADE_PY_KEEP_GIL: the engine's calls keep the GIL (a diagnostic build of
// bench/py_crash_diag.sh).
#ifdef SPADE_PY_KEEP_GIL
using Release = py::call_guard<>;
#else
using Release = py::call_guard<py::gil_scoped_release>;
#endif
}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "spade's engine (spade::api::LLM); use the classes of the spade package";
  // spade::Error -> spade.Error through a translator local to this module: a global one sits
  // in the translator chain that every pybind11 module of the process shares when their
  // internals match, and with PyTorch 2.11 / pybind11 3 loaded beside it the first spade.Error
  // raised from C++ crashed the interpreter (H200, 2026-11-29). The exception object is kept
  // the way each pybind11 release supports.
#if PYBIND11_VERSION_HEX >= 0x020C0000
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::exception<spade::Error>> error;
  error.call_once_and_store_result(
      [&]() { return py::exception<spade::Error>(m, "Error", PyExc_ValueError); });
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const spade::Error& e) {
      py::set_error(error.get_stored(), e.what());
    }
  });
#else
  static py::exception<spade::Error> error(m, "Error", PyExc_ValueError);
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const spade::Error& e) {
      error(e.what());
    }
  });
#endif
  py::class_<LLMOptions>(m, "LLMOptions")
      .def(py::init<>())
      .def_readwrite("device", &LLMOptions::device)
      .def_readwrite("threads", &LLMOptions::threads)
      .def_readwrite("max_context", &LLMOptions::max_context)
      .def_readwrite("max_batch", &LLMOptions::max_batch)
      .def_readwrite("max_step_tokens", &LLMOptions::max_step_tokens)
      .def_readwrite("page_size", &LLMOptions::page_size)
      .def_readwrite("kv_pages", &LLMOptions::kv_pages)
      .def_readwrite("kv_mem", &LLMOptions::kv_mem)
      .def_readwrite("cpu_weights", &LLMOptions::cpu_weights)
      .def_readwrite("kv_dtype", &LLMOptions::kv_dtype)
      .def_readwrite("kv_scale", &LLMOptions::kv_scale)
      .def_readwrite("tokenizer", &LLMOptions::tokenizer)
      .def_readwrite("deterministic", &LLMOptions::deterministic);
  py::class_<GenerateParams>(m, "GenerateParams")
      .def(py::init<>())
      .def_readwrite("max_tokens", &GenerateParams::max_tokens)
      .def_readwrite("temperature", &GenerateParams::temperature)
      .def_readwrite("top_k", &GenerateParams::top_k)
      .def_readwrite("top_p", &GenerateParams::top_p)
      .def_readwrite("min_p", &GenerateParams::min_p)
      .def_readwrite("repetition_penalty", &GenerateParams::repetition_penalty)
      .def_readwrite("seed", &GenerateParams::seed)
      .def_readwrite("stop", &GenerateParams::stop)
      .def_readwrite("stop_token_ids", &GenerateParams::stop_token_ids)
      .def_readwrite("ignore_eos", &GenerateParams::ignore_eos)
      .def_readwrite("logprobs", &GenerateParams::logprobs)
      .def_readwrite("sparse", &GenerateParams::sparse);
  py::class_<Completion>(m, "Completion")
      .def_readonly("prompt_token_ids", &Completion::prompt_token_ids)
      .def_readonly("token_ids", &Completion::token_ids)
      .def_readonly("text", &Completion::text)
      .def_readonly("finish_reason", &Completion::finish_reason)
      .def_readonly("logprobs", &Completion::logprobs)
      .def_readonly("top_logprobs", &Completion::top_logprobs)
      .def_readonly("density", &Completion::density);
  py::class_<LLM>(m, "LLM")
      .def(py::init<const std::string&, const LLMOptions&>(), py::arg("model"), py::arg("options"),
           Release())
      .def("generate", &LLM::generate, py::arg("prompts"), py::arg("params"),
           Release())
      .def("generate_ids", &LLM::generate_ids, py::arg("prompts"), py::arg("params"),
           Release())
      .def("encode", &LLM::encode, py::arg("text"), py::arg("add_special") = true)
      .def("decode", &LLM::decode, py::arg("ids"))
      .def("apply_chat_template", &LLM::apply_chat_template, py::arg("messages"))
      .def("device", &LLM::device)
      .def("max_context", &LLM::max_context)
      .def("vocab_size", [](const LLM& l) { return l.config().vocab; });
  bind_ops(m);
}
