"""Build docker/Dockerfile for real on a stand-in base, and run the image's tools inside a build.

Where no image registry is reachable the official base (lmsysorg/sglang:v0.5.17-cu130) cannot
be pulled, but Debian's archive and PyPI can be. This script, end to end:

1. installs podman (and mmdebstrap) with apt-get when missing;
2. makes a Debian bookworm root filesystem with mmdebstrap and imports it as
   ``localhost/oscar-standin-rootfs:bookworm``;
3. builds the stand-in base ``localhost/oscar-standin-sglang:0.5.17`` on it
   (docker/standin-base.Containerfile: torch 2.11.0 and sglang 0.5.17 with setup.py's pins,
   from PyPI; several GB of CUDA wheels);
4. builds the real docker/Dockerfile on it as ``localhost/oscar-sglang:latest``
   (``--build-arg BASE_IMAGE=...``, without the layer cache, so every step runs);
5. builds docker/check.Containerfile FROM that image, whose last step runs the image's tools
   (docker/check_image.py: ``oscar-sglang --help`` and ``--help-all``, ``oscar-calibrate
   example-model`` and ``oscar-calibrate --device cpu`` on SmolLM2-135M-Instruct). The check
   image is removed after, and so are the images a run replaces.

Every build uses ``podman build --isolation chroot`` (``podman run`` is not needed). The host's
CA bundle, when there is one, is mounted read-only over the image's during the RUN steps (a
TLS-intercepting proxy's certificate); it is not part of any image. The build context is
``git archive HEAD`` (``--worktree``: the working tree as it is). What ran (commands, versions,
image ids and sizes, the check's last lines, wall times) goes to
benchmarks/results/docker_build.json.

Not part of CI (too heavy: ~10 GB of images, tens of minutes). Needs root, Linux, network to
Debian's archive and PyPI, and about 30 GB free where podman keeps its images.

    sudo python3 docker/build_check.py [--tokens 4096] [--worktree] [--rebuild-base]
"""
from __future__ import annotations

import argparse
import ast
import collections
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROG = "docker/build_check.py"
SUITE = "bookworm"  # Debian 12: Python 3.11
MIRROR = "http://deb.debian.org/debian"
DEBIAN_PACKAGES = ("python3", "python3-pip", "ca-certificates")
ROOTFS_IMAGE = f"localhost/oscar-standin-rootfs:{SUITE}"
BASE_IMAGE = "localhost/oscar-standin-sglang:0.5.17"
IMAGE = "localhost/oscar-sglang:latest"
CHECK_IMAGE = "localhost/oscar-sglang-check:latest"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # where Debian's pip and OpenSSL read it
TAIL = 15


class BuildError(RuntimeError):
    """Bad input or a failed step; the message is one line."""


