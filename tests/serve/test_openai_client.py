#!/usr/bin/env python3
"""End to end: `torchspeed serve` driven by the official `openai` Python client (and raw HTTP).

Usage: test_openai_client.py --torchspeed PATH --model-dir DIR [--tp 2] [--only a,b] [--log FILE]

Starts the server on a free 127.0.0.1 port, waits for GET /health, runs independent checks (each
prints `PASS name` or `FAIL name: reason`), then stops the server with SIGTERM and checks it exited
with status 0. Exits 1 if any check failed. No pytest; every network call has a timeout and every
loop is bounded.

The checks of limits and errors are in openai_limit_checks.py, the shared helpers in
openai_support.py.

The model is a byte-level GPT: token id = byte value, so a prompt of k ASCII characters is k
tokens. Generated text can hold U+FFFD for partial UTF-8, so token counts are compared through
`usage`, never through len(text). Request lengths are derived from max_model_len (the tiny test
model has seq_len 32).
"""

import argparse
import concurrent.futures
import email.utils
import http.client
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback

try:
    import openai
    from openai import OpenAI
except ImportError:  # pragma: no cover - reported as a single clear failure
    print("FAIL import: the `openai` Python package is not installed (pip install openai)",
          flush=True)
    sys.exit(1)


from openai_support import *  # noqa: F401,F403 (the shared helpers, CTX and the settings)
from openai_support import _encode, _headers, _on_sigterm
from openai_limit_checks import (check_auth, check_bad_fields, check_bad_ranges, check_disconnect_frees_blocks,
                                 check_full_queue_429, check_metrics, check_overlong_prompt)

# ---------------------------------------------------------------------------------------------
# Checks


def check_health():
    r = raw_request("GET", "/health", auth=False)
    j = expect_json(r, 200)
    check(j.get("status") == "ok", f"/health body {j!r}")
    r = raw_request("GET", "/metrics", auth=False)
    check(r.status == 200, f"/metrics without a key: {r!r}")
    ctype = r.headers.get("content-type", "")
    check(ctype.startswith("text/plain"), f"/metrics Content-Type {ctype!r}")


def check_models():
    page = CTX.client.models.list()
    ids = [m.id for m in page.data]
    check(len(ids) == 1, f"want one model, got {ids}")
    check(isinstance(ids[0], str) and ids[0], f"bad model id {ids[0]!r}")
    check(ids[0] == CTX.model, f"client sees {ids[0]!r}, raw request saw {CTX.model!r}")
    j = expect_json(raw_request("GET", "/v1/models"))
    check(j.get("object") == "list", f"/v1/models object {j.get('object')!r}")
    m = j["data"][0]
    check(m.get("object") == "model", f"model object {m.get('object')!r}")
    check(m.get("owned_by") == "torchspeed", f"owned_by {m.get('owned_by')!r}")
    check(isinstance(m.get("max_model_len"), int) and m["max_model_len"] > 0,
          f"max_model_len {m.get('max_model_len')!r}")


def check_completion_greedy():
    n = tokens_for(4, 20)
    r = complete("The ", max_tokens=n, temperature=0)
    check(r.object == "text_completion", f"object {r.object!r}")
    check(isinstance(r.id, str) and r.id, f"id {r.id!r}")
    check(isinstance(r.created, int) and r.created > 0, f"created {r.created!r}")
    check(r.model == CTX.model, f"model {r.model!r}")
    check(len(r.choices) == 1, f"{len(r.choices)} choices")
    c = r.choices[0]
    check(c.index == 0, f"index {c.index}")
    check(isinstance(c.text, str), f"text is {type(c.text)}")
    check(c.finish_reason == "length", f"finish_reason {c.finish_reason!r}")
    check(c.logprobs is None, f"logprobs not requested but present: {c.logprobs!r}")
    u = r.usage
    check(u.prompt_tokens == 4, f"prompt_tokens {u.prompt_tokens}, want 4")
    check(u.completion_tokens == n, f"completion_tokens {u.completion_tokens}, want {n}")
    check(u.total_tokens == 4 + n, f"total_tokens {u.total_tokens}, want {4 + n}")


