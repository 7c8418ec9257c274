#!/usr/bin/env python3
"""Structured output and tool calls on a real model: SmolLM2-135M-Instruct served by
`torchspeed serve`, 100 sampled chat completions held to a JSON schema, each validated with
jsonschema (all must end by themselves and validate); then a tool call round trip (required,
named, streamed; the call's arguments validated against the tool's parameters; the result sent
back as a `tool` message and answered), through the official openai client.

    structured_smollm2.py --torchspeed build/bin/torchspeed --model SmolLM2-135M-Instruct.Q4_1.gguf
"""
import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import jsonschema
from openai import OpenAI

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "employed": {"type": "boolean"},
        "pet": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "kind": {"enum": ["cat", "dog", "fish"]}, "name": {"type": "string", "maxLength": 12}},
            "required": ["kind", "name"], "additionalProperties": False}]},
    },
    "required": ["name", "age", "city", "hobbies", "employed", "pet"],
    "additionalProperties": False,
}


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


def tool_round_trip(client, model, failures):
    msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    try:
        # Forced calls: "required" (any of the tools, parallel off: one call) and a named function.
        r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=100, temperature=0)
        c = r.choices[0]
        if c.finish_reason != "tool_calls" or not c.message.tool_calls or len(c.message.tool_calls) != 1:
            raise ValueError(f"required: {c.finish_reason} {c.message}")
        call = c.message.tool_calls[0]
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), params)
        print(f"tool_choice required: {call.function.name}({call.function.arguments})", flush=True)
        r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=100, temperature=0.8, seed=1,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        c = r.choices[0]
        if c.finish_reason != "stop" or c.message.content is not None or c.message.tool_calls[0].function.name != "get_weather":
            raise ValueError(f"named: {c.finish_reason} {c.message}")
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER)
        # Streamed, as OpenAI streams calls: deltas with an index, accumulated by the client.
        got = {}
        reasons = []
        # (parallel_tool_calls off: one call, so the text ends whatever the CPU's rounding picks)
        for chunk in client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required",
                                                    parallel_tool_calls=False, max_tokens=100, temperature=0, stream=True):
            for d in chunk.choices[0].delta.tool_calls or []:
                e = got.setdefault(d.index, {"name": "", "arguments": ""})
                e["name"] += d.function.name or ""
                e["arguments"] += d.function.arguments or ""
            reasons.append(chunk.choices[0].finish_reason)
        if reasons[-1] != "tool_calls" or not got:
            raise ValueError(f"streamed: {reasons} {got}")
        for e in got.values():
            jsonschema.validate(json.loads(e["arguments"]), params if e["name"] == call.function.name else
                                {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[e["name"]])
        # A named function streamed: the id and name first, then the arguments piece by piece.
        pieces, names, reasons = [], set(), []
        for chunk in client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=100, temperature=0,
                                                    tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                    stream=True):
            for d in chunk.choices[0].delta.tool_calls or []:
                if d.function.name:
                    names.add(d.function.name)
                pieces.append(d.function.arguments or "")
            reasons.append(chunk.choices[0].finish_reason)
        if names != {"get_weather"} or len([p for p in pieces if p]) < 3 or reasons[-1] != "stop":
            raise ValueError(f"named, streamed: names {names}, {len(pieces)} argument pieces, finish {reasons[-1]}")
        jsonschema.validate(json.loads("".join(pieces)), WEATHER)
        # The result goes back as a tool message; the model answers from it.
        history = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id,
                           "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "sunny"})}]
        r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=60, temperature=0)
        plain = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="none",
                                               max_tokens=1, temperature=0)
        c = r.choices[0]
        if not c.message.content or c.message.tool_calls or r.usage.prompt_tokens <= plain.usage.prompt_tokens + 20:
            raise ValueError(f"answer after the tool result: {c.message} (prompt {r.usage.prompt_tokens} tokens)")
        print(f"after the tool result: {c.message.content!r}", flush=True)
    except Exception as e:  # noqa: BLE001
        failures.append(f"tools: {type(e).__name__}: {str(e)[:400]}")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torchspeed", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", type=int, default=100)
    args = ap.parse_args()
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="torchspeed-structured-", suffix=".log", delete=False)
    cmd = [args.torchspeed, "serve", "--checkpoint", args.model, "--weights", "auto", "--host", "127.0.0.1",
           "--port", str(port), "--max-num-seqs", "16", "--max-queue", "128", "--tool-call-parser", "hermes"]
    print("server: " + " ".join(cmd) + f"\nserver log: {log.name}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    failures = []
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                print("FAIL the server exited", flush=True)
                return 1
            time.sleep(0.1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        msgs = [{"role": "system", "content": "You answer in JSON."},
                {"role": "user", "content": "Describe a made-up person: name, age, city, hobbies, whether employed, and their pet."}]
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

        def one(seed):
            r = client.chat.completions.create(model=model, messages=msgs, max_tokens=400, temperature=1.0, seed=seed,
                                               response_format=rf)
            return seed, r.choices[0]

        t0 = time.monotonic()
        valid = 0
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for seed, c in pool.map(one, range(args.runs)):
                try:
                    if c.finish_reason != "stop":
                        raise ValueError(f"finish_reason {c.finish_reason}")
                    jsonschema.validate(json.loads(c.message.content), PERSON)
                    valid += 1
                except Exception as e:  # noqa: BLE001
                    failures.append(f"seed {seed}: {type(e).__name__}: {str(e)[:200]} in {c.message.content[:300]!r}")
        took = time.monotonic() - t0
        print(f"json_schema: {valid} of {args.runs} sampled outputs validate ({took:.1f} s)", flush=True)
        print(f"  e.g. {c.message.content}", flush=True)
        # Greedy, any JSON object: the model's own keys.
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Give me a JSON object with a person's name and age."}],
                                           max_tokens=300, temperature=0, response_format={"type": "json_object"})
        c = r.choices[0]
        try:
            if not isinstance(json.loads(c.message.content), dict) or c.finish_reason != "stop":
                raise ValueError(c.finish_reason)
            print(f"json_object (greedy): {c.message.content}", flush=True)
        except Exception as e:  # noqa: BLE001
            failures.append(f"json_object: {type(e).__name__}: {e} in {c.message.content[:300]!r}")
        tool_round_trip(client, model, failures)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    for f in failures[:10]:
        print(f"FAIL {f}", flush=True)
    if failures:
        print(f"{len(failures)} failures; server log {log.name}", flush=True)
        return 1
    os.unlink(log.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
