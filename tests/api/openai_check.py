"""Drives `corolla api` with the official `openai` package and prints what it
got as one JSON object; tests/tests/api.rs checks the figures.

    python openai_check.py --base-url http://127.0.0.1:PORT/v1 --api-key KEY \
        --model NAME --prompt TEXT [--mode full|no-route|adapter]
"""

import argparse
import json
import sys

import urllib.error
import urllib.request

import openai


def status_of(call):
    """Runs `call`, which must fail with an HTTP error: (status, message, body)."""
    try:
        call()
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        return {"status": e.status_code, "message": str(e), "body": body}
    return {"status": None, "message": "no error", "body": {}}


def raw_post(args, body):
    """POSTs `body` as is (the SDK only sends well-formed JSON): {status, body}."""
    request = urllib.request.Request(
        args.base_url + "/chat/completions",
        data=body,
        headers={"Authorization": f"Bearer {args.api_key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request) as response:
            return {"status": response.status, "body": json.load(response)}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": json.load(e)}


def full(client, args):
    out = {}
    out["models"] = [m.id for m in client.models.list().data]
    messages = [{"role": "user", "content": args.prompt}]

    chat = client.chat.completions.create(
        model=args.model, messages=messages, temperature=0, max_tokens=24
    )
    out["chat"] = {
        "content": chat.choices[0].message.content,
        "finish_reason": chat.choices[0].finish_reason,
        "usage": chat.usage.model_dump(),
        "object": chat.object,
    }

    pieces, finish, usage, chunks = [], None, None, 0
    stream = client.chat.completions.create(
        model=args.model,
        messages=messages,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    out["stream"] = {
        "content": "".join(pieces),
        "finish_reason": finish,
        "usage": usage,
        "chunks": chunks,
    }

    # A follow-up turn of the same conversation: the API reuses its sessions.
    follow = messages + [
        {"role": "assistant", "content": chat.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    again = client.chat.completions.create(
        model=args.model, messages=follow, temperature=0, max_tokens=16
    )
    out["follow_up"] = {
        "content": again.choices[0].message.content,
        "usage": again.usage.model_dump(),
    }

    completion = client.completions.create(
        model=args.model, prompt="The capital of France is", temperature=0, max_tokens=8
    )
    out["completion"] = {
        "text": completion.choices[0].text,
        "finish_reason": completion.choices[0].finish_reason,
        "usage": completion.usage.model_dump(),
    }

    words = chat.choices[0].message.content.split()
    stop_word = words[min(3, len(words) - 1)]
    stopped = client.chat.completions.create(
        model=args.model, messages=messages, temperature=0, max_tokens=24, stop=[stop_word]
    )
    out["stop"] = {
        "stop": stop_word,
        "content": stopped.choices[0].message.content,
        "finish_reason": stopped.choices[0].finish_reason,
    }

    short = client.chat.completions.create(
        model=args.model, messages=messages, temperature=0, max_tokens=3
    )
    out["short"] = {
        "finish_reason": short.choices[0].finish_reason,
        "usage": short.usage.model_dump(),
    }

    errors = {}
    errors["unknown_model"] = status_of(
        lambda: client.chat.completions.create(model="no-such-model", messages=messages)
    )
    wrong_key = openai.OpenAI(base_url=args.base_url, api_key="wrong-key", max_retries=0)
    errors["wrong_key"] = status_of(
        lambda: wrong_key.chat.completions.create(model=args.model, messages=messages)
    )
    long_prompt = "hello " * 3000
    errors["too_long"] = status_of(
        lambda: client.chat.completions.create(
            model=args.model, messages=[{"role": "user", "content": long_prompt}], max_tokens=8
        )
    )
    errors["wrong_type"] = status_of(
        lambda: client.chat.completions.create(
            model=args.model, messages=messages, extra_body={"max_tokens": "many"}
        )
    )
    errors["huge_max_tokens"] = status_of(
        lambda: client.chat.completions.create(
            model=args.model, messages=messages, max_tokens=2**64 - 1
        )
    )
    errors["bad_role"] = status_of(
        lambda: client.chat.completions.create(
            model=args.model, messages=[{"role": "robot", "content": "hi"}]
        )
    )
    errors["malformed"] = raw_post(args, b"{not json")
    errors["huge_body"] = raw_post(args, b'{"pad": "' + b"x" * (2 << 20) + b'"}')
    out["errors"] = errors
    return out


def no_route(client, args):
    return {
        "no_route": status_of(
            lambda: client.chat.completions.create(
                model=args.model,
                messages=[{"role": "user", "content": args.prompt}],
                max_tokens=4,
            )
        )
    }


def adapter(client, args):
    """`--model` is `model:adapter`: the models listed, a greedy chat with the
    adapter and one with an adapter nobody runs."""
    messages = [{"role": "user", "content": args.prompt}]
    chat = client.chat.completions.create(
        model=args.model, messages=messages, temperature=0, max_tokens=12
    )
    base = args.model.rsplit(":", 1)[0]
    return {
        "models": [m.id for m in client.models.list().data],
        "content": chat.choices[0].message.content,
        "model": chat.model,
        "completion_tokens": chat.usage.completion_tokens,
        "unknown": status_of(
            lambda: client.chat.completions.create(
                model=base + ":gamma", messages=messages, max_tokens=4
            )
        ),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--mode", default="full", choices=["full", "no-route", "adapter"])
    args = parser.parse_args()
    client = openai.OpenAI(
        base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120
    )
    result = {"full": full, "no-route": no_route, "adapter": adapter}[args.mode](client, args)
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
