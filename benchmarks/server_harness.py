"""Start, probe and stop SGLang servers for the server benchmarks (server_fidelity.py,
capacity.py, soak.py).

Every server runs ``python -m sglang_ext.launcher serve ...`` (the ``oscar-sglang``
console script, also for the BF16 / FP8 references) in its own process group with its
log in a file; ``stop()``, ``atexit`` and SIGINT/SIGTERM end the whole group (SIGTERM,
then SIGKILL). When the ``oscar`` plugin entry point is not installed in this Python
(a plain checkout), a minimal dist-info declaring it is written to a temporary folder and
put on the server's PYTHONPATH, so the scheduler subprocesses load the plugin too.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LIVE: list["Server"] = []
_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def default_model(name: str) -> str:
    """.device/models/<name> on the GPU machine, else ../shared/models/<name>."""
    for cand in (os.path.join(ROOT, ".device", "models", name),
                 os.path.join(os.path.dirname(ROOT), "shared", "models", name)):
        if os.path.isfile(os.path.join(cand, "config.json")):
            return cand
    return os.path.join(ROOT, ".device", "models", name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def same_run(a: dict, b: dict) -> bool:
    """Two results of one benchmark with the same model and settings (the same prompts)."""
    return (a.get("model"), a.get("settings")) == (b.get("model"), b.get("settings"))


def previous_entries(path: str, result: dict, section: str, keep_out) -> dict:
    """``section`` entries of an earlier run's JSON at ``path`` when it has the same model and
    settings as ``result`` (minus the names in ``keep_out``, which this run redoes), else {}:
    a run split over several GPU calls accumulates in one file."""
    try:
        with open(path, encoding="utf-8") as f:
            prev = json.load(f)
    except (OSError, ValueError):
        return {}
    if not same_run(prev, result):
        return {}
    return {k: v for k, v in prev.get(section, {}).items() if k not in keep_out}


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first token where two greedy outputs differ; -1 when they are equal."""
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return min(len(a), len(b)) if len(a) != len(b) else -1


def agree_up_to_a_near_tie(got: list[str], want: list[str], want_top: list[dict], margin: float):
    """None when ``got`` equals the reference ``want`` or first leaves it at a near-tie of
    the reference: ``got`` takes a token among the reference's top candidates there
    (``want_top``: token -> logprob) that it rates within ``margin`` nats of its best (two,
    or three, tokens can tie); else a message saying where and how they differ."""
    k = first_divergence(got, want)
    if k < 0:
        return None
    if k >= min(len(got), len(want)):
        return f"lengths differ: {len(got)} vs {len(want)} tokens"
    top = sorted(want_top[k].items(), key=lambda kv: -kv[1])
    gap = top[0][1] - want_top[k].get(got[k], float("-inf"))
    if gap <= margin:
        return None
    return (f"token {k}: got {got[k]!r}, reference {want[k]!r} (reference top {top[:3]}, gap {gap:.3f} "
            f"nats > {margin}) after {''.join(map(str, want[:k]))!r}")


def save_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


@functools.lru_cache(maxsize=None)
def _plugin_pythonpath() -> str:
    """The checkout and, if needed, a folder with a dist-info that declares the ``oscar``
    plugin entry point (written once per run)."""
    from importlib.metadata import entry_points

    paths = [ROOT]
    if "oscar" not in {ep.name for ep in entry_points(group="sglang.srt.plugins")}:
        from sglang_ext.plugin import write_entry_point_metadata

        site_dir = tempfile.mkdtemp(prefix="oscar-entry-point-")
        write_entry_point_metadata(site_dir)
        paths.insert(0, site_dir)
    return os.pathsep.join(paths)


def plugin_env() -> dict:
    """Environment for a server process: the checkout (and the plugin entry point when it
    is not installed) in front of the current PYTHONPATH."""
    old = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": _plugin_pythonpath() + (os.pathsep + old if old else "")}


class ServerDied(RuntimeError):
    pass


