"""The pure planning/validation core: which blocks a resume reads, which boundary is usable,
and which layer a bad replica fails — no pools, no files, no coordinator."""

from __future__ import annotations

import pytest

from shared.forms import FormCatalogue, FormScope, FormSpec
from shared.ids import ROOT_HASH
from shared.messages import ReplicaRef
from worker.cache.planner import (
    BlockMeta, Expect, Layer, LAYERS, Observed, Switches, all_pass, best_boundary, grid_floor, map_reads, needs,
    resume_cap, validate,
)

BS = 16
CAT = FormCatalogue(model_id="m", block_size=BS, forms=(
    FormSpec(name="compressed", scope=FormScope.FULL_HISTORY, bytes_per_block=64, dtype="float32"),
    FormSpec(name="indexer", scope=FormScope.FULL_HISTORY, bytes_per_block=32, dtype="float32"),
    FormSpec(name="tail", scope=FormScope.RESUME_POINT, bytes_per_block=16, dtype="float32"),
    FormSpec(name="swa", scope=FormScope.WINDOW, bytes_per_block=48, dtype="float32", window_tokens=31),
))
SPECS = {f.name: f for f in CAT.forms}
NS = "ab" * 16
HASHES = [f"{i + 1:032x}" for i in range(8)]
EXPECT = Expect(namespace=NS, tenant="t", block_hashes=HASHES, block_size=BS, specs=SPECS)


def test_needs_by_scope() -> None:
    got = needs(CAT, 4)
    assert [(i, f) for i, f in got if f == "compressed"] == [(i, "compressed") for i in range(4)]
    assert [(i, f) for i, f in got if f == "indexer"] == [(i, "indexer") for i in range(4)]
    assert [(i, f) for i, f in got if f == "tail"] == [(3, "tail")]
    assert [(i, f) for i, f in got if f == "swa"] == [(2, "swa"), (3, "swa")]  # ceil(31/16) = 2 blocks
    assert needs(CAT, 1) == [(0, "compressed"), (0, "indexer"), (0, "tail"), (0, "swa")]
    assert needs(CAT, 0) == []


def test_best_boundary_falls_back_to_shorter_and_respects_the_grid() -> None:
    good = set(needs(CAT, 6))
    assert best_boundary(CAT, good, 6) == 6
    # the tail at p=6 is bad: a shorter boundary needs the tail of its own last block
    good.discard((5, "tail"))
    assert best_boundary(CAT, good, 6) == 0          # no other tails were offered
    good |= {(2, "tail"), (1, "swa"), (2, "swa")}
    assert best_boundary(CAT, good, 6) == 3
    assert best_boundary(CAT, good, 6, grid=2) == 0  # 3 is off a grid of 2
    good |= {(3, "tail"), (3, "swa")}
    assert best_boundary(CAT, good, 6, grid=2) == 4
    assert best_boundary(CAT, good, 3) == 3          # never above the limit


def test_grid_and_cap() -> None:
    assert grid_floor(7, 4) == 4 and grid_floor(8, 4) == 8 and grid_floor(3, 1) == 3
    assert resume_cap(64, 16) == 3   # the last token's logits must be computed
    assert resume_cap(65, 16) == 4
    assert resume_cap(1, 16) == 0
    with pytest.raises(ValueError):
        grid_floor(3, 0)


def _meta(i: int, form: str = "compressed", **kw) -> BlockMeta:
    base = dict(namespace=NS, tenant="t", block_hash=HASHES[i], parent_hash=HASHES[i - 1] if i else ROOT_HASH,
                token_start=i * BS, token_end=(i + 1) * BS, form=form, spec_digest=SPECS[form].spec_digest,
                checksum="c" * 32, generation=7)
    base.update(kw)
    return BlockMeta(**base)


def _ref(i: int, form: str = "compressed", **kw) -> ReplicaRef:
    base = dict(block_hash=HASHES[i], form=form, location="gpu:w", generation=7, checksum="c" * 32)
    base.update(kw)
    return ReplicaRef(**base)


def _obs(meta: BlockMeta | None, nbytes: int = 64, digest: str = "c" * 32, **kw) -> Observed:
    return Observed(meta, nbytes=nbytes, checksum=lambda: digest, **kw)