def check_determinism():
    n = tokens_for(4, 40)
    a = complete("The ", max_tokens=n, temperature=0).choices[0].text
    b = complete("The ", max_tokens=n, temperature=0).choices[0].text
    check(a == b, f"greedy differs between runs: {a!r} vs {b!r}")
    a = complete("The ", max_tokens=n, temperature=0.8, seed=7).choices[0].text
    b = complete("The ", max_tokens=n, temperature=0.8, seed=7).choices[0].text
    check(a == b, f"seed 7 differs between runs: {a!r} vs {b!r}")
    texts = {complete("The ", max_tokens=n, temperature=0.8, seed=s).choices[0].text
             for s in (1, 2, 3)}
    check(len(texts) >= 2, f"seeds 1, 2, 3 all gave the same {n}-token text: {texts}")


def check_topk_topp_greedy():
    n = tokens_for(4, 20)
    greedy = complete("The ", max_tokens=n, temperature=0).choices[0].text
    k1 = complete("The ", max_tokens=n, temperature=0.8, seed=3,
                  extra_body={"top_k": 1}).choices[0].text
    check(k1 == greedy, f"top_k=1 {k1!r} != greedy {greedy!r}")
    p0 = complete("The ", max_tokens=n, temperature=0.8, seed=3, top_p=1e-6).choices[0].text
    check(p0 == greedy, f"top_p=1e-6 {p0!r} != greedy {greedy!r}")


def repeats(text):
    """Characters (the byte model's tokens) that repeat one already in the text."""
    return len(text) - len(set(text))


def check_sampling_parameters():
    """Each of OpenAI's and vLLM's sampling parameters changes the output as they document."""
    n = tokens_for(4, 48)
    greedy = complete("The ", max_tokens=n, temperature=0).choices[0].text
    check(repeats(greedy) > 0, f"the greedy text repeats nothing, nothing to penalize: {greedy!r}")
    # Penalties lower repeats: frequency and presence on the output, repetition on prompt and output.
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        t = complete("The ", max_tokens=n, temperature=0, **kw).choices[0].text
        check(repeats(t) < repeats(greedy), f"{kw}: {repeats(t)} repeats in {t!r}, greedy had {repeats(greedy)}")
    # Negative penalties encourage them.
    t = complete("The ", max_tokens=n, temperature=0, frequency_penalty=-2.0).choices[0].text
    check(repeats(t) >= repeats(greedy), f"frequency_penalty -2: {repeats(t)} repeats, greedy had {repeats(greedy)}")
    # logit_bias -100 bans a token (the byte model's token id is the byte), +100 forces one.
    top = max(set(greedy), key=greedy.count)
    t = complete("The ", max_tokens=n, temperature=0, logit_bias={str(ord(top)): -100}).choices[0].text
    check(top not in t, f"logit_bias -100 on {top!r}: it is still in {t!r}")
    t = complete("The ", max_tokens=8, temperature=0.9, seed=5, logit_bias={str(ord("q")): 100}).choices[0].text
    check(t == "q" * 8, f"logit_bias +100 on 'q': {t!r}")
    # stop_token_ids end the text at the token, which is not shown; min_tokens holds it back.
    stop_char = greedy[3]
    r = complete("The ", max_tokens=n, temperature=0, extra_body={"stop_token_ids": [ord(stop_char)]}).choices[0]
    check(r.finish_reason == "stop" and r.text == greedy[:greedy.index(stop_char)],
          f"stop_token_ids [{ord(stop_char)}]: {r.text!r} ({r.finish_reason}), greedy {greedy!r}")
    m = greedy.index(stop_char) + 2
    r = complete("The ", max_tokens=n, temperature=0, extra_body={"stop_token_ids": [ord(stop_char)], "min_tokens": m})
    c = r.choices[0]
    check(r.usage.completion_tokens >= m and stop_char not in c.text[:m],
          f"min_tokens {m}: {c.text!r} ({r.usage.completion_tokens} tokens, {c.finish_reason})")
    # Stop strings also wait for min_tokens: one may end in the 6th token at the earliest.
    r = complete("The ", max_tokens=n, temperature=0, stop=[greedy[1:3]], extra_body={"min_tokens": 6}).choices[0]
    check(len(r.text) >= 5 and r.text == greedy[:len(r.text)], f"min_tokens 6 with stop {greedy[1:3]!r}: {r.text!r}")
    # min_p 1 keeps only the most likely token: greedy whatever the temperature.
    t = complete("The ", max_tokens=n, temperature=1.5, seed=2, extra_body={"min_p": 1.0}).choices[0].text
    check(t == greedy, f"min_p 1: {t!r} != greedy {greedy!r}")
    # best_of: that many candidates (seeds seed + k, as n gives them), the one with the highest
    # log-probability per token returned, every candidate's tokens in usage.
    k = 4
    cands = complete("The ", max_tokens=12, temperature=1.0, seed=21, n=k, logprobs=0,
                     extra_body={"ignore_eos": True}).choices
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in cands]
    best = cands[mean.index(max(mean))].text
    r = complete("The ", max_tokens=12, temperature=1.0, seed=21, best_of=k, extra_body={"ignore_eos": True})
    check(len(r.choices) == 1 and r.choices[0].text == best,
          f"best_of {k}: {[c.text for c in r.choices]}, want {best!r} of {[c.text for c in cands]} ({mean})")
    check(r.choices[0].logprobs is None, "best_of without logprobs returned logprobs")
    check(r.usage.completion_tokens == 12 * k, f"best_of {k}: usage {r.usage!r}, want {12 * k} completion tokens")
    # The same seed gives the same tokens alone and beside other requests, penalties and all.
    kw = {"max_tokens": 24, "temperature": 0.9, "seed": 31, "presence_penalty": 0.7, "frequency_penalty": 0.3,
          "extra_body": {"repetition_penalty": 1.2, "min_p": 0.02, "top_k": 40}}
    alone = complete("The ", **kw).choices[0].text
    # At most MAX_QUEUE at once: all of them may reach the server before its loop admits any, and
    # more would be refused with 429 (seen on a loaded machine).
    with concurrent.futures.ThreadPoolExecutor(MAX_QUEUE) as pool:
        futs = [pool.submit(complete, p, **kw) for p in ("The ", "A cat ", "The ", "Why ")[:MAX_QUEUE]]
        texts = [f.result().choices[0].text for f in futs]
    check(all(t == alone for t in texts[0::2]), f"seed 31 alone {alone!r}, in a batch {texts[0::2]}")


