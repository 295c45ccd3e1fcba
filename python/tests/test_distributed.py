"""hbmio.load_file(group=...) across processes: torch.distributed on gloo (CPU), 2 and 4 ranks.

Each rank's tensors must equal a single-process load byte for byte; the ranks together must read
each tensor byte from storage exactly once (the engines' own byte counts, summed); a rank that
cannot read (a shard missing on its "node") must make every rank raise, not hang.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
from datetime import timedelta

import pytest
from _rank_exit import exit_rank

torch = pytest.importorskip("torch", reason="torch is not installed")
dist = pytest.importorskip("torch.distributed", reason="torch.distributed is not available")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import hbmio  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = pathlib.Path(os.environ.get("HBMIO_FIXTURES", REPO.parent / "shared" / "fixtures")) / "safetensors"
SHARDED = FIXTURES / "sharded"


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _worker(rank, world, init_file, out_dir, paths, placement, shard_map, devices, report_ranks):
    """One rank: load, then write what it got (or the error it raised) as JSON for the parent."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    result = {"rank": rank}
    try:
        report = {} if rank in report_ranks else None
        tensors = hbmio.load_file(paths[rank], device=devices[rank], framework="torch", group=dist.group.WORLD,
                                  placement=placement, shard_map=shard_map, report=report)
        result["tensors"] = {k: [str(v.dtype), list(v.shape), raw(v).hex()] for k, v in tensors.items()}
        result["report"] = report or {}
    except hbmio.Error as e:
        result["error"] = str(e)
    finally:
        dist.destroy_process_group()
    (pathlib.Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    exit_rank()  # see _rank_exit.py


def run_ranks(tmp_path, world, placement, paths=None, shard_map=None, devices=None, report_ranks=None):
    import torch.multiprocessing as mp

    paths = paths or [str(SHARDED)] * world
    devices = devices or ["cpu"] * world
    report_ranks = list(range(world)) if report_ranks is None else report_ranks
    init_file = tmp_path / "pg-init"
    mp.spawn(_worker, args=(world, str(init_file), str(tmp_path), paths, placement, shard_map, devices, report_ranks),
             nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def single_process():
    loaded = hbmio.load_file(SHARDED, framework="torch")
    return {k: [str(v.dtype), list(v.shape), raw(v).hex()] for k, v in loaded.items()}


def tensor_bytes():
    return hbmio._hbmio._tensor_bytes(str(SHARDED))


@pytest.mark.parametrize("world", [2, 4])
def test_replicate_every_rank_gets_everything_each_byte_read_once(tmp_path, world):
    expected = single_process()
    results = run_ranks(tmp_path, world, "replicate")
    for r in results:
        assert "error" not in r, r
        assert r["tensors"] == expected, f"rank {r['rank']} differs from a single-process load"
        assert r["report"]["world"] == world
    assert results[0]["report"]["total_bytes_from_storage"] == tensor_bytes()
    assert sum(r["report"]["bytes_from_storage"] for r in results) == tensor_bytes()


@pytest.mark.parametrize("world", [2, 4])
def test_shard_splits_the_tensors_each_byte_read_once(tmp_path, world):
    expected = single_process()
    results = run_ranks(tmp_path, world, "shard")
    seen = {}
    for r in results:
        assert "error" not in r, r
        for name, value in r["tensors"].items():
            assert name not in seen, f"{name} on ranks {seen[name]} and {r['rank']}"
            seen[name] = r["rank"]
            assert value == expected[name], name
        assert r["report"]["bytes_received"] == 0
    assert set(seen) == set(expected)
    assert sum(r["report"]["bytes_from_storage"] for r in results) == tensor_bytes()
    # Each rank's report says which way its reads took, per shard file, with the bytes it read.
    shards = {p.name for p in SHARDED.iterdir() if p.suffix == ".safetensors"}
    for r in results:
        report = r["report"]
        assert sum(p["bytes"] for p in report["paths"]) == report["bytes_from_storage"], report
        assert {pathlib.Path(p["file"]).name for p in report["paths"]} <= shards, report["paths"]
        assert all(p["path"] in ("uring", "posix") and p["reason"] for p in report["paths"]), report["paths"]
        assert report["ranks"][r["rank"]]["paths"] == report["paths"]


def test_shard_map_places_named_tensors(tmp_path):
    names = list(single_process())
    shard_map = {names[0]: 1, names[-1]: 0}
    results = run_ranks(tmp_path, 2, "shard", shard_map=shard_map)
    assert names[0] in results[1]["tensors"] and names[-1] in results[0]["tensors"]


@pytest.mark.parametrize("placement", ["replicate", "shard"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_failing_rank_fails_every_rank(tmp_path, world, placement):
    broken = tmp_path / "broken"
    shutil.copytree(SHARDED, broken)
    shard = sorted(p for p in broken.iterdir() if p.suffix == ".safetensors")[-1]
    shard.unlink()  # the last rank's "node" lacks a shard
    last = world - 1
    results = run_ranks(tmp_path, world, placement, paths=[str(SHARDED)] * last + [str(broken)])
    for r in results:  # every rank returned (none hung past gloo's 60 s timeout) with hbmio.Error
        assert "error" in r, f"rank {r['rank']} did not raise"
        assert f"rank {last}" in r["error"] and shard.name in r["error"], r["error"]


def test_a_rank_that_cannot_allocate_fails_every_rank(tmp_path):
    # Rank 1 names a device it does not have: its failure happens before any data moves.
    results = run_ranks(tmp_path, 2, "replicate", devices=["cpu", "meta:0"])
    for r in results:
        assert "error" in r and "rank 1" in r["error"], r


def test_report_asked_by_one_rank_only_does_not_hang(tmp_path):
    results = run_ranks(tmp_path, 2, "replicate", report_ranks=[0])
    assert "error" not in results[0] and "error" not in results[1]
    assert results[0]["report"]["total_bytes_from_storage"] == tensor_bytes()
    assert results[1]["report"] == {}
