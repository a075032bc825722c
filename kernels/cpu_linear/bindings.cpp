PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x @ w.T, each element reduced in one fixed order (threads: 1 = the caller only, "
        "else the pool)", py::arg("x"), py::arg("w"), py::arg("threads") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("attention", &attention, "causal attention of ragged segments over their own K/V, each (row, head) "
        "in one fixed order (cpu_attention.cpp)", py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("rows"),
        py::arg("pos"), py::arg("key_lo"), py::arg("window"), py::arg("scale"), py::arg("threads") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("set_threads", &set_threads);
  m.def("get_threads", &get_threads);
  m.def("isa", &isa);
}