def check_tokenize():
    """vLLM's /tokenize and /detokenize, as vllm bench serve calls them."""
    text = "Hello, tokens!"
    j = expect_json(raw_request("POST", "/tokenize", {"model": CTX.model, "prompt": text, "add_special_tokens": False}))
    check(j["tokens"] == list(text.encode()) and j["count"] == len(text) and j["max_model_len"] == CTX.max_len,
          f"/tokenize of {text!r}: {j}")
    check(j["token_strs"] is None, f"token_strs not asked for: {j}")
    j = expect_json(raw_request("POST", "/tokenize", {"prompt": "ab", "return_token_strs": True}))
    check(j["token_strs"] == ["a", "b"], f"token_strs {j}")
    back = expect_json(raw_request("POST", "/detokenize", {"model": CTX.model, "tokens": list(text.encode())}))
    check(back == {"prompt": text}, f"/detokenize: {back}")
    # Chat messages go through the chat template: the same ids a chat completion's prompt has.
    msgs = [{"role": "user", "content": "Hi"}]
    j = expect_json(raw_request("POST", "/tokenize", {"model": CTX.model, "messages": msgs}))
    r = CTX.client.chat.completions.create(model=CTX.model, messages=msgs, max_tokens=1)
    check(j["count"] == r.usage.prompt_tokens, f"/tokenize of chat messages: {j['count']} tokens, chat usage {r.usage!r}")
    expect_error(raw_request("POST", "/detokenize", {"tokens": [1, 256]}), 400, "tokens")
    expect_error(raw_request("POST", "/tokenize", {"prompt": "x", "bogus": 1}), 400, "bogus")
    expect_error(raw_request("POST", "/tokenize", {"prompt": 5}), 400, "prompt")
    expect_error(raw_request("POST", "/tokenize", {"model": "nope", "prompt": "x"}), 404, "model")
    expect_error(raw_request("POST", "/tokenize", {"prompt": "x"}, auth=False), 401)


