"""The product-wide tools: the ``kvledger`` CLI, ``kvledger up`` (the dev supervisor that runs
services, coordinator and workers on one machine), the admin CLI over the coordinator's REST
API, the capacity planner and the config/metrics reference. They may import every service;
the services (``coordinator/``, ``worker/``) import only ``shared/`` and ``kernels/`` from
outside themselves (``tests/unit/test_import_graph.py``).
"""
