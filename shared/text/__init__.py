"""The text side every front door must agree on with the workers: a checkpoint's tokenizer,
its chat template, its generation defaults (a gateway tokenizes and hashes a prompt exactly as
the worker that will serve it does)."""
