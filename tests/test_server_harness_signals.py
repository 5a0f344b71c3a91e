"""benchmarks/server_harness.py on SIGTERM (what `timeout` sends): a pytest session that
uses the harness stops instead of going on to the next test's servers."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sigterm_ends_a_pytest_session_using_the_harness(tmp_path):
    marker = tmp_path / "second_test_ran"
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(f"""
        import os, signal
        from benchmarks import server_harness  # noqa: F401  (installs the handlers)

        def test_first():
            os.kill(os.getpid(), signal.SIGTERM)

        def test_second():
            open({str(marker)!r}, "w").close()
    """))
    # python -m from the checkout: `benchmarks` imports from there
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0
    assert not marker.exists(), done.stdout[-2000:]
