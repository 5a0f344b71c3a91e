"""Attribute a method's INT2 error to keys or values: oscar-eval with ``--int2-parts`` kv-fake,
k and v on the same prompts (same seeds), merged into one JSON.

    python -m benchmarks.fidelity_int2_parts --model ../shared/models/tinylm-A \
        --method oscar=ROT.safetensors --out benchmarks/results/fidelity_int2_parts_tinylm-A.json \
        -- --threads 2 --ppl-windows 0 --passkey-trials 40 --lengths 8192 --depths 0.1

The first run also scores bf16; each method is named ``NAME [INT2 k]`` etc. in the output.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from calibration.fidelity import cli

PARTS = ("kv-fake", "k", "v")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--method", required=True, type=cli._method, metavar="NAME=FILE")
    ap.add_argument("--out", required=True)
    ap.add_argument("eval_args", nargs=argparse.REMAINDER, help="-- then oscar-eval options")
    a = ap.parse_args(argv)
    extra = a.eval_args[1:] if a.eval_args[:1] == ["--"] else a.eval_args
    name, path = a.method
    merged: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, parts in enumerate(PARTS):
            out = os.path.join(tmp, f"{parts}.json")
            run_argv = ["--model", a.model, "--method", f"{name}={path}", "--int2-parts", parts,
                        "--out", out, *extra] + (["--no-bf16"] if i else [])
            if cli.main(run_argv) != 0:
                raise SystemExit(f"fidelity_int2_parts: oscar-eval --int2-parts {parts} failed")
            res = json.loads(open(out).read())
            if not merged:
                merged = {"model": res["model"], "settings": dict(res["settings"]), "methods": {}}
                merged["settings"]["int2_parts"] = list(PARTS)
                merged["settings"]["argv"] = {}
            merged["settings"]["argv"][parts] = run_argv
            for m, v in res["methods"].items():
                merged["methods"][m if m == "bf16" else f"{m} [INT2 {parts}]"] = v
            cli._write(a.out, merged)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
