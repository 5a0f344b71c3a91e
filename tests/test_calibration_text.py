"""Calibration text sources and token windows."""
import json
import os

import pytest
import torch

from calibration import text_sources


class CharTokenizer:
    """A stand-in tokenizer: one id per character, EOS = 0, no BOS."""
    bos_token_id = None
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False, verbose=False):
        return {"input_ids": [ord(c) % 250 + 1 for c in text]}


def test_stdlib_files_sorted_and_without_tests_or_site_packages():
    files = text_sources.stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert all(f.endswith(".py") for f in files)
    root = text_sources.stdlib_root()
    for f in files:
        parts = os.path.relpath(f, root).split(os.sep)[:-1]
        assert not set(parts) & {"site-packages", "test", "tests", "idle_test"}
    assert os.path.join(root, "argparse.py") in files


def test_stdlib_test_files_are_disjoint_from_calibration_files():
    tests = text_sources.stdlib_test_files()
    assert tests and not set(tests) & set(text_sources.stdlib_files())


def test_read_texts_folders_files_and_jsonl(tmp_path):
    (tmp_path / "sub" / "__pycache__").mkdir(parents=True)
    (tmp_path / "b.py").write_text("print('b')\n")
    (tmp_path / "sub" / "a.md").write_text("# a\n")
    (tmp_path / "sub" / "__pycache__" / "c.py").write_text("cached\n")
    (tmp_path / "sub" / "data.bin").write_bytes(b"\x00\x01")
    (tmp_path / "sub" / "x.txt").write_bytes(b"bin\x00ary")
    jl = tmp_path / "d.jsonl"
    jl.write_text(json.dumps({"text": "first"}) + "\n\n" + json.dumps({"text": "second", "id": 2}) + "\n")
    texts = list(text_sources.read_texts([str(tmp_path)]))
    assert texts == ["print('b')\n", "first", "second", "# a\n"]  # sorted paths, binaries skipped
    assert list(text_sources.read_texts([str(jl)])) == ["first", "second"]


def test_read_texts_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        list(text_sources.read_texts([str(tmp_path / "absent")]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected an object with a string field 'text'"):
        list(text_sources.read_texts([str(bad)]))
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not valid JSON"):
        list(text_sources.read_texts([str(bad)]))


def test_check_texts_says_why_a_path_holds_no_text(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.txt").write_bytes(b"\x00\x01")
    (tmp_path / "bin" / "b.py").write_bytes(b"")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_bytes(b"\x00")
    (tmp_path / "mixed" / "b.md").write_text("# text\n")
    text_sources.check_texts([str(tmp_path / "mixed")])  # one text file is enough
    with pytest.raises(ValueError) as e:
        text_sources.check_texts([str(tmp_path / "mixed"), str(tmp_path / "bin")])
    assert str(e.value) == (f"--data {tmp_path / 'bin'}: none of its 2 files is calibration text (first: "
                            f"{tmp_path / 'bin' / 'a.txt'}: binary (it holds NUL bytes))")
    long_line = tmp_path / "gen.txt"
    long_line.write_text("x" * (text_sources.MAX_LINE_CHARS + 1))
    with pytest.raises(ValueError, match=r"gen.txt: not calibration text: generated-looking \(a line over 5000"):
        text_sources.check_texts([str(long_line)])


def test_token_stream_windows():
    tok = CharTokenizer()
    texts = ["abcdefghij", "klmnopqrstuvwxyz"]  # 11 + 17 = 28 tokens with separators
    w = list(text_sources.token_stream(tok, texts, seq_len=8, max_tokens=100))
    assert [x.shape for x in w] == [torch.Size([8])] * 3  # 28 // 8 full windows
    stream = torch.cat(w).tolist()
    assert stream[0] == 0 and stream[11] == 0  # a separator before each document
    assert stream[1:11] == [ord(c) % 250 + 1 for c in "abcdefghij"]
    w = list(text_sources.token_stream(tok, texts, seq_len=8, max_tokens=17))
    assert len(w) == 2  # budget respected
    w = list(text_sources.token_stream(tok, texts, seq_len=2048, max_tokens=5))
    assert len(w) == 1 and w[0].shape == (5,)
    with pytest.raises(ValueError):
        list(text_sources.token_stream(tok, texts, seq_len=0, max_tokens=5))


def test_batched_and_shuffled():
    ws = [torch.full((4,), i) for i in range(5)]
    b = list(text_sources.batched(iter(ws), 2))
    assert [x.shape for x in b] == [(2, 4), (2, 4), (1, 4)]
    files = [str(i) for i in range(20)]
    assert text_sources.shuffled(files, 3) == text_sources.shuffled(files, 3) != files
    assert sorted(text_sources.shuffled(files, 3)) == sorted(files)