def check_structured_output():
    """response_format and structured_outputs: every text parses and validates (jsonschema)."""
    import jsonschema
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]},
                                               "c": {"type": "boolean"}, "d": {"type": "string", "maxLength": 6}},
              "required": ["a", "b", "c"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Hi"}]
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    n = tokens_for(16, 80)
    r = CTX.client.chat.completions.create(model=CTX.model, messages=msgs, max_tokens=n, temperature=1.0, seed=3,
                                           n=4, response_format=rf)
    for c in r.choices:
        check(c.finish_reason == "stop", f"json_schema: finish_reason {c.finish_reason!r}: {c.message.content!r}")
        jsonschema.validate(json.loads(c.message.content), schema)
    # The client's property order is kept: a before b before c.
    for c in r.choices:
        keys = list(json.loads(c.message.content))
        check(keys == sorted(keys, key="abcd".index), f"properties out of the schema's order: {keys}")
    # Completions too, streamed, and vLLM's structured_outputs.
    text, reasons = stream_complete("The ", max_tokens=n, temperature=0.9, seed=4, extra_body={"response_format": rf})
    check_stream_reasons(reasons, "stop")
    jsonschema.validate(json.loads(text), schema)
    r = complete("The ", max_tokens=n, temperature=0.9, seed=5, extra_body={"structured_outputs": {"json": schema}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = complete("The ", max_tokens=8, temperature=1.0, seed=6, n=4,
                 extra_body={"structured_outputs": {"choice": ["cat", "dog", "fish"]}})
    check(all(c.text in ("cat", "dog", "fish") and c.finish_reason == "stop" for c in r.choices),
          f"choice: {[(c.text, c.finish_reason) for c in r.choices]}")
    r = CTX.client.chat.completions.create(model=CTX.model, messages=msgs, max_tokens=n, temperature=0,
                                           response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":
        check(isinstance(json.loads(c.message.content), dict), f"json_object: {c.message.content!r}")
    # What cannot be held to is refused, naming the keyword.
    bad = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "string", "pattern": "(?=a)b"}}}
    expect_error(raw_request("POST", "/v1/chat/completions", completions_body(messages=msgs, response_format=bad)),
                 400, "response_format.json_schema.schema.pattern")
    expect_error(raw_request("POST", "/v1/chat/completions", completions_body(
        messages=msgs, response_format={"type": "xml"})), 400, "response_format.type")
    expect_error(raw_request("POST", "/v1/completions", completions_body(
        prompt="x", structured_outputs={"grammar": "root ::= \"a\""})), 400, "structured_outputs.grammar")
    expect_error(raw_request("POST", "/v1/completions", completions_body(
        prompt="x", structured_outputs={"regex": "(a"})), 400, "structured_outputs.regex")
    # A regular expression (vLLM's structured_outputs.regex): the whole text matches.
    import re
    pat = "[A-Z][a-z]{1,6}-[0-9]{2,4}"
    r = complete("The ", max_tokens=20, temperature=1.0, seed=8, n=4, extra_body={"structured_outputs": {"regex": pat}})
    for c in r.choices:
        check(re.fullmatch(pat, c.text) and c.finish_reason == "stop", f"regex {pat}: {c.text!r} ({c.finish_reason})")


def check_embeddings():
    """/v1/embeddings: pooled final hidden states, unit length, the same alone or in a list, as
    text or token ids, as floats or base64, while generation runs beside them."""
    import base64
    import math
    r = CTX.client.embeddings.create(model=CTX.model, input=["Hi", "The cat", "Hi"])
    vecs = [d.embedding for d in r.data]
    dim = len(vecs[0])
    check(len(vecs) == 3 and all(len(v) == dim for v in vecs) and dim > 8, f"{len(vecs)} embeddings of {dim} values")
    check([d.index for d in r.data] == [0, 1, 2], f"indices {[d.index for d in r.data]}")
    for v in vecs:
        check(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4, "an embedding is not unit length")
    check(vecs[0] == vecs[2] and vecs[0] != vecs[1], "equal inputs gave different embeddings, or different inputs equal ones")
    check(r.usage.prompt_tokens == 2 + 7 + 2, f"usage {r.usage!r}")
    alone = CTX.client.embeddings.create(model=CTX.model, input="Hi").data[0].embedding
    ids = CTX.client.embeddings.create(model=CTX.model, input=[72, 105]).data[0].embedding
    check(alone == vecs[0] and ids == vecs[0], "\"Hi\" alone, in a list and as token ids gave different embeddings")
    j = expect_json(raw_request("POST", "/v1/embeddings", {"model": CTX.model, "input": "Hi", "encoding_format": "base64"}))
    raw = base64.b64decode(j["data"][0]["embedding"])
    floats = list(struct.unpack("<%df" % (len(raw) // 4), raw))
    check(floats == vecs[0], "base64 embedding differs from the float one")
    # Beside a running generation: both answered.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        gen = pool.submit(complete, "The ", max_tokens=tokens_for(4, 60), temperature=0)
        emb = pool.submit(CTX.client.embeddings.create, model=CTX.model, input=["The cat"] * 4)
        check(all(d.embedding == vecs[1] for d in emb.result().data), "embeddings changed beside a generation")
        check(gen.result().usage.completion_tokens > 0, "the generation beside embeddings")
    expect_error(raw_request("POST", "/v1/embeddings", {"model": CTX.model, "input": "Hi", "dimensions": dim + 1}), 400, "dimensions")
    expect_error(raw_request("POST", "/v1/embeddings", {"model": CTX.model, "input": ""}), 400, "input")
    expect_error(raw_request("POST", "/v1/embeddings", {"model": CTX.model, "input": "Hi", "pooling": "mean"}), 400, "pooling")
    expect_error(raw_request("POST", "/v1/embeddings", {"model": CTX.model, "input": "a" * (CTX.max_len + 1)}), 400, "input")
    expect_error(raw_request("POST", "/v1/embeddings", {"model": CTX.model, "input": [[1, 2], [300]]}), 400, "input[1]")


def check_stream_equals_nonstream():
    n = tokens_for(4, 40)
    for kw in ({"temperature": 0}, {"temperature": 0.8, "seed": 11}):
        full = complete("The ", max_tokens=n, **kw)
        text, reasons = stream_complete("The ", max_tokens=n, **kw)
        check(text == full.choices[0].text,
              f"{kw}: streamed {text!r} != non-streamed {full.choices[0].text!r}")
        check_stream_reasons(reasons, full.choices[0].finish_reason)
    # Raw: the wire format itself, including the final [DONE].
    full = complete("The ", max_tokens=n, temperature=0).choices[0].text
    st = raw_request("POST", "/v1/completions", completions_body(
        prompt="The ", max_tokens=n, temperature=0, stream=True), stream=True)
    try:
        if st.status != 200:  # the message reads the body: only when failing
            raise CheckFailed(f"raw stream: HTTP {st.status} {st.read_body()[:300]!r}")
        ctype = st.resp_headers.get("content-type", "")
        check(ctype.startswith("text/event-stream"), f"stream Content-Type {ctype!r}")
        chunks, done, after = sse_json_chunks(st)
    finally:
        st.close()
    check(done, f"raw stream did not end with data: [DONE] ({len(chunks)} chunks, last {chunks[-1:]!r})")
    check(after == 0, f"{after} events after [DONE]")
    check(chunks, "raw stream had no chunks")
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    check(text == full, f"raw streamed {text!r} != non-streamed {full!r}")
    reasons = [ch.get("finish_reason") for c in chunks for ch in c.get("choices", [])]
    check_stream_reasons(reasons, "length")
    check(all(c.get("object") == "text_completion" for c in chunks),
          f"chunk object field: {[c.get('object') for c in chunks][:3]}")


def pick_stop(text):
    """(position, s): an ASCII substring of text whose first occurrence is at position; prefers
    position >= 5 and 3 characters. None if text has no ASCII character at all."""
    def ascii_ok(s):
        return all(0 < ord(ch) < 128 for ch in s)
    for min_start in (5, 1, 0):
        for length in (3, 2, 1):
            for p in range(min_start, len(text) - length + 1):
                s = text[p:p + length]
                if ascii_ok(s) and text.find(s) == p:
                    return p, s
    return None


def check_stop():
    n = tokens_for(4, 40)
    t = complete("The ", max_tokens=n, temperature=0).choices[0].text
    picked = pick_stop(t)
    check(picked is not None, f"greedy text has no ASCII character to stop on: {t!r}")
    p, s = picked
    want = t[:p]
    for stop in ([s], s):
        r = complete("The ", max_tokens=n, temperature=0, stop=stop)
        c = r.choices[0]
        check(c.text == want, f"stop={stop!r}: text {c.text!r}, want {want!r} (full {t!r})")
        check(c.finish_reason == "stop", f"stop={stop!r}: finish_reason {c.finish_reason!r}")
        check(r.usage.completion_tokens <= n, f"completion_tokens {r.usage.completion_tokens}")
    text, reasons = stream_complete("The ", max_tokens=n, temperature=0, stop=[s])
    check(s not in text, f"streamed text contains the stop string {s!r}: {text!r}")
    check(text == want, f"streamed with stop {s!r}: {text!r}, want {want!r} (full {t!r})")
    check_stream_reasons(reasons, "stop")
    # A stop string that never occurs changes nothing.
    absent = [ch * 3 for ch in "~`|^{}<>" if ch not in t][:2]
    r = complete("The ", max_tokens=n, temperature=0, stop=absent)
    check(r.choices[0].text == t and r.choices[0].finish_reason == "length",
          f"absent stop strings changed the output: {r.choices[0].text!r} vs {t!r}")


def check_n():
    n_tok = tokens_for(4, 16)
    r = complete("The ", n=3, max_tokens=n_tok, temperature=0.8, seed=1)
    idx = sorted(c.index for c in r.choices)
    check(idx == [0, 1, 2], f"choice indices {idx}")
    for c in r.choices:
        check(isinstance(c.text, str), f"choice {c.index}: text {type(c.text)}")
        check(c.finish_reason == "length", f"choice {c.index}: finish_reason {c.finish_reason!r}")
    check(r.usage.completion_tokens == 3 * n_tok,
          f"completion_tokens {r.usage.completion_tokens}, want 3 x {n_tok} (sum over choices)")
    check(r.usage.prompt_tokens == 4, f"prompt_tokens {r.usage.prompt_tokens}, want 4")
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    check(len(set(texts)) >= 2, f"n=3 sampled choices are all identical: {texts}")
    again = complete("The ", n=3, max_tokens=n_tok, temperature=0.8, seed=1)
    texts2 = [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    check(texts == texts2, f"n=3 seed 1 differs between runs: {texts} vs {texts2}")


def check_logprobs():
    r = complete("The ", max_tokens=5, temperature=0, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    check(lp is not None, "logprobs missing")
    check(lp.tokens is not None and len(lp.tokens) == 5, f"tokens {lp.tokens!r}")
    check(all(isinstance(t, str) for t in lp.tokens), f"tokens not all str: {lp.tokens!r}")
    tl = lp.token_logprobs
    check(tl is not None and len(tl) == 5, f"token_logprobs {tl!r}")
    check(all(isinstance(x, (int, float)) and x <= 1e-6 for x in tl), f"token_logprobs {tl!r}")
    top = lp.top_logprobs
    check(top is not None and len(top) == 5, f"top_logprobs {top!r}")
    for i, d in enumerate(top):
        check(isinstance(d, dict) and 1 <= len(d) <= 3, f"top_logprobs[{i}] = {d!r}")
        check(all(isinstance(v, (int, float)) and v <= 1e-6 for v in d.values()),
              f"top_logprobs[{i}] values {d!r}")
        # Greedy picks the most likely token: its logprob is the top one.
        check(tl[i] >= max(d.values()) - 1e-3,
              f"greedy token {i} logprob {tl[i]} below the top alternative {d!r}")
    check(any(len(d) == 3 for d in top), f"no top_logprobs entry has 3 alternatives: {top!r}")
    off = lp.text_offset
    check(off is not None and len(off) == 5, f"text_offset {off!r}")
    check(all(isinstance(o, int) for o in off), f"text_offset {off!r}")
    check(all(b >= a for a, b in zip(off, off[1:])), f"text_offset not increasing: {off}")
    if all(ord(ch) < 128 for ch in c.text) and all(ord(ch) < 128 for t in lp.tokens for ch in t):
        check("".join(lp.tokens) == c.text, f"tokens {lp.tokens!r} do not spell {c.text!r}")
        check(all(b > a for a, b in zip(off, off[1:])), f"text_offset not increasing: {off}")


def check_echo():
    r = complete("Hello", max_tokens=3, temperature=0, echo=True)
    t = r.choices[0].text
    check(t.startswith("Hello"), f"echo text {t!r} does not start with the prompt")
    check(r.usage.completion_tokens == 3, f"completion_tokens {r.usage.completion_tokens}")
    plain = complete("Hello", max_tokens=3, temperature=0).choices[0].text
    check(t == "Hello" + plain, f"echo {t!r} != prompt + completion {'Hello' + plain!r}")


def check_token_id_prompt():
    n = tokens_for(5, 12)
    a = complete("Hello", max_tokens=n, temperature=0)
    b = complete([72, 101, 108, 108, 111], max_tokens=n, temperature=0)
    check(a.choices[0].text == b.choices[0].text,
          f"token ids gave {b.choices[0].text!r}, string gave {a.choices[0].text!r}")
    check(b.usage.prompt_tokens == 5, f"prompt_tokens {b.usage.prompt_tokens}, want 5")


def check_prompt_list():
    n = tokens_for(1, 8)
    single = {p: complete(p, max_tokens=n, temperature=0).choices[0].text for p in ("A", "B")}
    for prompt in (["A", "B"], [[65], [66]]):
        r = complete(prompt, max_tokens=n, temperature=0)
        by_index = {c.index: c.text for c in r.choices}
        check(sorted(by_index) == [0, 1], f"prompt {prompt!r}: indices {sorted(by_index)}")
        check(by_index[0] == single["A"] and by_index[1] == single["B"],
              f"prompt {prompt!r}: {by_index} vs one at a time {single}")
        check(r.usage.prompt_tokens == 2,
              f"prompt {prompt!r}: prompt_tokens {r.usage.prompt_tokens}")
        check(r.usage.completion_tokens == 2 * n,
              f"prompt {prompt!r}: completion_tokens {r.usage.completion_tokens}, want {2 * n}")


def check_chat():
    msgs = [{"role": "user", "content": "Hi"}]
    try:  # learn the templated prompt length first: the test model's context can be short
        probe = CTX.client.chat.completions.create(model=CTX.model, messages=msgs, max_tokens=1,
                                                   temperature=0)
    except openai.BadRequestError as e:
        raise CheckFailed(f"chat with max_tokens=1 rejected (template longer than "
                          f"max_model_len {CTX.max_len}?): {e}")
    n = tokens_for(probe.usage.prompt_tokens, 10)
    r = CTX.client.chat.completions.create(model=CTX.model, messages=msgs, max_tokens=n,
                                           temperature=0)
    check(r.object == "chat.completion", f"object {r.object!r}")
    check(len(r.choices) == 1 and r.choices[0].index == 0, f"choices {r.choices!r}")
    m = r.choices[0].message
    check(m.role == "assistant", f"role {m.role!r}")
    check(isinstance(m.content, str), f"content {m.content!r}")
    check(r.choices[0].finish_reason in ("stop", "length"),
          f"finish_reason {r.choices[0].finish_reason!r}")
    check(r.usage.completion_tokens <= n, f"completion_tokens {r.usage.completion_tokens} > {n}")
    stream = CTX.client.chat.completions.create(model=CTX.model, messages=msgs, max_tokens=n,
                                                temperature=0, stream=True)
    parts, reasons, roles = [], [], []
    try:
        for chunk in stream:
            check(chunk.object == "chat.completion.chunk", f"chunk object {chunk.object!r}")
            for c in chunk.choices:
                if c.delta.role is not None:
                    roles.append(c.delta.role)
                parts.append(c.delta.content or "")
                reasons.append(c.finish_reason)
    finally:
        close = getattr(stream, "close", None)
        if close:
            close()
    check(all(x == "assistant" for x in roles), f"delta roles {roles}")
    text = "".join(parts)
    check(text == m.content, f"streamed chat {text!r} != non-streamed {m.content!r}")
    check_stream_reasons(reasons, r.choices[0].finish_reason)


CHECKS = [
    ("health", check_health),
    ("models", check_models),
    ("completion_greedy", check_completion_greedy),
    ("determinism", check_determinism),
    ("topk_topp_greedy", check_topk_topp_greedy),
    ("sampling_parameters", check_sampling_parameters),
    ("tokenize", check_tokenize),
    ("structured_output", check_structured_output),
    ("embeddings", check_embeddings),
    ("stream_equals_nonstream", check_stream_equals_nonstream),
    ("stop", check_stop),
    ("n", check_n),
    ("logprobs", check_logprobs),
    ("echo", check_echo),
    ("token_id_prompt", check_token_id_prompt),
    ("prompt_list", check_prompt_list),
    ("chat", check_chat),
    ("bad_fields", check_bad_fields),
    ("bad_ranges", check_bad_ranges),
    ("overlong_prompt", check_overlong_prompt),
    ("auth", check_auth),
    ("full_queue_429", check_full_queue_429),
    ("disconnect_frees_blocks", check_disconnect_frees_blocks),
    ("metrics", check_metrics),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torchspeed", required=True, help="the torchspeed executable")
    ap.add_argument("--model-dir", required=True, help="checkpoint directory to serve")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (adds -n N --tp N)")
    ap.add_argument("--only", default="", help="comma-separated check names to run")
    ap.add_argument("--log", default=None, help="server log file (default: a temporary file)")
    args = ap.parse_args()

    checks = CHECKS
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in dict(CHECKS)]
        if unknown:
            print(f"unknown checks {unknown}; known: {[n for n, _ in CHECKS]}", flush=True)
            return 2
        checks = [(n, f) for n, f in CHECKS if n in wanted]

    # The client must reach 127.0.0.1 directly, whatever proxy the environment names.
    no_proxy = ",".join(x for x in (os.environ.get("NO_PROXY"), "127.0.0.1", "localhost") if x)
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = no_proxy
    signal.signal(signal.SIGTERM, _on_sigterm)

    if args.log:
        log_path = args.log
        log = open(log_path, "wb")
    else:
        fd, log_path = tempfile.mkstemp(prefix=f"torchspeed-serve-tp{args.tp}-", suffix=".log")
        log = os.fdopen(fd, "wb")
    print(f"server log: {log_path}", flush=True)

    CTX.port = free_port()
    CTX.base = f"http://{HOST}:{CTX.port}/v1"
    failed, ran = [], 0
    proc = None
    try:
        try:
            proc = CTX.proc = start_server(args, CTX.port, log)
        except OSError as e:
            print(f"FAIL startup: cannot run {args.torchspeed}: {e}", flush=True)
            failed.append("startup")
            return 1
        why = wait_healthy(proc, CTX.port)
        if why:
            print(f"FAIL startup: {why}", flush=True)
            failed.append("startup")
            return 1
        try:
            j = expect_json(raw_request("GET", "/v1/models"))
            CTX.model = j["data"][0]["id"]
            CTX.max_len = int(j["data"][0]["max_model_len"])
        except Exception as e:  # noqa: BLE001
            print(f"FAIL setup: GET /v1/models: {type(e).__name__}: {e}", flush=True)
            failed.append("setup")
            return 1
        print(f"model {CTX.model!r}, max_model_len {CTX.max_len}, port {CTX.port}", flush=True)
        CTX.client = OpenAI(base_url=CTX.base, api_key=API_KEY, timeout=HTTP_TIMEOUT, max_retries=0)

        for name, fn in checks:
            t0 = time.monotonic()
            why = run_check(name, fn)
            ran += 1
            if why:
                failed.append(name)
                print(f"FAIL {name}: {why}", flush=True)
            else:
                print(f"PASS {name}", flush=True)
            took = time.monotonic() - t0
            if took > 5:
                print(f"  ({name} took {took:.1f} s)", flush=True)

        ran += 1
        why = stop_server(proc)
        if why:
            failed.append("graceful_shutdown")
            print(f"FAIL graceful_shutdown: {why}", flush=True)
        else:
            print("PASS graceful_shutdown", flush=True)
    except KeyboardInterrupt:
        print("FAIL interrupted", flush=True)
        failed.append("interrupted")
    finally:
        if CTX.client is not None:
            try:
                CTX.client.close()
            except Exception:  # noqa: BLE001
                pass
        if proc is not None and proc.poll() is None:
            why = stop_server(proc)
            if why:
                print(f"(cleanup) {why}", flush=True)
        log.close()
        if failed:
            print(f"--- last lines of the server log {log_path} ---", flush=True)
            print(log_tail(log_path), flush=True)
            print("--- end of server log ---", flush=True)
        elif not args.log:
            try:
                os.unlink(log_path)
            except OSError:
                pass

    if failed:
        print(f"{len(failed)} of {ran} checks failed: {', '.join(failed)}", flush=True)
        return 1
    print(f"all {ran} checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
