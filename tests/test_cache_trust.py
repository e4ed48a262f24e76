"""Caches trust no file another local user could plant, read or change (issue 40, finding 5).

Real parts: a real other user (made here with ``useradd``, removed at the end) runs small Python scripts as its own
uid; a dataset written by ``write_shards`` and an image folder on local disk; the node shard cache of
``StreamingDataset`` and ``S3ImageFolder``'s blob cache in a folder shared by the users (``/tmp``-like, 1777).
The attacks: a shard forged to the index's size and CRC-32 (4 bytes chosen by solving CRC-32's linear system)
planted where the cache used to look; the cache's folder name taken first; the download claim's abstract socket
name bound first (each shard then waited 120 s); a planted genuine copy rewritten in place after the reader
checked it; the cached files read by the other user. Needs root (to make the user and act as it): skipped
otherwise, saying so.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from test_streaming import make_folder

from dask_ddp.data import S3ImageFolder, StreamingDataset, write_shards
from dask_ddp.data.streaming.cache import ShardCache
from dask_ddp.data.streaming.format import crc32

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                                reason="acts as another local user (useradd, then its uid): needs root")


class Other:
    """A local user made for the module: runs Python scripts as its own uid and gid, no other group."""

    def __init__(self, name: str) -> None:
        import pwd

        entry = pwd.getpwnam(name)
        self.name, self.uid, self.gid = name, entry.pw_uid, entry.pw_gid
        self.python = next((p for p in ("/usr/bin/python3", os.path.realpath(sys.executable)) if self._runs(p)), None)

    def _runs(self, python: str) -> bool:
        try:
            return self.run("print('ok')", python=python, check=False).stdout.strip() == b"ok"
        except OSError:  # not executable by this user (a Python under root's home)
            return False

    def popen(self, code: str, *args: str, python: str | None = None, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen([python or self.python, "-I", "-c", textwrap.dedent(code), *args], user=self.uid,
                                group=self.gid, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin", **(env or {})},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def run(self, code: str, *args: str, stdin: bytes = b"", python: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        proc = self.popen(code, *args, python=python)
        out, err = proc.communicate(stdin, timeout=60)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            assert proc.returncode == 0, err.decode()[-2000:]
        return done


@pytest.fixture(scope="module")
def other():
    name = f"ddp{uuid.uuid4().hex[:10]}"
    made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], capture_output=True,
                          text=True)
    if made.returncode:
        pytest.skip(f"useradd could not make a user: {made.stderr.strip()}")
    try:
        user = Other(name)
        if user.python is None:
            pytest.skip("no Python interpreter the other user can run")
        yield user
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def shared():
    """A folder every local user may write, as /tmp (mode 1777)."""
    folder = tempfile.mkdtemp(prefix="dask-ddp-shared-", dir="/tmp")
    os.chmod(folder, 0o1777)
    try:
        yield Path(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def dataset(tmp_path):
    truth = make_folder(tmp_path / "src", n=24)
    write_shards(str(tmp_path / "src"), str(tmp_path / "shards"), shard_size="20KB", progress=False, client=False)
    return str(tmp_path / "shards"), truth


def raw(data, ext):
    return bytes(data)


def forge(data: bytes, at: int, target: int) -> bytes:
    """``data`` with the 4 bytes at ``at`` chosen so that its CRC-32 is ``target`` (CRC-32 is affine over GF(2):
    solve its 32 x 32 system). What makes a size-and-CRC check no defence against a planted file."""
    base = bytearray(data)
    base[at:at + 4] = bytes(4)
    c0 = crc32(bytes(base))
    rows = []  # (effect on the CRC, the bit that has it)
    for k in range(32):
        flipped = bytearray(base)
        flipped[at + k // 8] ^= 1 << (k % 8)
        rows.append((crc32(bytes(flipped)) ^ c0, 1 << k))
    want, basis = target ^ c0, []  # Gaussian elimination: reduce want by a basis of the effects
    for effect, bits in rows:
        for b_effect, b_bits in basis:
            if effect ^ b_effect < effect:
                effect, bits = effect ^ b_effect, bits ^ b_bits
        if effect:
            basis.append((effect, bits))
            basis.sort(reverse=True)
    chosen = 0
    for b_effect, b_bits in basis:
        if want ^ b_effect < want:
            want, chosen = want ^ b_effect, chosen ^ b_bits
    assert want == 0, "CRC-32 could not be forged"
    base[at:at + 4] = chosen.to_bytes(4, "little")
    assert crc32(bytes(base)) == target
    return bytes(base)


def forged_shard(ds: StreamingDataset, j: int) -> tuple[bytes, int]:
    """Shard ``j`` with its first sample's bytes replaced (same length), then forged to the index's CRC-32;
    and that sample's number."""
    i = int(next(k for k in range(len(ds)) if ds.index.shard[k] == j))
    o, n = int(ds.index.offset[i]), int(ds.index.length[i])
    genuine = Path(ds.url, ds.index.shards[j]).read_bytes()
    evil = genuine[:o] + (b"EVIL" * n)[:n] + genuine[o + n:]
    evil = forge(evil, o + n - 4, ds.index.crcs[j])  # the 4 bytes: the sample's last ones
    assert len(evil) == ds.index.sizes[j] and crc32(evil) == ds.index.crcs[j] and evil != genuine
    return evil, i


