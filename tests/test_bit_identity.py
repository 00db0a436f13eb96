"""The redesign harness (tests/bit_identity.py) runs every configuration on 2 ranks, its ranks agree
where the optimizer keeps them alike, and a changed bit is reported with the step it starts at."""
import copy

import bit_identity


def test_the_harness_fingerprints_every_configuration_and_reports_a_change():
    before = bit_identity.fingerprints()
    assert set(before) == {f"{name} rank {r}" for name in bit_identity.CONFIGS for r in (0, 1)}
    for name in bit_identity.CONFIGS:
        a, b = before[f"{name} rank 0"], before[f"{name} rank 1"]
        assert len(a["steps"]) == bit_identity.STEPS and a["state after the round trip"]
        if name != "zerooneadam":  # 0/1 Adam's ranks hold their own parameters between syncs
            assert a["steps"] == b["steps"], name
    assert bit_identity.differences(before, copy.deepcopy(before)) == []
    after = copy.deepcopy(before)
    after["onebitlamb rank 1"]["steps"][11] = "0" * 64
    after["lamb rank 0"]["bytes"][0] += 4
    assert bit_identity.differences(before, after) == ["lamb rank 0: bytes differ from step 1",
                                                        "onebitlamb rank 1: steps differ from step 12"]