def standin_requirements(setup_py: Path = ROOT / "setup.py") -> list[str]:
    """What the stand-in base pre-installs, as the official image does: setup.py's torch pin,
    its sglang pin and the versions pinned for sglang's resolution."""
    tree = ast.parse(setup_py.read_text())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("SGLANG", "SGLANG_RESOLVED"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            found["install_requires"] = ast.literal_eval(node.value)
    torch = [r for r in found.get("install_requires", []) if r.startswith("torch==")]
    if not torch or "SGLANG" not in found:
        raise BuildError(f"{setup_py}: no torch== pin in install_requires or no SGLANG pin")
    return [*torch, found["SGLANG"], *found.get("SGLANG_RESOLVED", [])]


def host_ca_bundle() -> str | None:
    for cand in (os.environ.get("SSL_CERT_FILE"), os.environ.get("PIP_CERT"),
                 os.environ.get("REQUESTS_CA_BUNDLE"), CA_BUNDLE):
        if cand and os.path.isfile(cand):
            return cand
    return None


def ensure_tool(name: str, package: str) -> str:
    exe = shutil.which(name)
    if exe:
        return exe
    if not shutil.which("apt-get") or os.geteuid() != 0:
        raise BuildError(f"{name} is not installed and cannot be installed here (needs root and apt-get: "
                         f"apt-get install {package})")
    print(f"{PROG}: installing {package} with apt-get", flush=True)
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", package]):
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            last = (r.stdout.strip().splitlines() or ["no output"])[-1]
            raise BuildError(f"{name} is not installed and `{' '.join(cmd)}` failed: {last}")
    exe = shutil.which(name)
    if not exe:
        raise BuildError(f"{name} is still missing after apt-get install {package}")
    return exe


def version_of(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    return (r.stdout or r.stderr).strip().splitlines()[0] if r.returncode == 0 else "unknown"


def image_facts(name: str, runtime: bool = False) -> dict | None:
    """Id, size and creation time of a local image; ``runtime``: also what `docker run` uses."""
    r = subprocess.run(["podman", "image", "inspect", name], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    info = json.loads(r.stdout)[0]
    facts = {"name": name, "id": info["Id"], "size_bytes": info["Size"], "size_gb": round(info["Size"] / 1e9, 2),
             "created": info["Created"]}
    if runtime:
        cfg = info.get("Config") or {}
        facts["runtime"] = {k: cfg.get(k) for k in ("User", "Entrypoint", "Cmd", "ExposedPorts", "Volumes")}
        facts["runtime"]["Healthcheck"] = info.get("Healthcheck")
    return facts


class Recorder:
    """Runs each step with its output streamed, and keeps its command, wall time and last lines."""

    def __init__(self):
        self.steps: list[dict] = []

    def run(self, name: str, cmd: list[str], cwd: Path | None = None, note: str = "") -> dict:
        shown = shlex.join(cmd)
        print(f"\n{PROG}: [{name}] {shown}", flush=True)
        tail = collections.deque(maxlen=TAIL)
        t0 = time.monotonic()
        with subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", bufsize=1) as proc:
            for line in proc.stdout:
                sys.stdout.write(line)
                tail.append(line.rstrip("\n"))
        wall = round(time.monotonic() - t0, 1)
        step = {"step": name, "command": shown, "wall_s": wall, "last_lines": list(tail)}
        if note:
            step["note"] = note
        self.steps.append(step)
        if proc.returncode != 0:
            raise BuildError(f"step {name} failed (exit {proc.returncode} after {wall:.0f} s): {shown}")
        return step


def build_cmd(containerfile: Path, tag: str, context: Path, ca: str | None, build_args: dict,
              no_cache: bool = False) -> list[str]:
    # docker format: the OCI format drops HEALTHCHECK
    cmd = ["podman", "build", "--isolation", "chroot", "--format", "docker", "--pull=never",
           "-f", str(containerfile), "-t", tag]
    for k, v in build_args.items():
        cmd += ["--build-arg", f"{k}={v}"]
    if ca:
        cmd += ["-v", f"{os.path.realpath(ca)}:{CA_BUNDLE}:ro"]
    if no_cache:
        cmd.append("--no-cache")
    return cmd + [str(context)]


def source_context(tmp: Path, worktree: bool) -> tuple[Path, dict]:
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.splitlines()
    if worktree:
        return ROOT, {"context": "working tree", "commit": commit or None, "modified_files": len(dirty)}
    if not commit:
        raise BuildError(f"{ROOT} is not a git checkout with a commit; pass --worktree to build the folder as it is")
    ctx = tmp / "context"
    ctx.mkdir()
    archive = subprocess.run([*git, "archive", "--format=tar", "HEAD"], capture_output=True)
    if archive.returncode != 0:
        raise BuildError(f"git archive HEAD failed: {archive.stderr.decode(errors='replace').strip()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(ctx)], input=archive.stdout, check=True)
    return ctx, {"context": "git archive HEAD", "commit": commit}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096,
                   help="calibration budget of the check, in tokens (default 4096: minutes on 2 CPU cores)")
    p.add_argument("--worktree", action="store_true", help="build the working tree as it is, not git HEAD")
    p.add_argument("--rebuild-base", action="store_true",
                   help="make the Debian root filesystem and the stand-in base again even if present")
    p.add_argument("--min-free-gb", type=float, default=30.0,
                   help="refuse to start with less free disk where podman keeps images (default 30)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "docker_build.json"))
    a = p.parse_args(argv)
    try:
        return run(a)
    except BuildError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


def run(a) -> int:
    if a.tokens < 1:
        raise BuildError(f"--tokens must be >= 1, got {a.tokens}")
    if platform.system() != "Linux":
        raise BuildError(f"podman builds need Linux, this is {platform.system()}")
    t_start = time.monotonic()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    requirements = standin_requirements()
    ensure_tool("podman", "podman")
    r = subprocess.run(["podman", "info", "--format", "{{.Store.GraphRoot}}"], capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"podman does not work here: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    graph_root = r.stdout.strip()
    probe = graph_root if os.path.isdir(graph_root) else "/"
    free_gb = shutil.disk_usage(probe).free / 1e9
    if free_gb < a.min_free_gb:
        raise BuildError(f"only {free_gb:.1f} GB free under {graph_root}; the build needs about "
                         f"{a.min_free_gb:.0f} GB (--min-free-gb)")
    ca = host_ca_bundle()
    rec = Recorder()
    previous = {name: (image_facts(name) or {}).get("id") for name in (IMAGE, BASE_IMAGE, ROOTFS_IMAGE)}
    versions = {"podman": version_of(["podman", "--version"]), "kernel": platform.release(),
                "cpus": os.cpu_count()}

    with tempfile.TemporaryDirectory(prefix="oscar-docker-build-") as tmpdir:
        tmp = Path(tmpdir)
        context, source = source_context(tmp, a.worktree)
        docker = context / "docker"
        for f in ("Dockerfile", "standin-base.Containerfile", "check.Containerfile", "check_image.py"):
            if not (docker / f).is_file():
                raise BuildError(f"{docker / f} is missing (commit it, or pass --worktree)")

        # 1. Debian root filesystem, imported as an image
        if a.rebuild_base or image_facts(ROOTFS_IMAGE) is None:
            ensure_tool("mmdebstrap", "mmdebstrap")
            versions["mmdebstrap"] = version_of(["mmdebstrap", "--version"])
            tar = tmp / "rootfs.tar"
            rec.run("rootfs", ["mmdebstrap", "--variant=minbase", "--include=" + ",".join(DEBIAN_PACKAGES),
                               SUITE, str(tar), MIRROR])
            rec.run("rootfs_import", ["podman", "import", "--change",
                                      "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                      str(tar), ROOTFS_IMAGE])
            tar.unlink()
        else:
            rec.steps.append({"step": "rootfs", "reused": ROOTFS_IMAGE})

        # 2. the stand-in base: torch + sglang from PyPI (podman's layer cache reuses an unchanged one)
        base_ctx = tmp / "standin-context"
        base_ctx.mkdir()
        (base_ctx / "requirements.txt").write_text("\n".join(requirements) + "\n")
        rec.run("standin_base", build_cmd(docker / "standin-base.Containerfile", BASE_IMAGE, base_ctx, ca,
                                          {"ROOTFS": ROOTFS_IMAGE}, no_cache=a.rebuild_base),
                note="requirements.txt: " + " ".join(requirements))

        # 3. the real Dockerfile, every step run
        rec.run("image", build_cmd(docker / "Dockerfile", IMAGE, context, ca, {"BASE_IMAGE": BASE_IMAGE},
                                   no_cache=True))

        # 4. the image's tools, inside a build FROM it
        check = rec.run("check", build_cmd(docker / "check.Containerfile", CHECK_IMAGE, context, ca,
                                           {"IMAGE": IMAGE, "CALIBRATION_BUDGET": str(a.tokens)},
                                           no_cache=True))
    if not any(ln.startswith("image check passed") for ln in check["last_lines"]):
        raise BuildError("the check build succeeded but printed no 'image check passed' line")
    check_image = image_facts(CHECK_IMAGE)
    subprocess.run(["podman", "rmi", CHECK_IMAGE], capture_output=True)
    # the images this run replaced (untagged now), newest first: children before their base
    replaced = [iid for name, iid in previous.items() if iid and iid != (image_facts(name) or {}).get("id")]
    for iid in replaced:
        subprocess.run(["podman", "rmi", iid], capture_output=True)

    images = {"rootfs": image_facts(ROOTFS_IMAGE), "standin_base": image_facts(BASE_IMAGE),
              "image": image_facts(IMAGE, runtime=True), "check_image_removed": check_image,
              "replaced_images_removed": replaced}
    images["image"]["added_over_base_bytes"] = images["image"]["size_bytes"] - images["standin_base"]["size_bytes"]
    record = {
        "what": "docker/Dockerfile built with podman on a stand-in base (Debian bookworm from Debian's archive "
                "+ torch/sglang from PyPI), and the image's tools run inside a build FROM it",
        "started_utc": started,
        "source": source,
        "versions": versions,
        "ca_bundle_mounted": ca,
        "standin_requirements": requirements,
        "calibration_tokens": a.tokens,
        "steps": rec.steps,
        "images": images,
        "check_last_lines": [ln for ln in check["last_lines"] if ln.startswith("image check")],
        "total_wall_s": round(time.monotonic() - t_start, 1),
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    img = images["image"]
    print(f"\n{PROG}: {IMAGE} {img['id'][:12]} {img['size_gb']} GB "
          f"({img['added_over_base_bytes'] / 1e6:.0f} MB over the stand-in base); check passed; "
          f"{record['total_wall_s']:.0f} s in all; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