def old_name(cache_dir: Path, ds: StreamingDataset, j: int) -> Path:
    """Where the cache looked for shard ``j`` before it was private: ``cache_dir/<name>``."""
    return cache_dir / ShardCache.name(f"{ds.url}/{ds.index.shards[j]}", ds.index.sizes[j], ds.index.crcs[j])


PLANT = """
import os, sys
path, mode = sys.argv[1], int(sys.argv[2], 8)
os.makedirs(os.path.dirname(path), mode=0o777, exist_ok=True)
os.chmod(os.path.dirname(path), 0o777)
with open(path, "wb") as f:
    f.write(sys.stdin.buffer.read())
os.chmod(path, mode)
"""


def test_a_shard_planted_with_the_right_size_and_crc_is_never_read(other, shared, dataset, caplog):
    url, truth = dataset
    cache_dir = shared / "cache"
    ds = StreamingDataset(url, shuffle=False, decoder=raw, cache_dir=cache_dir)
    evil, i = forged_shard(ds, 0)
    other.run(PLANT, str(old_name(cache_dir, ds, 0)), "644", stdin=evil)  # the other user made cache_dir, too
    assert ds[i][0] == truth[ds.index.keys[i]][0], "the planted shard was read"
    assert all(ds[k][0] == truth[ds.index.keys[k]][0] for k in range(len(ds)))

    # the other user takes the private folder's name first: the cache is refused (off, said so), samples still load
    cache_dir2 = shared / "cache2"
    private = cache_dir2 / f"dask-ddp-{os.geteuid()}"
    other.run(PLANT, str(private / old_name(cache_dir2, ds, 0).name), "644", stdin=evil)
    fresh = StreamingDataset(url, shuffle=False, decoder=raw, cache_dir=cache_dir2)
    caplog.set_level("WARNING", logger="dask_ddp.data")
    assert fresh[i][0] == truth[fresh.index.keys[i]][0]
    warned = [r.getMessage() for r in caplog.records if "shard cache" in r.getMessage()]
    assert warned and f"owned by uid {other.uid}" in warned[0] and str(private) in warned[0], warned

    # a file in the private folder that this user does not own (made there by root for another uid) is not used
    cache_dir3 = shared / "cache3"
    mine = ShardCache(cache_dir3, 1 << 30)
    planted = Path(mine.folder) / old_name(cache_dir3, ds, 0).name
    planted.write_bytes(evil)
    os.chown(planted, other.uid, other.gid)
    third = StreamingDataset(url, shuffle=False, decoder=raw, cache_dir=cache_dir3)
    assert third[i][0] == truth[third.index.keys[i]][0]
    assert planted.stat().st_uid == os.geteuid() and planted.read_bytes() != evil  # removed, then cached anew


READ_ALL = """
import os, sys
found, readable = [], []
for top, dirs, files in os.walk(sys.argv[1]):
    for n in dirs + files:
        found.append(os.path.join(top, n))
        if n in files:
            try:
                with open(os.path.join(top, n), "rb") as f:
                    f.read(1)
                readable.append(os.path.join(top, n))
            except OSError:
                pass
print(repr((found, readable)))
"""


def test_the_caches_are_private_to_their_user(other, shared, dataset, tmp_path):
    import ast

    url, truth = dataset
    ds = StreamingDataset(url, shuffle=False, decoder=raw, cache_dir=shared / "shards")
    assert [ds[k][0] for k in range(len(ds))] == [truth[k][0] for k in ds.index.keys]
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    (tmp_path / "imgs" / "a" / "1.png").write_bytes(b"\x89PNG not really")
    images = S3ImageFolder(str(tmp_path / "imgs"), loader=lambda f: f.read(), cache=shared / "images")
    assert images[0][0] == b"\x89PNG not really"
    assert images[0][0] == b"\x89PNG not really"  # the second read: from the cache

    for cache in (shared / "shards", shared / "images"):
        private = cache / f"dask-ddp-{os.geteuid()}"
        cached = [Path(top, n) for top, _, files in os.walk(cache) for n in files if not n.startswith(".")]
        assert cached, f"nothing was cached in {cache}: the test tests nothing"
        found, readable = ast.literal_eval(other.run(READ_ALL, str(cache)).stdout.decode())
        assert readable == [], f"another user read {readable}"
        assert found == [str(private)], f"another user sees {found}"  # the private folder, not what is in it
        assert stat.S_IMODE(private.stat().st_mode) == 0o700 and private.stat().st_uid == os.geteuid()
        for top, dirs, files in os.walk(private):
            assert all(stat.S_IMODE(os.stat(Path(top, d)).st_mode) == 0o700 for d in dirs)
            assert all(stat.S_IMODE(os.stat(Path(top, f)).st_mode) == 0o600 for f in files)


