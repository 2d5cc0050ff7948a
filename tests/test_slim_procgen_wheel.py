"""tools/slim_procgen_wheel.py: stubbed images are valid PNGs, the RECORD matches, nothing else changes.

Whether a game's frames stay the same is checked by the tool's ``--check`` against the real wheel (it needs the
wheel file, which CI does not keep); here a wheel of the same layout is built from scratch.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("slim_procgen_wheel", ROOT / "tools" / "slim_procgen_wheel.py")
slim_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slim_tool)

DIST = "procgen_mirror-0.10.7.dist-info"
ASSETS = "procgen/data/assets/"


def sha(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, rng_seed: int = 0) -> tuple[Path, dict[str, bytes]]:
    import random
    rng = random.Random(rng_seed)
    files = {
        "procgen/__init__.py": b"from .env import *\n",
        ASSETS + "space_backgrounds/space1.png": rng.randbytes(3000),
        ASSETS + "water_backgrounds/underwater1.png": rng.randbytes(5000),
        ASSETS + "water_backgrounds/underwater2.png": rng.randbytes(7000),
        ASSETS + "water_backgrounds/LICENSE.txt": b"CC0\n",
        ASSETS + "kenney/Tiles/lava.png": rng.randbytes(800),
        f"{DIST}/METADATA": b"Metadata-Version: 2.1\nName: procgen-mirror\nVersion: 0.10.7\n",
        f"{DIST}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},{sha(d)},{len(d)}\n" for n, d in files.items()) + f"{DIST}/RECORD,,\n"
    wheel = folder / "procgen_mirror-0.10.7-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{DIST}/RECORD", record)
    return wheel, files


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG, checking its signature, every chunk's CRC and that its pixels decompress."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks[kind] = body
        pos += 12 + length
    assert list(chunks)[-1] == b"IEND"
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 6)
    assert len(zlib.decompress(chunks[b"IDAT"])) == height * (1 + 4 * width)
    return width, height


def test_stubs_only_the_named_folders_and_keeps_the_record_true(tmp_path):
    wheel, files = make_wheel(tmp_path)
    n, before, after = slim_tool.slim(wheel, ("water_backgrounds",))
    assert n == 2 and after < before
    with zipfile.ZipFile(wheel) as z:
        assert z.testzip() is None
        content = {name: z.read(name) for name in z.namelist()}
        record = z.read(f"{DIST}/RECORD").decode().splitlines()
    assert set(content) == set(files) | {f"{DIST}/RECORD"}
    for name, data in files.items():
        if name.startswith(ASSETS + "water_backgrounds/") and name.endswith(".png"):
            assert png_size(content[name]) == (1, 1)
        else:
            assert content[name] == data, name
    listed = {line.rsplit(",", 2)[0]: line.rsplit(",", 2)[1:] for line in record}
    assert listed.pop(f"{DIST}/RECORD") == ["", ""]
    assert listed == {name: [sha(data), str(len(data))] for name, data in content.items()
                      if not name.endswith("RECORD")}


def test_the_slim_wheel_installs(tmp_path):
    wheel, _ = make_wheel(tmp_path)
    slim_tool.slim(wheel, ("water_backgrounds",))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--disable-pip-version-check", "--target", str(site), str(wheel)], check=True,
                   capture_output=True)
    stub = site / "procgen/data/assets/water_backgrounds/underwater1.png"
    assert png_size(stub.read_bytes()) == (1, 1)


def test_unknown_folder_lists_the_wheels_folders(tmp_path):
    wheel, _ = make_wheel(tmp_path)
    original = wheel.read_bytes()
    with pytest.raises(SystemExit, match=r"no asset folder \['lava_backgrounds'\].*'space_backgrounds'"):
        slim_tool.slim(wheel, ("lava_backgrounds",))
    with pytest.raises(SystemExit, match="folder names"):
        slim_tool.slim(wheel, ("kenney/Tiles",))
    assert wheel.read_bytes() == original
