"""Paths the Python API writes or reads, refused up front with the argument's name: a directory or
an empty path for save_safetensors and calibration files, eval(out=''), and paths the system refuses
(a symbolic link loop, a name too long) as ValueError, never an internal error."""

import os

import numpy as np
import pytest

import moefq


def listing(d):
    return sorted(os.listdir(d))


@pytest.mark.parametrize("kind", ["dir", "dir/", "empty"])
def test_file_outputs_refuse_directories_and_empty_paths(tmp_path, kind):
    os.mkdir(tmp_path / "d")
    target = {"dir": str(tmp_path / "d"), "dir/": str(tmp_path / "d") + "/", "empty": ""}[kind]
    why = "empty path" if kind == "empty" else ("is a directory" if kind == "dir" else "ends with '/'")
    q = moefq.Quantizer("q", "fp8", amax=2.0)
    layer = moefq.MoeLayer("tiny", ranks=1, max_tokens=8, threads=1)
    before, cwd = listing(tmp_path), listing(".")
    calls = [
        ("save_safetensors: path", lambda: moefq.save_safetensors(target, {"x": np.zeros(4, np.float32)})),
        ("save_calibration: path", lambda: moefq.save_calibration(target, [q])),
        ("save_calibration: path", lambda: q.save(target)),
        ("MoeLayer.save_calibration: path", lambda: layer.save_calibration(target)),
    ]
    for name, call in calls:
        with pytest.raises(ValueError, match=f"{name}.*{why}"):
            call()
    assert listing(tmp_path) == before
    assert listing(".") == cwd
    assert listing(tmp_path / "d") == []


def test_eval_refuses_an_empty_out(tmp_path):
    before = listing(tmp_path)
    with pytest.raises(ValueError, match="out: empty path"):
        moefq.eval(preset="tiny", ranks=2, tokens=16, calib_batches=1, eval_batches=1, device="cpu", out="")
    assert listing(tmp_path) == before


def test_long_names_work_and_too_long_names_are_refused(tmp_path):
    name = tmp_path / ("n" * 255)
    moefq.save_safetensors(name, {"x": np.ones(4, np.float32)})
    assert np.array_equal(moefq.load_safetensors(name)["x"], np.ones(4, np.float32))
    with pytest.raises(ValueError, match="save_safetensors: path.*File name too long"):
        moefq.save_safetensors(tmp_path / ("n" * 256), {"x": np.ones(4, np.float32)})
    assert [p for p in os.listdir(tmp_path) if ".tmp." in p] == []


def test_paths_the_system_refuses_are_value_errors(tmp_path):
    os.symlink("loop", tmp_path / "loop")
    ckpt = tmp_path / "ckpt"
    os.mkdir(ckpt)
    os.symlink("config.json", ckpt / "config.json")  # a link to itself
    for what in (str(tmp_path / "loop"), str(ckpt), str(tmp_path / ("c" * 300))):
        with pytest.raises(ValueError):
            moefq.MoeLayer(checkpoint=what, layer=0)
        with pytest.raises(ValueError):
            moefq.MoeLayer(config=os.path.join(what, "config.json"))
        with pytest.raises(ValueError):
            moefq.eval(checkpoint=what, layers=0, device="cpu")
