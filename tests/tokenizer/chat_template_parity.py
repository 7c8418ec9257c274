#!/usr/bin/env python3
"""Reference renderings of real chat templates by jinja2, configured exactly as transformers'
apply_chat_template configures it (transformers.utils.chat_template_utils: a sandboxed
environment with trim_blocks, lstrip_blocks, loopcontrols, raise_exception, strftime_now and its
tojson). For every template in TEMPLATES_DIR and each of a few conversations (one user turn; a
system prompt and several turns with non-ASCII text; a finished conversation without the
generation prompt; a tool definition), writes the context and jinja2's output, or the error it
raised, to OUT (JSON), for tests/tokenizer/chat_template_check.cpp to compare.

usage: chat_template_parity.py TEMPLATES_DIR OUT.json
"""
import json
import os
import sys

from transformers.utils.chat_template_utils import _compile_jinja_template

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}]

CASES = {
    "one_turn": {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                 "add_generation_prompt": True},
    "multi_turn": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Gr\u00fc\u00dfe \U0001F44B\nTell me a fortune, \"quoted\"."}],
        "add_generation_prompt": True},
    "finished": {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
                 "add_generation_prompt": False},
    "tools": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
              "add_generation_prompt": True},
}
COMMON = {"bos_token": "<s>", "eos_token": "</s>", "date_string": "26 Jul 2024"}


def main():
    src, out = sys.argv[1], sys.argv[2]
    cases = []
    n_ok = 0
    for name in sorted(os.listdir(src)):
        if not name.endswith(".jinja"):
            continue
        path = os.path.join(src, name)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for case, ctx in CASES.items():
            context = dict(COMMON, **ctx)
            entry = {"template": os.path.abspath(path), "case": case, "context": context}
            try:
                entry["expected"] = _compile_jinja_template(text).render(**context)
                n_ok += 1
            except Exception as e:  # noqa: BLE001 - the template refused this context
                entry["error"] = "%s: %s" % (type(e).__name__, e)
            cases.append(entry)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False)
    print("chat_template_parity: %d cases (%d rendered by jinja2) from %s" % (len(cases), n_ok, src))


if __name__ == "__main__":
    main()