SQUAT = """
import hashlib, os, socket, sys, time
folder, names = sys.argv[1], sys.argv[2:]
held = []
for name in names:  # the claim's abstract socket name, as the cache made it: predictable by anyone
    key = hashlib.sha256(f"{os.path.realpath(folder)}\\0{name}".encode()).hexdigest()[:40]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(f"\\0dask-ddp-shard-{key}")
    held.append(s)
private = os.path.join(folder, f"dask-ddp-{os.environ.get('VICTIM', '0')}")
try:
    open(os.path.join(private, ".claims"), "r+b")
    print("claims: opened", flush=True)
except OSError as err:
    print(f"claims: {type(err).__name__}", flush=True)
sys.stdin.read()  # hold the names until the test ends
"""


def test_a_claim_another_user_squats_does_not_hold_up_the_download(other, shared, dataset):
    url, truth = dataset
    cache_dir = shared / "cache"
    ds = StreamingDataset(url, shuffle=False, decoder=raw, cache_dir=cache_dir)
    ShardCache(cache_dir, 1 << 30)  # the private folder exists: the other user tries its claims file too
    names = [old_name(cache_dir, ds, j).name for j in range(len(ds.index.shards))]
    squatter = other.popen(SQUAT, str(cache_dir), *names, env={"VICTIM": str(os.geteuid())})
    try:
        said = squatter.stdout.readline().decode()  # once it holds every name
        assert said.startswith("claims: "), squatter.stderr.read1().decode()
        started = time.monotonic()
        first = [int(next(k for k in range(len(ds)) if ds.index.shard[k] == j)) for j in (0, 1)]
        got = [ds[k][0] for k in first]  # each: its shard fetched whole, through the cache (before: 120 s each)
        took = time.monotonic() - started
    finally:
        squatter.stdin.close()
        squatter.kill()
        squatter.wait(10)
    assert got == [truth[ds.index.keys[k]][0] for k in first]
    print(f"2 shards loaded in {took:.2f} s with every abstract claim name squatted")
    assert took < 30, f"2 shards took {took:.0f} s: the squatted claims held them up"
    assert said.strip() == "claims: PermissionError", said  # the claims of the private folder: out of its reach
    assert set(names[:2]) <= set(os.listdir(ds.fetcher.cache.folder))  # both were cached (the claims worked)


REWRITE = """
import sys
path = sys.argv[1]
with open(path, "r+b") as f:
    size = len(f.read())
    f.seek(0)
    f.write(b"Z" * size)
"""


def test_a_file_changed_after_the_check_does_not_change_what_the_reader_holds(other, shared, dataset):
    url, _ = dataset
    cache_dir = shared / "cache"
    ds = StreamingDataset(url, shuffle=False, decoder=raw, cache_dir=cache_dir)
    genuine = Path(url, ds.index.shards[0]).read_bytes()
    planted = old_name(cache_dir, ds, 0)
    other.run(PLANT, str(planted), "666", stdin=genuine)  # a genuine copy: it passes any check of its bytes
    held = ds.fetcher.get(0)
    assert crc32(held) == ds.index.crcs[0]
    other.run(REWRITE, str(planted))
    assert bytes(held[:]) == genuine, "the bytes the reader checked and holds changed under it"

    # the same for a local dataset's shard that another user can write (mapped where it is before)
    (shared / "data").mkdir(mode=0o755)
    for name in (*ds.index.shards, "index.json"):
        shutil.copy(Path(url, name), shared / "data" / name)
        os.chmod(shared / "data" / name, 0o666)
    local = StreamingDataset(str(shared / "data"), shuffle=False, decoder=raw)
    held = local.fetcher.get(0)
    assert bytes(held[:]) == genuine
    other.run(REWRITE, str(shared / "data" / ds.index.shards[0]))
    assert bytes(held[:]) == genuine, "a shard another user can write was mapped: its bytes changed under the reader"

    # and our own cache file swapped for another after it was opened: the reader keeps what it checked
    own = ShardCache(shared / "own", 1 << 30)
    own.put("a.tar", genuine)
    got = own.get("a.tar")
    other_file = Path(own.folder) / "b.tar"
    other_file.write_bytes(b"Z" * len(genuine))
    os.replace(other_file, Path(own.folder) / "a.tar")
    assert bytes(got[:]) == genuine


def test_an_image_planted_in_a_shared_blob_cache_is_never_read(other, shared, tmp_path):
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (10, 20, 30)).save(buf, format="PNG")
    genuine = buf.getvalue()
    (tmp_path / "imgs" / "a" / "1.png").write_bytes(genuine)
    cache = shared / "images"
    data = S3ImageFolder(str(tmp_path / "imgs"), loader=lambda f: f.read(), cache=cache)
    url = data.samples[0][0]
    digest = hashlib.sha256(url.encode()).hexdigest()
    other.run(PLANT, str(cache / digest[:2] / digest[2:]), "644", stdin=b"planted by another user")
    assert data[0][0] == genuine, "the planted object was read"
    assert data[0][0] == genuine  # from the cache now
    private = cache / f"dask-ddp-{os.geteuid()}"
    assert (private / digest[:2] / digest[2:]).read_bytes() == genuine
