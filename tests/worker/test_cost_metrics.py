"""What validation and restore cost, where an operator looks: ``kvl_worker_validation_seconds``
(per form and layer group) and ``kvl_worker_restore_seconds`` (per form) move with a warm request
— on the speculative path and on the grant's — and not with a cold one."""

from __future__ import annotations

import pytest

from tests.twin import InProcessCoordinator
from tests.worker.conftest import prompt


def counts(e, name: str, labels: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """Observation counts of histogram ``name`` by its label values."""
    out = {}
    for fam in e.metrics.registry.collect():
        for s in fam.samples:
            if s.name == f"{name}_count":
                out[tuple(s.labels[k] for k in labels)] = s.value
    return out


@pytest.mark.parametrize("speculate", [True, False])
async def test_a_warm_request_moves_the_validation_and_restore_histograms(make_engine, speculate) -> None:
    toks = prompt(100, seed=11)
    async with make_engine(InProcessCoordinator()) as e:
        e.speculate = speculate
        forms = sorted(e.catalogue.names)
        await e.generate(toks, max_tokens=2)
        assert counts(e, "kvl_worker_validation_seconds", ("form", "layers")) == {}
        assert counts(e, "kvl_worker_restore_seconds", ("form",)) == {}
        warm = await e.generate(toks, max_tokens=2)
        assert warm.cached_tokens == 96
        validation = counts(e, "kvl_worker_validation_seconds", ("form", "layers"))
        # every form the resume read was validated once (one request), metadata and checksum both
        read = {f for f, _ in validation}
        assert read and read <= set(forms)
        assert validation == {(f, g): 1.0 for f in read for g in ("metadata", "integrity")}
        assert counts(e, "kvl_worker_restore_seconds", ("form",)) == {(f,): 1.0 for f in read}


async def test_integrity_switched_off_observes_no_checksum_time(make_engine) -> None:
    toks = prompt(100, seed=12)
    layers = ["presence", "abi", "intersection"]
    async with make_engine(InProcessCoordinator(), **{"cache.hit_validation.layers": layers}) as e:
        await e.generate(toks, max_tokens=1)
        await e.generate(toks, max_tokens=1)
        groups = {g for _, g in counts(e, "kvl_worker_validation_seconds", ("form", "layers"))}
        assert groups == {"metadata"}
