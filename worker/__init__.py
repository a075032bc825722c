"""The stateless worker: model, kernels glue and (later) the inference endpoint."""
