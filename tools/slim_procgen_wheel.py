"""Shrink procgen's wheel for a size-capped upload: background folders a game never draws become 1x1 images.

procgen's wheel is 47.6 MB, 20 MB of it background images. The library loads every asset at start-up and stops
if one is missing, so they cannot simply be left out; a game draws only its own folder of backgrounds (caveflyer
and starpilot draw ``space_backgrounds``). This rewrites the wheel in place with a valid 1x1 PNG for each image of
the folders named in ``--stub`` and a RECORD that matches, and leaves everything else byte for byte.

    python tools/slim_procgen_wheel.py .gpu/wheels/procgen_mirror-*.whl            # caveflyer's default
    python tools/slim_procgen_wheel.py WHEEL --stub water_backgrounds               # a chosen set

A game whose backgrounds are stubbed renders differently, so the default keeps ``space_backgrounds``, and the
check below is worth running after any change to ``--stub``: the same seeds and actions must give the same frames
with the original wheel and the slim one.

    python tools/slim_procgen_wheel.py --check ORIGINAL.whl SLIM.whl --env caveflyer
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

ASSETS = "procgen/data/assets/"
# The background folders caveflyer never draws (it reads space_backgrounds only): 20 MB of the 25.6 MB of assets.
DEFAULT_STUB = ("platform_backgrounds", "platform_backgrounds_2", "topdown_backgrounds", "water_backgrounds")


def one_pixel_png() -> bytes:
    """A valid 1x1 opaque black RGBA PNG (procgen stops on an image that loads with width 0)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    header = struct.pack(">IIBBBBB", 1, 1, 8, 6, 0, 0, 0)  # width, height, 8-bit depth, RGBA, no interlace
    pixels = zlib.compress(b"\x00" + b"\x00\x00\x00\xff")  # filter byte, then one pixel
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(wheel: Path, stub: tuple[str, ...]) -> tuple[int, int, int]:
    """Rewrite ``wheel`` in place; returns (images stubbed, bytes before, bytes after)."""
    unknown = [f for f in stub if "/" in f or f in ("", ".", "..")]
    if unknown:
        raise SystemExit(f"--stub takes folder names under {ASSETS}, got {unknown}")
    png = one_pixel_png()
    before = wheel.stat().st_size
    with zipfile.ZipFile(wheel) as src:
        names = src.namelist()
        folders = {n[len(ASSETS):].split("/")[0] for n in names if n.startswith(ASSETS) and n.count("/") > 3}
        missing = sorted(set(stub) - folders)
        if missing:
            raise SystemExit(f"{wheel.name} has no asset folder {missing}; its folders: {sorted(folders)}")
        prefixes = tuple(ASSETS + f + "/" for f in stub)
        record = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        if record is None:
            raise SystemExit(f"{wheel.name} has no .dist-info/RECORD: not a wheel")
        replaced: dict[str, bytes] = {n: png for n in names if n.startswith(prefixes) and n.endswith(".png")}
        lines = []
        for line in src.read(record).decode().splitlines():
            name = line.rsplit(",", 2)[0]
            lines.append(record_line(name, replaced[name]) if name in replaced else line)
        fd, tmp = tempfile.mkstemp(dir=wheel.parent, suffix=".whl.tmp")
        os.close(fd)
        try:
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
                for info in src.infolist():
                    if info.filename == record:
                        dst.writestr(info, "\n".join(lines) + "\n")
                    elif info.filename in replaced:
                        dst.writestr(info, replaced[info.filename])
                    else:
                        dst.writestr(info, src.read(info.filename))
            os.chmod(tmp, wheel.stat().st_mode & 0o777)
            os.replace(tmp, wheel)  # the wheel is never half-written
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return len(replaced), before, wheel.stat().st_size


FRAMES = """
import hashlib, sys, numpy as np
from procgen import ProcgenGym3Env
env_name, num, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
env = ProcgenGym3Env(num=num, env_name=env_name, start_level=0, num_levels=0, rand_seed=7,
                     distribution_mode="hard", render_mode="rgb_array")
rng, h = np.random.default_rng(0), hashlib.sha256()
for _ in range(steps):
    env.act(rng.integers(0, 15, size=num, dtype=np.int32))
    rew, obs, first = env.observe()
    h.update(obs["rgb"].tobytes()); h.update(env.get_info()[0]["rgb"].tobytes()); h.update(first.tobytes())
print(h.hexdigest())
"""


def frames_digest(wheel: Path, env: str, num: int, steps: int) -> str:
    """Hash of every frame (the 64x64 observation and the 512x512 render) of a fixed run with ``wheel`` installed."""
    with tempfile.TemporaryDirectory() as site:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                        "--disable-pip-version-check", "--root-user-action=ignore", "--target", site, str(wheel)],
                       check=True)
        out = subprocess.run([sys.executable, "-c", FRAMES, env, str(num), str(steps)], check=True, text=True,
                             capture_output=True, env={**os.environ, "PYTHONPATH": site, "PYTHONWARNINGS": "ignore"})
    return out.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python tools/slim_procgen_wheel.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheels", nargs="+", type=Path, help="the wheel to slim; with --check, ORIGINAL SLIM")
    parser.add_argument("--stub", nargs="+", default=list(DEFAULT_STUB),
                        help=f"asset folders to replace with 1x1 images (default: {' '.join(DEFAULT_STUB)})")
    parser.add_argument("--check", action="store_true", help="compare two wheels' frames on a fixed run instead")
    parser.add_argument("--env", default="caveflyer", help="with --check: the game to run (default caveflyer)")
    parser.add_argument("--num", type=int, default=16, help="with --check: games side by side (default 16)")
    parser.add_argument("--steps", type=int, default=2000, help="with --check: steps of each (default 2000)")
    args = parser.parse_args(argv)
    if args.check:
        if len(args.wheels) != 2:
            parser.error("--check takes two wheels: ORIGINAL SLIM")
        digests = [frames_digest(w, args.env, args.num, args.steps) for w in args.wheels]
        same = digests[0] == digests[1]
        print(f"{args.env}, {args.num} games x {args.steps} steps: frames {'identical' if same else 'DIFFER'}"
              f" ({digests[0][:16]} / {digests[1][:16]})")
        sys.exit(0 if same else 1)
    for wheel in args.wheels:
        n, before, after = slim(wheel, tuple(args.stub))
        print(f"{wheel.name}: {n} images stubbed, {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