ALL = Switches()


def test_a_good_replica_passes_every_layer() -> None:
    v = validate(_ref(2), 2, _obs(_meta(2)), EXPECT, ALL)
    assert v.ok and v.layer is None
    assert v.outcomes == tuple((lay, "pass") for lay in Layer)


@pytest.mark.parametrize("case, layer", [
    ("absent", Layer.PRESENCE),
    ("recycled", Layer.PRESENCE),
    ("not_ready", Layer.PRESENCE),
    ("other_spec", Layer.ABI),
    ("wrong_size", Layer.ABI),
    ("other_namespace", Layer.INTERSECTION),
    ("other_tenant", Layer.INTERSECTION),
    ("other_parent", Layer.INTERSECTION),
    ("other_span", Layer.INTERSECTION),
    ("foreign_ref", Layer.INTERSECTION),
    ("bit_flip", Layer.INTEGRITY),
    ("damaged", Layer.INTEGRITY),
    ("unaligned", Layer.INTEGRITY),
])
def test_each_failure_is_named_by_its_layer(case: str, layer: Layer) -> None:
    ref, obs, index = _ref(2), _obs(_meta(2)), 2
    if case == "absent":
        obs = Observed(None)
    elif case == "recycled":
        obs = _obs(_meta(2, generation=8))
    elif case == "not_ready":
        obs = _obs(_meta(2), ready=False)
    elif case == "other_spec":
        obs = _obs(_meta(2, spec_digest="0" * 16))
    elif case == "wrong_size":
        obs = _obs(_meta(2), nbytes=60)
    elif case == "other_namespace":
        obs = _obs(_meta(2, namespace="cd" * 16))
    elif case == "other_tenant":
        obs = _obs(_meta(2, tenant="u"))
    elif case == "other_parent":
        obs = _obs(_meta(2, parent_hash=HASHES[5]))
    elif case == "other_span":
        obs = _obs(_meta(2, token_start=0, token_end=16))
    elif case == "foreign_ref":
        ref, obs = _ref(3), _obs(_meta(3))   # a ref for block 3 offered as block 2
    elif case == "bit_flip":
        obs = _obs(_meta(2), digest="d" * 32)
    elif case == "damaged":
        obs = _obs(_meta(2), damage="truncated")
    elif case == "unaligned":
        obs = _obs(_meta(2), aligned=False)
    v = validate(ref, index, obs, EXPECT, ALL)
    assert not v.ok and v.layer is layer, v
    assert (layer, "fail") in v.outcomes and len(v.outcomes) == 4


def test_switches_per_layer_and_per_form() -> None:
    flipped = _obs(_meta(2), digest="d" * 32)
    no_integrity = Switches(layers=frozenset({Layer.PRESENCE, Layer.ABI, Layer.INTERSECTION}))
    v = validate(_ref(2), 2, flipped, EXPECT, no_integrity)
    assert v.ok and (Layer.INTEGRITY, "skip") in v.outcomes
    no_compressed = Switches(forms=frozenset({"indexer", "tail", "swa"}))
    v = validate(_ref(2), 2, _obs(_meta(2, generation=99)), EXPECT, no_compressed)
    assert v.ok and all(o == "skip" for _, o in v.outcomes)
    # a reload is always checked for integrity while check_offload is on, whatever the form switch says
    v = validate(_ref(2, location="disk"), 2, flipped, EXPECT, Switches(layers=frozenset(), forms=frozenset()),
                 reload=True)
    assert not v.ok and v.layer is Layer.INTEGRITY
    v = validate(_ref(2, location="disk"), 2, flipped, EXPECT,
                 Switches(layers=frozenset(), forms=frozenset(), offload=False), reload=True)
    assert v.ok
    # a reload ignores slot generations (copies carry their own)
    assert validate(_ref(2, location="disk", generation=0), 2, _obs(_meta(2)), EXPECT, ALL, reload=True).ok


def test_structural_facts_fail_whatever_the_switches() -> None:
    off = Switches(layers=frozenset(), forms=frozenset())
    assert validate(_ref(2), 2, Observed(None), EXPECT, off).layer is Layer.PRESENCE
    assert validate(_ref(2), 2, _obs(_meta(2), nbytes=3), EXPECT, off).layer is Layer.ABI
    assert validate(_ref(2), 2, _obs(_meta(2), damage="bad magic"), EXPECT, off).layer is Layer.INTEGRITY


