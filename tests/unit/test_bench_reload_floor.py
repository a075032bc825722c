"""bench.reload_floor: the bare validating reload reads and verifies every real segment record."""

from __future__ import annotations

import pytest

from bench.reload_floor import main, tiny_forms


def test_a_small_run_verifies_every_record_and_prints_its_keys(capsys) -> None:
    forms = tiny_forms()
    out = main(["--blocks", "3", "--reps", "2"])
    assert out["records"] == 3 * len(forms) == 12
    assert out["payload_bytes"] == 3 * sum(s for s, _ in forms.values()) < out["segment_bytes"]   # headers, padding
    assert out["floor_us_per_record"] > 0 and out["raw_us_per_record"] > 0 and out["floor_ratio_vs_raw"] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"bench": "reload_floor"')


@pytest.mark.parametrize("argv", [["--blocks", "0"], ["--reps", "0"], ["--blocks", "x"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)


def test_the_floor_really_checks_the_bytes(tmp_path) -> None:
    from bench.reload_floor import floor_reload, write_segment

    forms = tiny_forms()
    path, records = write_segment(tmp_path, 2, forms)
    free = {s: [memoryview(bytearray(s)) for _ in range(3)] for s, _ in forms.values()}
    assert floor_reload(path, records, free) > 0
    with open(path, "r+b") as f:                 # one payload byte of the third record
        f.seek(records[2].payload + 7)
        b = f.read(1)
        f.seek(records[2].payload + 7)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(RuntimeError, match="record 2 does not verify"):
        floor_reload(path, records, free)
