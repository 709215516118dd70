"""Structure of Dockerfile.operator, Dockerfile.trainer and .dockerignore (no Docker engine here).

Each Dockerfile is parsed into instructions: base images pinned, the final stage runs as the
non-root user the chart and the operator expect, only the right extra is installed, pip leaves no
cache (and no pip at all in the operator image), the entry point is the one the chart / the
rendered JobSet runs, and everything COPY needs is in the build context.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from factory import make_job
from megatron_operator.render import render
from megatron_operator.settings import Settings
from megatron_operator.validation import parse_job

ROOT = Path(__file__).resolve().parents[2]
CHART_VALUES = ROOT / "charts" / "megatron-operator" / "values.yaml"


@dataclass
class Instruction:
    op: str
    args: str
    stage: int


def parse(path: Path) -> tuple[dict[str, str], list[Instruction]]:
    """(global ARG defaults, instructions with their stage index) of a Dockerfile."""
    text = re.sub(r"\\\n", " ", path.read_text())
    args: dict[str, str] = {}
    out: list[Instruction] = []
    stage = -1
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            stage += 1
        if op == "ARG" and stage == -1 and "=" in rest:
            key, value = rest.split("=", 1)
            args[key.strip()] = value.strip()
        out.append(Instruction(op, rest.strip(), stage))
    return args, out


def base_images(path: Path) -> list[str]:
    args, instrs = parse(path)
    images = []
    for i in instrs:
        if i.op == "FROM":
            ref = i.args.split()[0]
            images.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref))
    return images


def final_stage(path: Path) -> list[Instruction]:
    _, instrs = parse(path)
    last = max(i.stage for i in instrs)
    return [i for i in instrs if i.stage == last]


def runs(path: Path) -> list[str]:
    _, instrs = parse(path)
    return [i.args for i in instrs if i.op == "RUN"]


def exec_form(args: str) -> list[str]:
    return yaml.safe_load(args)  # JSON arrays are YAML


PINNED_TAG = re.compile(r"^[^:@]+:(?P<tag>[0-9][0-9.]*[0-9](-[a-z0-9.]+)*)$")


@pytest.mark.parametrize("dockerfile", ["Dockerfile.operator", "Dockerfile.trainer"])
def test_base_images_are_pinned(dockerfile):
    for image in base_images(ROOT / dockerfile):
        if "@sha256:" in image:
            assert re.search(r"@sha256:[a-f0-9]{64}$", image), image
            continue
        m = PINNED_TAG.match(image)
        assert m, f"{dockerfile}: base image {image!r} is neither a digest nor an exact version tag"
        assert "latest" not in image


@pytest.mark.parametrize("dockerfile", ["Dockerfile.operator", "Dockerfile.trainer"])
def test_no_package_manager_caches_are_left(dockerfile):
    for cmd in runs(ROOT / dockerfile):
        for pip in re.finditer(r"pip install[^&|;]*", cmd):
            assert "--no-cache-dir" in pip.group(0), f"{dockerfile}: {pip.group(0)!r} keeps pip's cache"
        if re.search(r"apt-get install|apt install", cmd):
            assert "rm -rf /var/lib/apt/lists" in cmd, f"{dockerfile}: apt lists left behind"
        assert not re.search(r"\b(conda|mamba|apk) (install|add)\b", cmd), f"{dockerfile}: another package manager"


def _installs(dockerfile: str) -> list[str]:
    found = []
    for cmd in runs(ROOT / dockerfile):
        for pip in re.finditer(r"pip install[^&|;]*", cmd):
            # options, and the optional offline form ${WHEELHOUSE:+--no-index --find-links=...}
            found += [a for a in shlex.split(pip.group(0))[2:] if not a.startswith(("-", "$"))]
    return found


def test_operator_image_installs_offline_from_a_wheelhouse_when_given_one():
    """scripts/images.sh passes WHEELHOUSE: pip must then never contact an index."""
    cmds = " ".join(runs(ROOT / "Dockerfile.operator"))
    assert "${WHEELHOUSE:+--no-index --find-links=$WHEELHOUSE}" in cmds
    _, instrs = parse(ROOT / "Dockerfile.operator")
    assert any(i.op == "ARG" and i.args == "WHEELHOUSE=" and i.stage == 0 for i in instrs), \
        "WHEELHOUSE must default to empty (PyPI) in the build stage"


def test_operator_image_installs_only_the_operator_extra_pinned():
    cmds = " ".join(runs(ROOT / "Dockerfile.operator"))
    targets = _installs("Dockerfile.operator")
    constraint_files = re.findall(r"--constraint (\S+)", cmds)
    assert constraint_files == ["constraints.txt"], "every operator dependency must be pinned by constraints.txt"
    assert [t for t in targets if t not in constraint_files] == [".[operator]"]
    def norm(name: str) -> str:  # PEP 503
        return re.sub(r"[-_.]+", "-", name).lower()

    pinned = {norm(line.split("==")[0]) for line in (ROOT / "constraints.txt").read_text().splitlines()
              if "==" in line}
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["operator"]
    for req in extra:
        name = norm(re.split(r"[<>=!~\[ ]", req)[0])
        assert name in pinned, f"{name} (operator extra) is not pinned in constraints.txt"


def test_operator_image_is_slim_python_312_and_keeps_no_pip():
    images = base_images(ROOT / "Dockerfile.operator")
    assert all(re.match(r"python:3\.12\.\d+-slim", i) for i in images), images
    final = " ".join(i.args for i in final_stage(ROOT / "Dockerfile.operator") if i.op == "RUN")
    assert "pip uninstall --yes pip" in final  # the base image's pip
    build = " ".join(runs(ROOT / "Dockerfile.operator"))
    assert "/opt/venv/bin/pip uninstall --yes pip" in build  # the venv's pip, copied into the final stage


def test_operator_image_user_and_entrypoint_match_the_chart():
    final = {i.op: i.args for i in final_stage(ROOT / "Dockerfile.operator")}
    uid, gid = final["USER"].split(":")
    values = yaml.safe_load(CHART_VALUES.read_text())
    assert int(uid) != 0 and int(uid) == values["podSecurityContext"]["runAsUser"]
    assert int(gid) == values["podSecurityContext"]["runAsGroup"]
    assert exec_form(final["ENTRYPOINT"]) == ["megatron-operator"]  # the chart's container command
    assert exec_form(final["CMD"]) == ["run"]
    assert "PYTHONDONTWRITEBYTECODE=1" in final["ENV"]  # read-only root filesystem
    # kopf calls getpass.getuser(): the uid needs a passwd entry (a kubelet adds none)
    assert f"useradd --system --uid {uid} --gid {gid}" in final["RUN"]


def test_trainer_image_is_ngc_pytorch_with_only_the_trainer_extra():
    images = base_images(ROOT / "Dockerfile.trainer")
    assert len(images) == 1 and re.match(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", images[0]), images
    targets = _installs("Dockerfile.trainer")
    # two layers: the trainer extra's dependencies, then the project itself without them (--no-deps)
    assert [t for t in targets if not t.startswith("/tmp/")] == [".[trainer]", "."]
    cmds_all = runs(ROOT / "Dockerfile.trainer")
    project = [c for c in cmds_all if re.search(r"pip install[^&|;]*--no-deps[^&|;]* \.(\s|$)", c)]
    assert len(project) == 1 and "megatron_trainer.objstore" in project[0], cmds_all  # and its import check
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trainer"]
    assert any(re.fullmatch(r"megatron-core==\d+\.\d+\.\d+", r) for r in extra), "megatron-core must be pinned"
    # torch and Transformer Engine come from the base image and are frozen, never pulled from PyPI
    assert not any(re.match(r"(torch|transformer.engine)\b", r) for r in extra)
    cmds = " ".join(runs(ROOT / "Dockerfile.trainer"))
    assert "--constraint /tmp/base-constraints.txt" in cmds and "transformer" in cmds


def _pins(name: str) -> dict[str, str]:
    return {re.sub(r"[-_.]+", "-", line.split("==")[0]).lower(): line.split("==")[1].strip()
            for line in (ROOT / name).read_text().splitlines() if "==" in line and not line.startswith("#")}


def test_trainer_image_pins_its_extra_with_multi_storage_client_and_no_kubernetes_client():
    """Issue 33: the trainer image installs multi-storage-client[boto3], pinned by constraints-trainer.txt,
    which agrees with the venvs the object-store and torch tests ran in; no Kubernetes client, so boto3's
    python-dateutil<3 meets nothing that needs >=3 (the operator's constraints.txt pins 4.x)."""
    pins = _pins("constraints-trainer.txt")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trainer"]
    assert any(r.startswith("multi-storage-client[boto3]") for r in extra)
    for req in extra:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[ ]", req)[0]).lower()
        assert name in pins, f"{name} (trainer extra) is not pinned in constraints-trainer.txt"
    assert {"boto3", "botocore", "python-dateutil"} <= pins.keys()
    assert int(pins["python-dateutil"].split(".")[0]) < 3
    assert "kubernetes" not in pins and "kopf" not in pins
    for other in ("constraints-objstore.txt", "constraints-torch.txt"):
        differ = {n: (v, pins[n]) for n, v in _pins(other).items() if n in pins and pins[n] != v}
        assert not differ, f"constraints-trainer.txt and {other} disagree: {differ}"
    cmds = " ".join(runs(ROOT / "Dockerfile.trainer"))
    # the pins less what the base image froze (a second pin of torch would conflict with NGC's build)
    assert "constraints-trainer.txt" in cmds and "--constraint /tmp/image-constraints.txt" in cmds


def test_trainer_image_matches_what_the_operator_renders():
    final = {}
    for i in final_stage(ROOT / "Dockerfile.trainer"):
        final.setdefault(i.op, []).append(i.args)
    job = parse_job(make_job())
    jobset = next(o for o in render(job, Settings(), owner_uid="u") if o["kind"] == "JobSet")
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    uid, gid = final["USER"][-1].split(":")
    assert int(uid) == pod["securityContext"]["runAsUser"] == Settings().run_as_user
    assert int(gid) == pod["securityContext"]["runAsGroup"]
    assert exec_form(final["ENTRYPOINT"][-1]) == container["command"][:3] == ["python", "-m",
                                                                             "megatron_trainer.launch"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "HOME=/tmp" in " ".join(final["ENV"]) and env["HOME"] == "/tmp"
    assert any("useradd --uid 1000" in r for r in final["RUN"])
    assert final["WORKDIR"][-1] == "/tmp"  # writable (emptyDir) under a read-only root filesystem
    ports = {p["containerPort"] for p in container["ports"]}
    assert {int(p) for p in final["EXPOSE"][-1].split()} == ports


# ---- the build context -------------------------------------------------------------------------------------

def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        for cand in candidates:
            if fnmatch.fnmatch(cand, pat) or (pat.startswith("**/") and (
                    fnmatch.fnmatch(cand, pat[3:]) or fnmatch.fnmatch(cand.rsplit("/", 1)[-1], pat[3:]))):
                excluded = not negate
                break
    return excluded


def copy_sources(dockerfile: str) -> list[str]:
    _, instrs = parse(ROOT / dockerfile)
    out = []
    for i in instrs:
        if i.op == "COPY" and not i.args.startswith("--from"):
            out += i.args.split()[:-1]
    return out


@pytest.mark.parametrize("dockerfile", ["Dockerfile.operator", "Dockerfile.trainer"])
def test_everything_copied_is_in_the_build_context(dockerfile):
    for src in copy_sources(dockerfile):
        path = src.rstrip("/")
        assert (ROOT / path).exists(), f"{dockerfile} copies {src}, which does not exist"
        assert not dockerignore_excludes(path), f".dockerignore excludes {src}, which {dockerfile} copies"
    for needed in ("operator/megatron_operator/cli.py", "trainer_image/megatron_trainer/main.py",
                   "contract/megatron_contract/hf_config.py", "pyproject.toml", "README.md"):
        assert not dockerignore_excludes(needed), needed


@pytest.mark.parametrize("dockerfile", ["Dockerfile.operator", "Dockerfile.trainer"])
def test_every_source_root_is_copied_into_the_image_and_on_the_tests_path(dockerfile):
    """pyproject.toml's package finder builds the wheel from its source roots: an image that does not
    copy one installs a package that fails on its first import of it (megatron_contract, the leaf both
    the operator and the trainer import)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    roots = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    assert {"operator", "trainer_image", "contract"} <= set(roots)
    assert pyproject["tool"]["pytest"]["ini_options"]["pythonpath"] == roots
    copied = {src.rstrip("/") for src in copy_sources(dockerfile)}
    assert set(roots) <= copied, f"{dockerfile} does not copy {sorted(set(roots) - copied)}"


@pytest.mark.parametrize("path", [".venv/bin/python", ".git/HEAD", "tests/unit/test_chart.py", "e2e/k8s.py",
                                  "charts/megatron-operator/values.yaml", "operator/megatron_operator/__pycache__/x.pyc",
                                  "megatron_operator.egg-info/PKG-INFO", "bench/x.py", "docs/install.md"])
def test_build_context_leaves_out_the_rest(path):
    assert dockerignore_excludes(path), path
