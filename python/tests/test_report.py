"""report=: what a load or save did, per file the way its bytes took and why (Stats::paths).

Host memory and the host backends here; a GPU machine runs the CUDA case (skipped elsewhere).
"""
from __future__ import annotations

import numpy as np
import pytest

import hbmio

PATHS = {"gds-nvidia-fs", "gds-p2pdma", "cufile-compat", "uring", "posix", "remote"}


def _save(tmp_path, name="model.safetensors", **kwargs):
    path = tmp_path / name
    tensors = {"w": np.arange(50000, dtype=np.float32), "b": np.ones(17, dtype=np.int64)}
    report = {}
    hbmio.save_file(tensors, str(path), report=report, **kwargs)
    return path, tensors, report


def test_save_and_load_report_the_way_of_each_file(tmp_path):
    path, tensors, saved = _save(tmp_path, backend="posix")
    # The save names the file where it ends up, not its temporary.
    assert [p["file"] for p in saved["paths"]] == [str(path)]
    assert saved["paths"][0]["path"] == "posix"
    assert saved["paths"][0]["reason"] == "pwrite through the page cache"
    assert saved["bytes"] >= sum(t.nbytes for t in tensors.values())

    report = {}
    loaded = hbmio.load_file(str(path), framework="numpy", backend="posix", report=report)
    assert np.array_equal(loaded["w"], tensors["w"])
    (entry,) = report["paths"]
    assert entry == {"file": str(path), "path": "posix", "reason": "pread through the page cache",
                     "bytes": report["bytes"], "bytes_direct": 0}
    assert report["backend"] == "posix" and report["seconds"] >= 0


def test_auto_says_why_it_chose_its_path(tmp_path):
    path, _, _ = _save(tmp_path)
    report = {}
    hbmio.load_file(str(path), framework="numpy", backend="auto", report=report)
    (entry,) = report["paths"]
    assert entry["path"] in {"uring", "posix"}
    # Host memory: cuFile never serves it, and the reason says so before how the bytes went.
    assert entry["reason"].startswith(f"auto chose {entry['path']}: host memory, which cuFile does not move; "), entry["reason"]
    assert 0 <= entry["bytes_direct"] <= entry["bytes"]


def test_a_background_save_reports_its_paths_once_durable(tmp_path):
    tensors = {"w": np.arange(50000, dtype=np.float32), "b": np.ones(17, dtype=np.int64)}
    path = tmp_path / "bg.safetensors"
    handle = hbmio.save_file(tensors, str(path), backend="posix", blocking=False)
    handle.result()
    (entry,) = handle.report["paths"]
    # The same entry a blocking save of the same state reports.
    _, _, blocking = _save(tmp_path, "blocking.safetensors", backend="posix")
    assert entry["file"] == str(path)
    assert (entry["path"], entry["reason"]) == (blocking["paths"][0]["path"], blocking["paths"][0]["reason"])
    assert entry["bytes"] == blocking["paths"][0]["bytes"]
    sharded = hbmio.save_file({f"t{i}": np.full(1000, i, dtype=np.float32) for i in range(3)}, str(tmp_path / "sharded"),
                              max_shard_size=5000, backend="posix", blocking=False)
    sharded.result()
    assert len(sharded.report["paths"]) == 3


def test_a_sharded_checkpoint_reports_every_shard(tmp_path):
    directory = tmp_path / "sharded"
    tensors = {f"t{i}": np.full(1000, i, dtype=np.float32) for i in range(3)}
    saved = {}
    hbmio.save_file(tensors, str(directory), max_shard_size=5000, backend="posix", report=saved)
    shards = sorted(p["file"] for p in saved["paths"])
    assert len(shards) == 3 and all(f.startswith(str(directory / "model-0000")) for f in shards)
    report = {}
    hbmio.load_file(str(directory), framework="numpy", backend="posix", report=report)
    assert sorted(p["file"] for p in report["paths"]) == shards
    assert sum(p["bytes"] for p in report["paths"]) == report["bytes"]


def test_open_handle_reports_its_reads_so_far(tmp_path):
    path, tensors, _ = _save(tmp_path)
    with hbmio.open(str(path), framework="numpy", backend="posix", readahead=0) as f:
        assert f.report()["paths"] == [] and f.report()["reads"] == 0
        f.get_tensor("w")
        first = f.report()
        f.get_tensor("b")
        second = f.report()
    assert first["reads"] == 1 and second["reads"] == 2
    (entry,) = second["paths"]
    assert entry["file"] == str(path) and entry["path"] == "posix"
    assert entry["bytes"] == tensors["w"].nbytes + tensors["b"].nbytes


def test_a_url_reports_the_remote_path_without_its_query(tmp_path):
    from rangeserver import RangeServer
    path, tensors, _ = _save(tmp_path)
    server = RangeServer(tmp_path)
    try:
        url = server.url(path.name)
        report = {}
        loaded = hbmio.load_file(url + "?X-Amz-Signature=secret", framework="numpy", report=report)
    finally:
        server.stop()
    assert np.array_equal(loaded["w"], tensors["w"])
    (entry,) = report["paths"]
    assert entry["path"] == "remote" and entry["file"] == url, entry
    assert entry["reason"].startswith("an object at a URL: ranged GETs"), entry["reason"]
    assert entry["bytes"] == report["bytes"] and entry["bytes_direct"] == 0


def test_report_must_be_a_dict(tmp_path):
    path, _, _ = _save(tmp_path)
    with pytest.raises(TypeError, match="report= takes a dict"):
        hbmio.load_file(str(path), framework="numpy", report=True)
    with pytest.raises(ValueError, match="handle's report"):
        hbmio.save_file({"x": np.zeros(4)}, str(tmp_path / "x.safetensors"), blocking=False, report={})


def test_cuda_load_names_its_path():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import tempfile
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        path = f"{d}/gpu.safetensors"
        hbmio.save_file({"w": torch.arange(1 << 20, dtype=torch.float32, device="cuda")}, path)
        report = {}
        state = hbmio.load_file(path, device="cuda:0", report=report)
        assert state["w"].device.type == "cuda"
        (entry,) = report["paths"]
        assert entry["path"] in PATHS - {"remote"}
        assert entry["reason"].startswith("auto chose ") or hbmio._backend(None) != "auto"
