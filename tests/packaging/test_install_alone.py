"""Each package is publishable and installs alone.

Wheels and sdists require ``gdn-core`` by name and version range (never a path);
each wheel (plus gdn-core's) installs alone into a fresh venv; one package
resolves its dependencies from a local wheelhouse; and the checkout's documented
install (``pip install packages/gdn-core packages/<pkg>``) works from elsewhere.

The venvs see the running environment's packages (``--system-site-packages``,
and, when the tests themselves run in a venv such as Hatch's, a ``.pth``
bridge to that venv's site-packages) so that torch, numpy, triton, pip and
hatchling come from there and nothing is downloaded.  Everything is checked
against the venv's *own* site-packages, since the surrounding environment may
hold editable installs of the repo's packages.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES_DIR = REPO_ROOT / "packages"
CORE = "gdn-core"
EXPECTED_PACKAGES = {
    "gdn-core",
    "gdn-train",
    "gdn-det-train",
    "gdn-train-kcp",
    "gdn-det-train-kcp",
    "kda-det-train",
}
TIMEOUT = 300


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _discover() -> tuple[dict[str, str], dict[str, Path]]:
    """(dist name -> import name, dist name -> project dir) from packages/*/pyproject.toml."""
    imports, dirs = {}, {}
    for pyproject in sorted(PACKAGES_DIR.glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        dist = canonical(data["project"]["name"])
        imports[dist] = dist.replace("-", "_")
        dirs[dist] = pyproject.parent
    return imports, dirs


PACKAGES, PROJECT_DIRS = _discover()
REPO_DISTS = set(PACKAGES)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV", "PIP_USER", "VIRTUAL_ENV"):
        env.pop(var, None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    if proc.returncode != 0:
        pytest.fail(
            f"command failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


# ------------------------------------------------------------ wheels ---


class Builder:
    """Builds one artifact per package into ``out/<dist>/`` once, and remembers it."""

    pattern = "*.whl"

    def __init__(self, out: Path):
        self.out = out
        self.cache: dict[str, Path] = {}

    def command(self, dist: str, dest: Path) -> tuple[list[str], Path]:
        """(the build command, its working directory)."""
        return ([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--no-index", "-q", "-w", str(dest), str(PROJECT_DIRS[dist])], self.out)

    def __call__(self, dist: str) -> Path:
        if dist not in self.cache:
            dest = self.out / dist
            dest.mkdir(parents=True)
            _run(*self.command(dist, dest))
            built = list(dest.glob(self.pattern))
            assert len(built) == 1, built
            self.cache[dist] = built[0]
        return self.cache[dist]


class SdistBuilder(Builder):
    pattern = "*.tar.gz"

    def command(self, dist: str, dest: Path) -> tuple[list[str], Path]:
        return ([sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-d", str(dest)],
                PROJECT_DIRS[dist])


@pytest.fixture(scope="session")
def build_wheel(tmp_path_factory) -> Builder:
    """Builds each package's wheel once per session (gdn-core's is shared)."""
    return Builder(tmp_path_factory.mktemp("wheels"))


@pytest.fixture(scope="session")
def build_sdist(tmp_path_factory) -> SdistBuilder:
    """Builds each package's sdist once per session."""
    return SdistBuilder(tmp_path_factory.mktemp("sdists"))


def sdist_metadata(sdist: Path) -> tuple[email.message.Message, list[str]]:
    """(PKG-INFO, member names relative to the sdist's top folder)."""
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
        (info,) = [n for n in names if re.fullmatch(r"[^/]+/PKG-INFO", n)]
        meta = email.parser.Parser().parsestr(tf.extractfile(info).read().decode("utf-8"))
    return meta, [n.split("/", 1)[1] for n in names if "/" in n]


def wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        return email.parser.Parser().parsestr(zf.read(name).decode("utf-8"))


def requires_dist(meta: email.message.Message) -> dict[str, str]:
    """canonical name -> full requirement string."""
    out = {}
    for req in meta.get_all("Requires-Dist") or []:
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1)
        out[canonical(name)] = req
    return out


# -------------------------------------------------------------- venvs ---


def _is_repo_entry(name: str) -> bool:
    """A site-packages entry of one of the repo's distributions (module, dist-info,
    editable hook)."""
    stem = canonical(re.sub(r"^__editable__[._]", "", name).split("-")[0].split(".")[0])
    return any(stem == canonical(d) for d in REPO_DISTS)


class Venv:
    def __init__(self, path: Path):
        self.path = path
        _run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(path)],
             cwd=path.parent)  # fmt: skip
        bindir = "Scripts" if os.name == "nt" else "bin"
        self.python = str(path / bindir / ("python.exe" if os.name == "nt" else "python"))
        self.purelib = Path(self.eval("import sysconfig; print(sysconfig.get_paths()['purelib'])"))
        if sys.prefix != sys.base_prefix:
            # We run inside a venv (e.g. Hatch's): --system-site-packages reaches
            # only the base interpreter's, so bridge to ours for torch & co. —
            # through a folder of links that leaves out the repo's own
            # distributions (pip would count their editable installs as
            # satisfying a requirement by name). Plain path lines: the .pth
            # files there (editable installs) stay inactive.
            bridge = path.parent / "parent-env"
            bridge.mkdir()
            for sp in site.getsitepackages():
                for entry in Path(sp).iterdir() if Path(sp).is_dir() else ():
                    if not _is_repo_entry(entry.name) and not (bridge / entry.name).exists():
                        (bridge / entry.name).symlink_to(entry)
            (self.purelib / "_parent_env.pth").write_text(f"{bridge}\n")

    def eval(self, code: str) -> str:
        return _run([self.python, "-c", code], cwd=self.path).stdout.strip()

    def pip(self, *args: str) -> subprocess.CompletedProcess:
        return _run([self.python, "-m", "pip", *args], cwd=self.path)

    def own_dists(self) -> set[str]:
        """Distributions installed in the venv's own site-packages."""
        names = set()
        for info in self.purelib.glob("*.dist-info"):
            meta = email.parser.Parser().parsestr((info / "METADATA").read_text("utf-8"))
            names.add(canonical(meta["Name"]))
        return names

    def inspect(self, *dists: str) -> dict[str, dict]:
        """Import each dist's package in the venv: its __version__, __file__ and
        the version importlib.metadata reports."""
        modules = {d: PACKAGES[d] for d in dists}
        code = (
            "import importlib, importlib.metadata as md, json\n"
            "out = {}\n"
            f"for dist, mod in {modules!r}.items():\n"
            "    m = importlib.import_module(mod)\n"
            "    out[dist] = {'version': getattr(m, '__version__', None), 'file': m.__file__,\n"
            "                 'dist_version': md.version(dist)}\n"
            "print(json.dumps(out))\n"
        )
        return json.loads(self.eval(code).splitlines()[-1])


@pytest.fixture
def venv(tmp_path) -> Venv:
    return Venv(tmp_path / "venv")


def _under(path: str | Path, parent: Path) -> bool:
    try:
        Path(path).resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


# -------------------------------------------------------------- tests ---


def test_the_six_packages_are_there():
    assert set(PACKAGES) == EXPECTED_PACKAGES


def _check_requirements(dist: str, meta: email.message.Message, core_version: str) -> None:
    """Only gdn-core of the repo, by name and a version range holding its version."""
    assert canonical(meta["Name"]) == dist
    reqs = requires_dist(meta)
    assert not any("@" in r or "file:" in r for r in reqs.values()), reqs
    repo_reqs = set(reqs) & REPO_DISTS
    if dist == CORE:
        assert repo_reqs == set(), reqs
        return
    assert repo_reqs == {CORE}, reqs
    spec = Requirement(reqs[CORE]).specifier
    assert str(spec) and spec.contains(core_version), (reqs[CORE], core_version)


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_wheel_requires_gdn_core_by_name_and_range(dist, build_wheel):
    core_version = wheel_metadata(build_wheel(CORE))["Version"]
    _check_requirements(dist, wheel_metadata(build_wheel(dist)), core_version)


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_sdist_has_the_wheel_s_metadata_and_sources(dist, build_wheel, build_sdist):
    meta, names = sdist_metadata(build_sdist(dist))
    wheel = wheel_metadata(build_wheel(dist))
    _check_requirements(dist, meta, wheel_metadata(build_wheel(CORE))["Version"])
    assert meta["Version"] == wheel["Version"]
    assert sorted(meta.get_all("Requires-Dist") or []) == \
        sorted(wheel.get_all("Requires-Dist") or [])
    module = PACKAGES[dist]
    assert {"pyproject.toml", "README.md", f"src/{module}/__init__.py"} <= set(names), names
    assert "CHANGELOG.md" in names, f"{dist}: no CHANGELOG.md in the sdist"


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_install_alone(dist, build_wheel, venv):
    wheel = build_wheel(dist)
    wheels = [wheel] if dist == CORE else [wheel, build_wheel(CORE)]
    venv.pip("install", "--no-deps", "--no-index", "-q", *map(str, wheels))

    expected = {dist, CORE}
    assert venv.own_dists() == expected

    info = venv.inspect(*sorted(expected))
    for d in expected:
        version = wheel_metadata(build_wheel(d))["Version"]
        assert info[d]["version"] == version, d
        assert info[d]["dist_version"] == version, d
        assert _under(info[d]["file"], venv.purelib), info[d]  # not the checkout's src/


def test_install_from_a_wheelhouse_resolves_gdn_core_by_name(build_wheel, venv):
    """``pip install --find-links <wheelhouse> gdn-det-train-kcp``: the dependencies
    are resolved (gdn-core from the wheelhouse; torch & co. already present)."""
    dist = "gdn-det-train-kcp"
    house = venv.path.parent / "wheelhouse"
    house.mkdir()
    for d in (dist, CORE):
        (house / build_wheel(d).name).write_bytes(build_wheel(d).read_bytes())
    venv.pip("install", "--no-index", "--find-links", str(house), "-q", dist)
    assert venv.own_dists() == {dist, CORE}
    for info in venv.inspect(dist, CORE).values():
        assert _under(info["file"], venv.purelib), info


def test_install_from_checkout(venv):
    """The README's ``pip install packages/gdn-core packages/gdn-det-train-kcp``, run
    from another directory (absolute paths)."""
    dist = "gdn-det-train-kcp"
    venv.pip("install", "--no-build-isolation", "--no-index", "-q", str(PROJECT_DIRS[CORE]),
             str(PROJECT_DIRS[dist]))
    assert venv.own_dists() == {dist, CORE}
    for d, info in venv.inspect(dist, CORE).items():
        assert _under(info["file"], venv.purelib), info
        assert info["version"] == info["dist_version"], d
