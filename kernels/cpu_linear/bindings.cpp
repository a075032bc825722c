PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x @ w.T, each element reduced in one fixed order (threads: 1 = the caller only, "
        "else the pool)", py::arg("x"), py::arg("w"), py::arg("threads") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("attention", &attention, "causal attention of ragged segments over their own K/V, each (row, head) "
        "in one fixed order (cpu_attention.cpp)", py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("rows"),
        py::arg("pos"), py::arg("key_lo"), py::arg("window"), py::arg("scale"), py::arg("threads") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("attention_cached", &attention_cached, "attention() over per-request K/V buffers, the new rows written "
        "into them first (cpu_attention.cpp)", py::arg("q"), py::arg("k"), py::arg("v"), py::arg("kbufs"),
        py::arg("vbufs"), py::arg("layer"), py::arg("start"), py::arg("rows"), py::arg("pos"), py::arg("key_lo"),
        py::arg("window"), py::arg("scale"), py::arg("threads") = 0,
        py::arg("prefixes") = std::vector<torch::Tensor>{}, py::arg("block_size") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("dense_layer", &dense_layer, "one dense decoder layer on the in-place attention path, the Python "
        "modules' ops in their order (cpu_layer.cpp)", py::call_guard<py::gil_scoped_release>());
  m.def("cast_rms_norm", &cast_rms_norm, "CastRMSNorm with torch's bits (cpu_layer.cpp); lanes: ATen's float vector width",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("lanes"), py::call_guard<py::gil_scoped_release>());
  m.def("rope", &rope, "x*cos + rotate_half(x)*sin with torch's bits (cpu_layer.cpp)", py::arg("x"), py::arg("cos"),
        py::arg("sin"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up, ATen's silu on the vector path", py::arg("gate"), py::arg("up"),
        py::call_guard<py::gil_scoped_release>());
  m.def("set_threads", &set_threads);
  m.def("get_threads", &get_threads);
  m.def("isa", &isa);
}
