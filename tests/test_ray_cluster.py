"""The sweep on Ray: the embedded Ray listens on loopback only, and a sweep over a real two-node Ray cluster on
this machine survives the loss of its worker node (every run finishes exactly once, from its checkpoint).

Both start Ray processes (tens of seconds each on a small machine): marked ``slow``, and they run in CI.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from rlseq import reaper

REPO = Path(__file__).resolve().parents[1]
TINY = {"n_envs": 2, "n_steps": 16, "n_minibatches": 2, "n_epochs": 1}
POPGYM = "popgym-RepeatPreviousEasy-v0"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="reads /proc"),
    pytest.mark.skipif(shutil.which("ray") is None, reason="needs the ray CLI (pip install ray)"),
]


def _env(**extra: str) -> dict[str, str]:
    """This checkout on every process's path (Ray workers start the trainers, which import rlseq)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


def _sweep_file(tmp_path: Path, seeds: tuple[int, ...] = (0, 1), **flags) -> Path:
    spec = {"logdir": str(tmp_path / "runs"), "envs": [POPGYM], "memories": ["efla", "none"], "seeds": list(seeds),
            "conditions": {"tiny": {}}, "flags": {"total_steps": 128, "checkpoint_every": 32, **TINY, **flags}}
    path = tmp_path / "tiny.yml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # the process ended, or is not ours to read
        return b""


def _descendants(root: int) -> set[int]:
    return {root, *reaper.descendants(root, trainers=True)}