class Server:
    """One ``oscar-sglang serve`` process group."""

    def __init__(self, name: str, args: list[str], log_dir: str, port: int | None = None,
                 env: dict | None = None, cwd: str | None = None):
        """``cwd``: the server's working folder (``python -m`` imports from it first)."""
        self.name, self.cwd = name, cwd
        self.port = port or free_port()
        self.cmd = [sys.executable, "-m", "sglang_ext.launcher", "serve", *args,
                    "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.env = {**os.environ, **plugin_env(), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> float:
        """Start and wait until /health answers; returns the start-up seconds."""
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self._log = open(self.log_path, "w", encoding="utf-8")
        self._log.write("$ " + shlex.join(self.cmd) + "\n")
        self._log.flush()
        log(f"{self.name}: starting server on port {self.port} (log {self.log_path})")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd,
                                     start_new_session=True)
        _LIVE.append(self)
        next_note = t0 + 30
        while True:
            if self.proc.poll() is not None:
                raise ServerDied(f"{self.name}: server exited with code {self.proc.returncode} "
                                 f"before it was ready; last log lines:\n{self.log_tail()}")
            if self.get("/health", timeout=5) is not None:
                took = time.monotonic() - t0
                log(f"{self.name}: ready after {took:.0f} s")
                return took
            if time.monotonic() - t0 > timeout:
                raise ServerDied(f"{self.name}: not ready after {timeout:.0f} s; last log lines:\n"
                                 f"{self.log_tail()}")
            if time.monotonic() > next_note:
                log(f"{self.name}: still starting ({time.monotonic() - t0:.0f} s)")
                next_note += 30
            time.sleep(1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def get(self, path: str, timeout: float = 30.0):
        """JSON (or text) of GET path; None when the server does not answer 200."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                body = r.read()
                if r.status != 200:
                    return None
        except (urllib.error.URLError, OSError, ValueError):
            return None
        try:
            return json.loads(body) if body else {}
        except json.JSONDecodeError:
            return body.decode("utf-8", "replace")

    def post(self, path: str, payload: dict, timeout: float = 600.0) -> dict | str:
        """POST ``payload`` as JSON; the answer's JSON, or its text where it is not JSON (SGLang's
        profiler endpoints answer "Start profiling.")."""
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        try:
            return json.loads(body) if body else {}
        except json.JSONDecodeError:
            return body.decode("utf-8", "replace")

    def log_text(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "".join(self.log_text().splitlines(keepends=True)[-lines:])

    def max_total_num_tokens(self) -> tuple[int, str]:
        """(tokens, source): /server_info, else the scheduler's start-up log line."""
        info = self.get("/server_info")
        if isinstance(info, dict) and isinstance(info.get("max_total_num_tokens"), int):
            return info["max_total_num_tokens"], "/server_info"
        found = re.findall(r"max_total_num_tokens=(\d+)", self.log_text())
        if found:
            return int(found[-1]), "server log"
        raise RuntimeError(f"{self.name}: max_total_num_tokens neither in /server_info nor in the log")

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None or _group_alive(self.proc):
            log(f"{self.name}: stopping server")
            _kill_group(self.proc.pid, self.proc, grace)
        if self in _LIVE:
            _LIVE.remove(self)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


def _group_alive(proc) -> bool:
    if proc is None:
        return False
    try:
        os.killpg(proc.pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _kill_group(pgid: int, proc: subprocess.Popen | None, grace: float) -> None:
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        t0 = time.monotonic()
        while time.monotonic() - t0 < wait:
            if proc is not None:
                proc.poll()
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def stop_all() -> None:
    for server in list(_LIVE):
        try:
            server.stop(grace=10.0)
        except Exception as e:  # keep stopping the others
            print(f"warning: could not stop {server.name}: {e}", file=sys.stderr, flush=True)


def run_script(main) -> None:
    """``sys.exit(main())`` for a benchmark script, stopping every server it started."""
    try:
        sys.exit(main())
    finally:
        stop_all()


def _on_signal(signum, _frame):
    """SIGINT / SIGTERM: stop every server, then stop the run: KeyboardInterrupt, which a
    script ends on and pytest ends its session on (a SystemExit would only fail the
    current test and let pytest start the next one's servers)."""
    stop_all()
    raise KeyboardInterrupt(f"signal {signum}")


atexit.register(stop_all)
for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, _on_signal)
