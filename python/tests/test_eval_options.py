"""moefq.eval's calibration and link keywords: the same rows as `moefq eval --calibration ... --link ...`
would give, and errors that name the keywords."""
import pytest

import moefq

BASE = dict(preset="tiny", device="cpu", tokens=8, calib_batches=1, eval_batches=1, threads=1)


def test_calibration_methods_and_link_times():
    r = moefq.eval(**BASE, recipes=["none", "moe_combine_fp8"], calibration="max,percentile:99.9", link="nvlink4")
    names = sorted(row["recipe"] for row in r["results"])
    assert names == ["moe_combine_fp8@max", "moe_combine_fp8@p99.9", "none"]
    assert r["config"]["calibration_methods"] == "max, percentile 99.9"
    assert r["config"]["link"]["name"] == "nvlink4"
    for row in r["results"]:
        assert row["saved_us"] >= 0
        assert row["calibration"] == {"none": None, "moe_combine_fp8@max": "max"}.get(row["recipe"], "percentile 99.9")
    methods = {m["method"] for m in r["calibration"][0]["methods"]}
    assert methods == {"max", "percentile 99.9"}


def test_errors_name_the_keywords():
    for options, message in [
        (dict(calibration="min"), "calibration: unknown calibration method 'min'"),
        (dict(calibration=3), "calibration"),
        (dict(link="nvlink9"), "link='nvlink9' is not a known link"),
        (dict(link="ib400", link_gbps=100.0), "link and link_gbps cannot be used together"),
        (dict(link_gbps=-1.0), "link_gbps must be a number > 0"),
    ]:
        with pytest.raises(ValueError) as e:
            moefq.eval(**{**BASE, **options})
        assert message in str(e.value) and "--" not in str(e.value), (options, str(e.value))