def _listening(pids: set[int]) -> list[tuple[int, str]]:
    """``(pid, address)`` of every listening TCP socket of ``pids`` (from /proc/net/tcp and tcp6)."""
    addresses = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in _read(table).decode().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host-endian
            addresses[fields[9]] = ipaddress.ip_address(words)
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = link[len("socket:["):-1] if link.startswith("socket:[") else None
            if inode in addresses:
                out.append((pid, str(addresses[inode])))
    return out


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def test_an_embedded_sweep_listens_on_loopback_only(tmp_path):
    path = _sweep_file(tmp_path, total_steps=1_000_000)
    sweep = subprocess.Popen([sys.executable, "-m", "rlseq.sweep", str(path), "--gpus", "none", "--parallel", "1",
                              "--only", "memory=none", "--only", "seed=0", "--no-progress"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
    lock = tmp_path / "runs" / POPGYM / "none-tiny" / "seed0" / ".lock"
    try:
        deadline = time.time() + 240
        while time.time() < deadline and sweep.poll() is None and not (lock.exists() and lock.read_text().strip()):
            time.sleep(0.2)
        assert lock.exists() and lock.read_text().strip(), "no trainer within 240 s"
        tree = _descendants(sweep.pid)
        trainer = int(lock.read_text().split()[1])  # "pid N on HOST"
        assert trainer in tree, "the trainer is not a descendant of the sweep (its Ray is not embedded)"
        names = {_read(f"/proc/{p}/comm").decode().strip() for p in tree}
        assert {"gcs_server", "raylet"} <= names
        listening = _listening(tree)
        assert len({pid for pid, _ in listening}) >= 2, listening  # the GCS and the raylet at least
        exposed = [(pid, _read(f"/proc/{pid}/comm").decode().strip(), a) for pid, a in listening if not _loopback(a)]
        assert not exposed, f"listening beyond loopback: {exposed}"
    finally:
        sweep.send_signal(signal.SIGTERM)
        try:
            out = sweep.communicate(timeout=120)[0].decode()
        except subprocess.TimeoutExpired:
            sweep.kill()
            out = sweep.communicate()[0].decode()
    assert sweep.returncode == 1 and "1 not run (stopped)" in out, out[-3000:]


# --- a two-node cluster -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marked(marker: str) -> list[int]:
    """Processes whose environment carries ``RLSEQ_TEST_RAY=<marker>``: one node's Ray processes and trainers."""
    tag = f"RLSEQ_TEST_RAY={marker}".encode()
    return [pid for pid in _pids() if tag in _read(f"/proc/{pid}/environ").split(b"\0")]


def _kill(pids: list[int]) -> None:
    """SIGKILL ``pids`` and their descendants (Ray's agents rewrite their environment with their title, so
    they do not show the marker)."""
    tree = set().union(*(_descendants(pid) for pid in pids))
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _ray_start(args: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(["ray", "start", *args, "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
                           "--disable-usage-stats", "--object-store-memory", str(100 * 2**20)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.fixture
def two_nodes():
    """A head and a worker node, 1 CPU each, with their own temp dirs and a token; every process of both is
    killed by its marker at the end (``ray stop`` would stop any Ray on the machine)."""
    run_id = secrets.token_hex(4)
    head, worker = f"{run_id}-head", f"{run_id}-worker"
    dirs = [tempfile.mkdtemp(prefix="rh", dir="/tmp"), tempfile.mkdtemp(prefix="rw", dir="/tmp")]  # short: socket paths
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    try:
        _ray_start(["--head", "--port", str(_free_port()), "--include-dashboard=false", "--temp-dir", dirs[0]],
                   _env(RLSEQ_TEST_RAY=head, **auth))
        address = (Path(dirs[0]) / "ray_current_cluster").read_text().strip()
        _ray_start(["--address", address, "--temp-dir", dirs[1]], _env(RLSEQ_TEST_RAY=worker, **auth))
        yield {"address": address, "env": _env(**auth), "worker": worker}
    finally:
        _kill(_marked(worker) + _marked(head))
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_a_sweep_over_two_nodes_survives_losing_one(two_nodes, tmp_path):
    # one run per node: the worker's run dies with its node and resumes on the head after the head's run; a budget
    # long past the first checkpoint, so that the victim cannot finish between being found and the kill
    steps = 1024
    path = _sweep_file(tmp_path, seeds=(0,), total_steps=steps)
    runs = tmp_path / "runs" / POPGYM
    sweep = subprocess.Popen([sys.executable, "-m", "rlseq.sweep", str(path), "--address", two_nodes["address"],
                              "--threads-per-run", "1", "--no-progress"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=two_nodes["env"], cwd=tmp_path)
    try:
        # wait for a trainer on the worker node that has a checkpoint, and kill that node outright
        victim, deadline = None, time.time() + 300
        while victim is None and time.time() < deadline and sweep.poll() is None:
            for pid in _marked(two_nodes["worker"]):
                argv = _read(f"/proc/{pid}/cmdline").decode(errors="replace").split("\0")
                if "rlseq.train" in argv:
                    folder = runs / f"{argv[argv.index('--memory') + 1]}-tiny" / f"seed{argv[argv.index('--seed') + 1]}"
                    if (folder / "checkpoints" / "latest").exists() and not (folder / "final_model.zip").exists():
                        victim = folder
            time.sleep(0.1)
        assert victim is not None, "no trainer with a checkpoint on the worker node within 300 s"
        _kill(_marked(two_nodes["worker"]))
        out = sweep.communicate(timeout=420)[0].decode()
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert sweep.returncode == 0, out[-4000:]
    assert "2 runs, 0 finished already, 2 to run on 2 slots" in out and "2 finished, 0 failed" in out
    status = {r["name"]: r for r in json.loads((tmp_path / "runs" / "sweep-tiny.json").read_text())["runs"]}
    assert sorted(status) == sorted(f"{POPGYM}/{m}-tiny/seed0" for m in ("efla", "none"))
    from rlseq.algos import MemoryPPO

    for name, row in status.items():
        folder = Path(row["folder"])
        log = (folder / "train.log").read_text()
        assert row["state"] == "done" and row["returncode"] == 0 and row["steps"] == steps, row
        assert log.count(f"done: {steps:,} env steps") == 1, f"{name} finished {log.count('done: ')} times"
        assert MemoryPPO.load(folder / "final_model.zip", device="cpu").num_timesteps == steps
        if folder == victim:  # rescheduled on the head node, resumed from its checkpoint
            assert row["attempts"] == 2 and log.count("=== ") == 2, (row, log[-2000:])
            assert "resuming" in log and f"start  {name}" in out and "rescheduled" in out
        else:
            assert row["attempts"] == 1 and log.count("=== ") == 1, (row, log[-2000:])
