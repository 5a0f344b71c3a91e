"""``oscar-sglang``: SGLang's server with the OSCAR plugin loaded.

    oscar-sglang [serve] <SGLang server arguments + --oscar-* flags>

``serve`` (the default) loads SGLang's plugins (the ``oscar`` entry point among them),
parses exactly what ``sglang serve`` parses (plus the oscar flags) and runs SGLang's
launch_server path. Bad configurations end with one line and exit code 2.
"""
from __future__ import annotations

import argparse
import os
import sys

USAGE = """usage: oscar-sglang [serve] <model-path> | --model-path PATH [SGLang server arguments]
                    [--kv-cache-dtype oscar_int2 --oscar-rotations FILE [--oscar-* ...]]

SGLang 0.5.17 with the OSCAR 2-bit KV cache, on CUDA GPUs. The server arguments are
SGLang's own (`oscar-sglang --help-all` lists them); the oscar ones follow.
"""
HELP_ALL = "--help-all"


class LaunchError(RuntimeError):
    """The launcher cannot start the server; the message is one line."""


def _plugin_visible_to_subprocesses() -> str | None:
    """Why the scheduler subprocesses would not load the oscar plugin (None if they will):
    they only run sglang's load_plugins(), which finds installed entry points."""
    from importlib.metadata import entry_points

    from .sglang_bridge import GENERAL_PLUGINS_GROUP

    if "oscar" not in {ep.name for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}:
        return ("the 'oscar' SGLang plugin entry point is not installed "
                "(pip install oscar-sglang, or pip install -e <checkout>)")
    allowed = os.environ.get("SGLANG_PLUGINS", "").strip()
    if allowed and "oscar" not in {x.strip() for x in allowed.split(",")}:
        return f"SGLANG_PLUGINS={allowed} excludes the 'oscar' plugin"
    return None


def load_oscar_plugin() -> None:
    """Run SGLang's plugin loading (as ``sglang serve`` does) and activate the oscar plugin
    here even when the entry point is absent, so that parsing knows the oscar flags
    (check_runtime_ready then says why the scheduler processes would not)."""
    from .plugin import activate
    from .sglang_bridge import load_plugins

    load_plugins()
    activate()


def check_runtime_ready(server_args) -> None:
    """For oscar_int2: the plugin registered its attention backend here and will be
    loaded by the scheduler subprocesses."""
    from .settings import OSCAR_ATTENTION_BACKEND, is_oscar
    from .sglang_bridge import ATTENTION_BACKENDS

    if not is_oscar(server_args):
        return
    why = _plugin_visible_to_subprocesses()
    if why:
        raise LaunchError(why)

    if OSCAR_ATTENTION_BACKEND not in ATTENTION_BACKENDS:
        raise LaunchError("the 'oscar' SGLang plugin did not register its attention backend "
                          "(see the plugin error logged above)")


def device_problem(device: str | None) -> str | None:
    """Why oscar-sglang cannot serve on ``device`` (None: it can): it serves on CUDA only
    (its kernels and the pinned SGLang wheels are CUDA builds)."""
    if device is not None and device != "cuda":
        return (f"--device {device} is not supported: oscar-sglang serves on CUDA GPUs only "
                "(--device cuda, the default); for other devices run SGLang's own `sglang serve`, "
                "without the OSCAR KV cache")
    import torch

    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return ("no CUDA GPU is available to torch"
                + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                + ": oscar-sglang serves on CUDA GPUs only")
    return None


def rotations_problem(path: str | None) -> str | None:
    """Why the --oscar-rotations file cannot be served (None: it loads and validates); checked
    first, so that a bad file is named even where SGLang cannot start."""
    if path is None:
        return None
    from oscar_kernels.contract.rotations_file import RotationsFileError, load_rotations

    try:
        load_rotations(path)
    except RotationsFileError as e:
        return f"--oscar-rotations: {e}"
    return None


def _early_args(argv: list[str]) -> argparse.Namespace:
    """The flags checked before SGLang loads (--config files are read later, by SGLang)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--device")
    p.add_argument("--oscar-rotations")
    return p.parse_known_args(argv)[0]


def oscar_help() -> str:
    """The OSCAR flags' help from the plugin's own definitions: no SGLang import, so instant."""
    from .server_args_hooks import extend_parser
    from .settings import OSCAR_KV_DTYPE

    p = argparse.ArgumentParser(prog="oscar-sglang", usage=argparse.SUPPRESS, add_help=False)
    p.add_argument("--kv-cache-dtype", choices=[OSCAR_KV_DTYPE],
                   help="KV cache storage (SGLang's own values: --help-all).")
    extend_parser(p)
    return p.format_help().replace("options:", "KV cache:", 1)


def _normalise(argv: list[str]) -> list[str]:
    if argv and not argv[0].startswith("-"):  # `oscar-sglang serve <model>` like `sglang serve`
        return ["--model-path", argv[0], *argv[1:]]
    return argv


def serve(argv: list[str]) -> int:
    from .settings import OscarConfigError

    if HELP_ALL in argv:  # the OSCAR flags first, then SGLang's full help (which loads SGLang)
        print(USAGE + "\n" + oscar_help())
        argv = ["--help" if a == HELP_ALL else a for a in argv]
    elif any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\n" + oscar_help())
        print("SGLang's server arguments (--model-path, --tp-size, --mem-fraction-static, ...): "
              f"`oscar-sglang {HELP_ALL}` (it loads SGLang, which takes a while)")
        return 0
    else:  # before SGLang starts: it fails on a machine without a GPU with a long traceback
        early = _early_args(argv)
        why = rotations_problem(early.oscar_rotations) or device_problem(early.device)
        if why:
            print(f"oscar-sglang: {why}", file=sys.stderr)
            return 2
    try:
        load_oscar_plugin()
    except ImportError as e:  # sglang_bridge.SglangBridgeError: sglang missing or not 0.5.17
        print(f"oscar-sglang: {e}", file=sys.stderr)
        return 2
    from .sglang_bridge import kill_process_tree, prepare_server_args, run_server

    try:
        server_args = prepare_server_args(_normalise(argv))
        why = device_problem(server_args.device)  # a --config file can set the device too
        if why:
            raise LaunchError(why)
        check_runtime_ready(server_args)
    except (OscarConfigError, LaunchError) as e:
        print(f"oscar-sglang: {e}", file=sys.stderr)
        return 2

    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    if not argv:
        print(USAGE)
        print("oscar-sglang: error: no model given (--model-path PATH; `oscar-sglang --help` lists "
              "SGLang's server arguments)", file=sys.stderr)
        return 2
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
