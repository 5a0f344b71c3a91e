"""Query an oscar-sglang server with the OpenAI client: list the model, one completion,
one streamed completion (``--chat``: the chat endpoint, for models with a chat template).

    oscar-sglang --model-path M --kv-cache-dtype oscar_int2 --oscar-rotations R.safetensors &
    python3 examples/openai_client.py --base-url http://127.0.0.1:30000/v1 --prompt "def fibonacci(n):"
"""
from __future__ import annotations

import argparse
import sys

import openai
from openai import OpenAI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Query an oscar-sglang server (OpenAI API)")
    ap.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    ap.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    a = ap.parse_args(argv)
    try:
        return query(a)
    except openai.APIConnectionError as e:
        cause = f" ({e.__cause__})" if e.__cause__ else ""
        print(f"openai_client.py: no server answered at {a.base_url}{cause}: start one (see this file's "
              "docstring) or pass --base-url", file=sys.stderr)
    except openai.APIStatusError as e:
        print(f"openai_client.py: the server at {a.base_url} answered HTTP {e.status_code}: {e.message}",
              file=sys.stderr)
    return 2


def query(a: argparse.Namespace) -> int:
    client = OpenAI(base_url=a.base_url, api_key=a.api_key, timeout=600)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    if a.chat:
        messages = [{"role": "user", "content": a.prompt}]
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=a.max_tokens,
                                             temperature=0)
        print(f"chat: {out.choices[0].message.content!r}")
        print("streamed: ", end="", flush=True)
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=a.max_tokens,
                                                    temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
    else:
        out = client.completions.create(model=model, prompt=a.prompt, max_tokens=a.max_tokens, temperature=0)
        print(f"completion: {out.choices[0].text!r}")
        print("streamed: ", end="", flush=True)
        for chunk in client.completions.create(model=model, prompt=a.prompt, max_tokens=a.max_tokens,
                                               temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].text:
                print(chunk.choices[0].text, end="", flush=True)
    print()
    if out.usage is not None:
        print(f"usage: {out.usage.prompt_tokens} prompt + {out.usage.completion_tokens} completion tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