def test_switches_from_config() -> None:
    from shared.config import HitValidation
    sw = Switches.from_config(HitValidation(check_swa=False, layers=["presence", "integrity"]), CAT)
    assert sw.forms == frozenset({"compressed", "indexer", "tail"})
    assert sw.layers == frozenset({Layer.PRESENCE, Layer.INTEGRITY})


def test_map_reads() -> None:
    plan = map_reads(HASHES[:3], [_ref(1), _ref(2, form="tail"), _ref(5)])
    assert set(plan.refs) == {(1, "compressed"), (2, "tail")}
    assert [r.block_hash for r in plan.foreign] == [HASHES[5]]


def test_fast_path_never_passes_what_validate_fails() -> None:
    """``all_pass`` is a shortcut for the all-layers-on GPU case: it may say False to a good
    replica, never True to a bad one. Every single-field change of a good replica is tried."""
    import itertools

    import msgspec

    good_meta, good_ref = _meta(2), _ref(2)
    assert all_pass(good_ref, 2, _obs(good_meta), EXPECT)
    alt = {"namespace": "cd" * 16, "tenant": "u", "block_hash": HASHES[3], "parent_hash": HASHES[0],
           "token_start": 0, "token_end": 999, "form": "swa", "spec_digest": "0" * 16, "generation": 3}
    cases = []
    for field, value in alt.items():
        cases.append((good_ref, _obs(msgspec.structs.replace(good_meta, **{field: value}))))
    for field, value in (("block_hash", HASHES[4]), ("form", "tail"), ("generation", 9), ("checksum", "")):
        cases.append((msgspec.structs.replace(good_ref, **{field: value}), _obs(good_meta)))
    cases += [(good_ref, _obs(good_meta, nbytes=8)), (good_ref, _obs(good_meta, digest="f" * 32)),
              (good_ref, _obs(good_meta, ready=False)), (good_ref, _obs(good_meta, aligned=False)),
              (good_ref, _obs(good_meta, damage="x")), (good_ref, Observed(None))]
    for (ref, obs), index, reload in itertools.product(cases, (2, 7), (False, True)):
        if all_pass(ref, index, obs, EXPECT, reload=reload):
            assert validate(ref, index, obs, EXPECT, ALL, reload=reload).ok, (ref, obs.meta, index, reload)
    assert sum(all_pass(r, 2, o, EXPECT) for r, o in cases) == 0
    # a reload has no slot generation to compare (validate skips it too): only those cases pass
    passed = [(r, o) for r, o in cases if all_pass(r, 2, o, EXPECT, reload=True)]
    assert len(passed) == 2 and all(validate(r, 2, o, EXPECT, ALL, reload=True).ok for r, o in passed)
    assert all_pass(good_ref, 2, _obs(good_meta), EXPECT, reload=True)


def test_every_layer_runs_decides_where_the_shortcut_may_be_taken() -> None:
    assert ALL.all_run("compressed", False) and ALL.all_run("compressed", True)
    no_abi = Switches(layers=frozenset(LAYERS) - {Layer.ABI})
    assert not no_abi.all_run("compressed", False) and not no_abi.all_run("compressed", True)
    # reloads check integrity whatever the switches say (cache.hit_validation.check_offload)
    no_integrity = Switches(layers=frozenset(LAYERS) - {Layer.INTEGRITY})
    assert not no_integrity.all_run("compressed", False) and no_integrity.all_run("compressed", True)
    unchecked = Switches(forms=frozenset({"swa"}))
    assert not unchecked.all_run("compressed", False) and unchecked.all_run("compressed", True)
    assert not Switches(forms=frozenset({"swa"}), offload=False).all_run("compressed", True)


def test_a_record_at_a_generation_keeps_every_other_field() -> None:
    import msgspec

    values = {f.name: (7 if f.type in ("int", int) else f"v-{f.name}") for f in msgspec.structs.fields(BlockMeta)}
    meta = BlockMeta(**values)
    assert meta.at_generation(42) == msgspec.structs.replace(meta, generation=42)
