#!/usr/bin/env python3
"""Soak: `torchspeed serve` (with an API key) under mixed hostile load, bounded in time.

Many concurrent clients, each looping over a random mix for --seconds: good completions
(streamed and not), streams cancelled mid-way, non-streamed requests abandoned, bad requests
(invalid or deeply nested JSON, 1e400, wrong key, unknown model, bodies past the limit sent
chunked, gzip bodies, endless header lines), slow readers and clients that trickle a request a
byte at a time. A poller times /health all along. A warm-up round with the same mix first sets
the plateau. Afterwards the server must be idle again with no KV block held, no more threads or
file descriptors than at the plateau and its RSS back near the plateau; every good request must
have been answered (200, or 429/503 under overload) and every bad one refused with its 4xx.
Exit status 0 when all that holds; the figures are printed (and written with --json).
Standard library only.
"""
import argparse
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

HOST = "127.0.0.1"
KEY = "soak-key"


def free_port():
    s = socket.socket()
    s.bind((HOST, 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Ctx:
    port = 0
    model = ""
    stop_at = 0.0


CTX = Ctx()


def connect(timeout=30.0):
    s = socket.create_connection((HOST, CTX.port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def request_bytes(method, path, body=None, headers=None, auth=True):
    h = {"Host": f"{HOST}:{CTX.port}"}
    if auth:
        h["Authorization"] = f"Bearer {KEY}"
    if body is not None:
        if not isinstance(body, (bytes, bytearray)):
            body = json.dumps(body).encode()
        h["Content-Type"] = "application/json"
        h["Content-Length"] = str(len(body))
    h.update(headers or {})
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    return head.encode() + (body or b"")


def read_head(sock):
    """(status, headers, leftover bytes) of a response."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the response head")
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, rest


def read_body(sock, headers, rest):
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed inside the body")
            rest += chunk
        return rest[:n]
    if headers.get("transfer-encoding") == "chunked":
        out = b""
        while True:
            while b"\r\n" not in rest:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("closed inside a chunk size")
                rest += chunk
            line, rest = rest.split(b"\r\n", 1)
            n = int(line.split(b";")[0], 16)
            while len(rest) < n + 2:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("closed inside a chunk")
                rest += chunk
            out += rest[:n]
            rest = rest[n + 2:]
            if n == 0:
                return out
    out = rest
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return out
        out += chunk


def http(method, path, body=None, headers=None, auth=True, timeout=60.0):
    with connect(timeout) as s:
        s.sendall(request_bytes(method, path, body, headers, auth))
        status, h, rest = read_head(s)
        return status, h, read_body(s, h, rest)


def metrics():
    status, _, body = http("GET", "/metrics", auth=False)
    out = {}
    for line in body.decode().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{")[0]
        if "_bucket" in name:
            continue
        out[name] = float(value)
    return out


PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.",
           "Hello", "List three colours:", "In 1969,", "The quick brown fox"]


class Stats:
    def __init__(self):
        self.mu = threading.Lock()
        self.counts = {}
        self.failures = []

    def add(self, key):
        with self.mu:
            self.counts[key] = self.counts.get(key, 0) + 1

    def fail(self, what):
        with self.mu:
            if len(self.failures) < 50:
                self.failures.append(what)
            self.counts["failures"] = self.counts.get("failures", 0) + 1


def good_body(rng, stream):
    return {"model": CTX.model, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 24),
            "temperature": rng.choice([0.0, 0.8]), "n": rng.choice([1, 1, 2]), "stream": stream}


def scenario_good(rng, st):
    status, _, body = http("POST", "/v1/completions", good_body(rng, False))
    if status == 200:
        j = json.loads(body)
        if not j.get("choices") or j["usage"]["completion_tokens"] <= 0:
            st.fail(f"good: 200 without choices/usage: {body[:200]!r}")
        st.add("served")
    elif status in (429, 503):
        st.add(f"rejected_{status}")
    else:
        st.fail(f"good: HTTP {status} {body[:200]!r}")


def scenario_chat(rng, st):
    b = {"model": CTX.model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": rng.randint(4, 16)}
    status, _, body = http("POST", "/v1/chat/completions", b)
    if status == 200:
        if not json.loads(body).get("choices"):
            st.fail(f"chat: 200 without choices: {body[:200]!r}")
        st.add("served")
    elif status in (429, 503):
        st.add(f"rejected_{status}")
    else:
        st.fail(f"chat: HTTP {status} {body[:200]!r}")


def scenario_stream(rng, st, cancel_after=None, slow=False):
    with connect() as s:
        if slow:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        b = good_body(rng, True)
        if cancel_after is not None or slow:
            b["max_tokens"] = 64
        s.sendall(request_bytes("POST", "/v1/completions", b))
        status, h, rest = read_head(s)
        if status != 200:
            body = read_body(s, h, rest)
            if status in (429, 503):
                st.add(f"rejected_{status}")
            else:
                st.fail(f"stream: HTTP {status} {body[:200]!r}")
            return
        if slow:  # a reader that takes a byte now and then, then leaves
            end = time.monotonic() + rng.uniform(1.0, 3.0)
            while time.monotonic() < end:
                if not s.recv(1):
                    break
                time.sleep(0.05)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            st.add("slow_readers")
            return
        if cancel_after is not None:
            got = rest
            while got.count(b"data: ") < cancel_after:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            st.add("streams_cancelled")
            return
        body = read_body(s, h, rest)
        if not body.rstrip().endswith(b"data: [DONE]"):
            st.fail(f"stream did not end with [DONE]: {body[-200:]!r}")
        st.add("served")


def scenario_abandon(rng, st):
    with connect() as s:
        b = good_body(rng, False)
        b["max_tokens"] = 64
        b["n"] = 4
        s.sendall(request_bytes("POST", "/v1/completions", b))
        time.sleep(rng.uniform(0.0, 0.4))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    st.add("abandoned")


BAD = [
    ("invalid_json", lambda: ("POST", "/v1/completions", b"{\"model\": ", {}, True), {400}),
    ("nested_json", lambda: ("POST", "/v1/chat/completions",
                              b"{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": " + b"[" * 300000 + b"]" * 300000 + b"}]}",
                              {}, True), {400}),
    ("huge_number", lambda: ("POST", "/v1/completions",
                              json.dumps({"model": CTX.model, "prompt": "x"}).encode()[:-1] + b", \"temperature\": 1e400}", {}, True), {400}),
    ("wrong_key", lambda: ("POST", "/v1/completions", json.dumps({"model": CTX.model, "prompt": "x"}).encode(),
                           {"Authorization": "Bearer nope"}, False), {401}),
    ("unknown_model", lambda: ("POST", "/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode(), {}, True), {404}),
    ("bad_field", lambda: ("POST", "/v1/completions", json.dumps({"model": CTX.model, "prompt": "x", "n": "two"}).encode(), {}, True), {400}),
    ("gzip_body", lambda: ("POST", "/v1/completions", b"\x1f\x8b\x08\x00" + b"\x00" * 64, {"Content-Encoding": "gzip"}, True), {415}),
]


def scenario_bad(rng, st):
    name, make, want = rng.choice(BAD)
    method, path, body, headers, auth = make()
    status, _, resp = http(method, path, body, headers, auth)
    if status not in want:
        st.fail(f"bad {name}: HTTP {status} (want {sorted(want)}) {resp[:200]!r}")
    else:
        if not isinstance(json.loads(resp).get("error"), dict):
            st.fail(f"bad {name}: not an OpenAI error body {resp[:200]!r}")
        st.add(f"refused_{status}")


def scenario_big_chunked(rng, st):
    """A chunked body without end: refused with 413 once past the limit (or the connection
    cut while we still send), never buffered."""
    with connect() as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"10000\r\n" + b"a" * 65536 + b"\r\n"
        try:
            for _ in range(64):  # 4 MiB, the limit is 1 MiB
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            status, _, _ = read_head(s)
            if status != 413:
                st.fail(f"big chunked body: HTTP {status}")
                return
        except (ConnectionError, OSError):
            pass  # cut while sending: the 413 was lost with the reset
        st.add("refused_413")


def scenario_long_header(rng, st):
    with connect() as s:
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nX-Long: " + b"b" * (1 << 20))
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            status, _, _ = read_head(s)
            if status != 431:
                st.fail(f"long header: HTTP {status}")
                return
        except (ConnectionError, OSError):
            pass
        st.add("refused_431")


def scenario_trickle(rng, st):
    with connect() as s:
        req = request_bytes("POST", "/v1/completions", good_body(rng, False))
        end = time.monotonic() + rng.uniform(1.0, 3.0)
        i = 0
        try:
            while time.monotonic() < end and i < len(req) - 1:
                s.sendall(req[i:i + 1])
                i += 1
                time.sleep(0.3)
        except (BrokenPipeError, ConnectionResetError):
            pass
    st.add("trickled")


MIX = [(scenario_good, 22), (scenario_chat, 8), (lambda r, s: scenario_stream(r, s), 18),
       (lambda r, s: scenario_stream(r, s, cancel_after=2), 10), (scenario_abandon, 10), (scenario_bad, 16),
       (scenario_big_chunked, 3), (scenario_long_header, 3), (lambda r, s: scenario_stream(r, s, slow=True), 5),
       (scenario_trickle, 5)]


def client(i, st, until):
    rng = random.Random(1000 + i)
    fns = [f for f, w in MIX for _ in range(w)]
    while time.monotonic() < until:
        f = rng.choice(fns)
        try:
            f(rng, st)
        except Exception as e:  # noqa: BLE001 - every unexpected error is a finding
            st.fail(f"{getattr(f, '__name__', 'scenario')}: {type(e).__name__}: {e}")


def health_poller(lat, bad, until):
    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            status, _, _ = http("GET", "/health", auth=False, timeout=10)
            lat.append(time.monotonic() - t0)
            if status != 200:
                bad.append(status)
        except Exception as e:  # noqa: BLE001
            bad.append(repr(e))
        time.sleep(0.05)


def run_round(seconds, clients):
    st = Stats()
    until = time.monotonic() + seconds
    lat, bad = [], []
    threads = [threading.Thread(target=client, args=(i, st, until), daemon=True) for i in range(clients)]
    poll = threading.Thread(target=health_poller, args=(lat, bad, until), daemon=True)
    for t in threads + [poll]:
        t.start()
    for t in threads + [poll]:
        t.join(seconds + 120)
    alive = sum(t.is_alive() for t in threads)
    if alive:
        st.fail(f"{alive} clients still running {seconds + 120:.0f} s after the round's end")
    return st, lat, bad


def proc_figures(pid):
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": len(os.listdir(f"/proc/{pid}/task")), "rss": rss, "peak_rss": hwm}


def settled_figures(pid, than=None, seconds=5.0):
    """proc_figures once the server has closed the connections it was last asked on: the /metrics
    poll that found it idle closes from our side first, so its socket may still be open on the
    server's for a moment. The fewest descriptors seen in `seconds` (sooner if at most `than`)."""
    best = proc_figures(pid)
    end = time.monotonic() + seconds
    while time.monotonic() < end and (than is None or best["fds"] > than):
        time.sleep(0.05)
        now = proc_figures(pid)
        if now["fds"] < best["fds"]:
            best = now
    return best


def wait_idle(timeout):
    end = time.monotonic() + timeout
    m = {}
    while time.monotonic() < end:
        m = metrics()
        if (m.get("torchspeed_requests_running", 1) == 0 and m.get("torchspeed_requests_waiting", 1) == 0
                and m.get("torchspeed_kv_blocks_used", 1) == 0 and m.get("torchspeed_http_requests_in_flight", 2) <= 1):
            return True, m
        time.sleep(0.2)
    return False, m


def wait_healthy(proc, tries=600):
    """True once /health on CTX.port answers 200; False if the server exits or 60 s pass."""
    for _ in range(tries):
        try:
            if http("GET", "/health", auth=False, timeout=2)[0] == 200:
                return True
        except OSError:
            pass
        if proc.poll() is not None:
            return False
        time.sleep(0.1)
    return False


def check_cancellation(failures):
    """A client that leaves a request (non-streamed, then streamed) frees its sequences and KV
    blocks on the engine's next step, far fewer tokens generated than asked."""
    for stream in (False, True):
        before = metrics()
        s = connect()
        body = {"model": CTX.model, "prompt": "Tell me a long story.", "max_tokens": 400, "n": 4, "ignore_eos": True,
                "temperature": 0.8, "stream": stream}
        s.sendall(request_bytes("POST", "/v1/completions", body))
        end = time.monotonic() + 30
        while time.monotonic() < end and metrics().get("torchspeed_requests_running", 0) < 4:
            time.sleep(0.02)
        time.sleep(0.3)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        steps0 = metrics()["torchspeed_engine_steps_total"]
        s.close()
        t0 = time.monotonic()
        freed = False
        while time.monotonic() - t0 < 10:
            m = metrics()
            if m["torchspeed_requests_running"] == 0 and m["torchspeed_kv_blocks_used"] == 0:
                freed = True
                break
            time.sleep(0.01)
        took = time.monotonic() - t0
        m = metrics()
        # Freed on the engine's next step: the one running when the client left, and the next.
        steps = m["torchspeed_engine_steps_total"] - steps0
        generated = m["torchspeed_generated_tokens_total"] - before["torchspeed_generated_tokens_total"]
        what = "streamed" if stream else "non-streamed"
        print(f"cancellation ({what}): freed in {took * 1000:.0f} ms and {steps:.0f} engine steps, "
              f"{generated:.0f} of 1600 tokens generated", flush=True)
        if not freed or steps > 2:
            failures.append(f"{what} request left by its client: freed {freed}, after {steps:.0f} engine steps ({m})")
        if generated >= 1600:
            failures.append(f"{what} request left by its client: all {generated:.0f} tokens were generated")


def check_signals(args, failures):
    """A stop signal drains for --drain-timeout, then aborts (the stream gets an error event and
    its end); a second signal exits at once with status 130."""
    for second in (False, True):
        port = free_port()
        cmd = [args.torchspeed, "serve", "--checkpoint", args.model, "--port", str(port), "--weights", args.weights,
               "--drain-timeout", "2"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        old = CTX.port
        CTX.port = port
        try:
            wait_healthy(proc)
            s = connect()
            model = json.loads(http("GET", "/v1/models")[2])["data"][0]["id"]
            s.sendall(request_bytes("POST", "/v1/completions", {"model": model, "prompt": "Once", "max_tokens": 4000,
                                                                 "ignore_eos": True, "stream": True}))
            status, h, rest = read_head(s)
            time.sleep(0.5)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            if second:
                time.sleep(0.3)
                proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(15)
            except subprocess.TimeoutExpired:
                rc = None
            took = time.monotonic() - t0
            if second:
                print(f"second SIGTERM: exit {rc} {took:.2f} s after the first", flush=True)
                if rc != 130 or took > 2.0:
                    failures.append(f"a second SIGTERM: exit {rc} after {took:.1f} s (want 130 at once)")
            else:
                s.settimeout(5)
                try:
                    body = read_body(s, h, rest)
                except OSError as e:
                    body = repr(e).encode()
                print(f"SIGTERM with a stream of 4000 tokens running: exit {rc} {took:.2f} s later (drain deadline 2 s)", flush=True)
                if rc != 0 or took > 6.0:
                    failures.append(f"drain deadline 2 s: exit {rc} after {took:.1f} s")
                if b"aborted" not in body or not body.rstrip().endswith(b"data: [DONE]"):
                    failures.append(f"the aborted stream did not get its error event and end: {body[-300:]!r}")
            s.close()
        finally:
            CTX.port = old
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def check_engine_failure(args, failures):
    """A forward pass that throws (TORCHSPEED_INFERENCE_FAULT=step:5, the engine's test hook):
    the request in flight gets 503 naming the failure (not a hang, not 429), and the server exits
    1 so that a supervisor restarts it."""
    port = free_port()
    env = dict(os.environ, TORCHSPEED_INFERENCE_FAULT="step:5")
    cmd = [args.torchspeed, "serve", "--checkpoint", args.model, "--port", str(port), "--weights", args.weights]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=env)
    old = CTX.port
    CTX.port = port
    try:
        wait_healthy(proc)
        model = json.loads(http("GET", "/v1/models")[2])["data"][0]["id"]
        status, _, body = http("POST", "/v1/completions", {"model": model, "prompt": "Once", "max_tokens": 50, "ignore_eos": True},
                               timeout=30)
        try:
            rc = proc.wait(15)
        except subprocess.TimeoutExpired:
            rc = None
        err = proc.stderr.read().decode(errors="replace") if rc is not None else ""
        print(f"engine failure: HTTP {status} {body[:160]!r}; server exit {rc}", flush=True)
        if status != 503 or b"engine failed" not in body:
            failures.append(f"a request when the engine failed: HTTP {status} {body[:300]!r} (want 503 naming the failure)")
        if rc != 1 or "inference engine failed" not in err:
            failures.append(f"after the engine failed the server exited {rc} (want 1 with the failure on stderr): {err[-300:]!r}")
    finally:
        CTX.port = old
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torchspeed", required=True)
    ap.add_argument("--model", required=True, help="what serve --checkpoint takes")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--warmup", type=float, default=15)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    CTX.port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="torchspeed-soak-", suffix=".log", delete=False)
    cmd = [args.torchspeed, "serve", "--checkpoint", args.model, "--port", str(CTX.port), "--api-key", KEY,
           "--weights", args.weights, "--max-num-seqs", "8", "--max-queue", "32",
           "--max-connections", "512", "--drain-timeout", "10"]
    print("server: " + " ".join(cmd) + f"\nserver log: {log.name}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ok = False
    try:
        if not wait_healthy(proc):
            print("FAIL the server did not become healthy (exited or 60 s passed)", flush=True)
            return 1
        status, _, body = http("GET", "/v1/models")
        CTX.model = json.loads(body)["data"][0]["id"]

        failures = []
        check_cancellation(failures)
        st0, _, _ = run_round(args.warmup, args.clients)
        idle0, _ = wait_idle(60)
        plateau = settled_figures(proc.pid, seconds=1.0)
        print(f"plateau after {args.warmup:.0f} s warm-up: {plateau} (idle: {idle0}); warm-up counts {st0.counts}", flush=True)

        t0 = time.monotonic()
        st, lat, bad_health = run_round(args.seconds, args.clients)
        wall = time.monotonic() - t0
        idle, m = wait_idle(60)
        after = settled_figures(proc.pid, than=plateau["fds"])
        alive = proc.poll() is None

        failures += st.failures
        if not alive:
            failures.append(f"the server died (exit {proc.returncode})")
        if not idle:
            failures.append(f"not idle 60 s after the load: running {m.get('torchspeed_requests_running')}, "
                            f"waiting {m.get('torchspeed_requests_waiting')}, blocks {m.get('torchspeed_kv_blocks_used')}")
        leaked_blocks = int(m.get("torchspeed_kv_blocks_used", -1))
        leaked_fds = after["fds"] - plateau["fds"]
        leaked_threads = after["threads"] - plateau["threads"]
        if leaked_blocks != 0:
            failures.append(f"{leaked_blocks} KV blocks still held")
        if leaked_fds > 0:
            fds = []
            for fd in sorted(os.listdir(f"/proc/{proc.pid}/fd"), key=int):
                try:
                    fds.append(f"{fd}:{os.readlink(f'/proc/{proc.pid}/fd/{fd}')}")
                except OSError:
                    pass
            failures.append(f"{leaked_fds} more file descriptors than at the plateau ({plateau['fds']}); "
                            f"open now: {' '.join(fds)}")
        if leaked_threads > 0:
            failures.append(f"{leaked_threads} more threads than at the plateau")
        if after["rss"] > plateau["rss"] * 1.15 + (32 << 20):
            failures.append(f"RSS {after['rss'] >> 20} MiB after, {plateau['rss'] >> 20} MiB at the plateau")
        p99 = pct(lat, 0.99)
        if bad_health:
            failures.append(f"/health failed {len(bad_health)} times: {bad_health[:5]}")
        if not lat or p99 > 0.1:
            failures.append(f"/health p99 {p99 * 1000:.1f} ms (over 100 ms) in {len(lat)} polls")
        served = st.counts.get("served", 0)
        if served == 0:
            failures.append("no request was served")
        rejected = {k: v for k, v in st.counts.items() if k.startswith("rejected_") or k.startswith("refused_")}
        fig = {"clients": args.clients, "seconds": round(wall, 1), "served": served, "rejected": rejected,
               "cancelled_streams": st.counts.get("streams_cancelled", 0), "abandoned": st.counts.get("abandoned", 0),
               "slow_readers": st.counts.get("slow_readers", 0), "trickled": st.counts.get("trickled", 0),
               "health_polls": len(lat), "health_p50_ms": round(pct(lat, 0.5) * 1000, 2),
               "health_p99_ms": round(p99 * 1000, 2), "leaked_blocks": leaked_blocks, "leaked_fds": leaked_fds,
               "leaked_threads": leaked_threads, "rss_plateau_mib": plateau["rss"] >> 20, "rss_after_mib": after["rss"] >> 20,
               "peak_rss_mib": after["peak_rss"] >> 20, "http_clients_gone": m.get("torchspeed_http_clients_gone_total"),
               "http_timeouts": m.get("torchspeed_http_timeouts_total"), "http_limit_errors": m.get("torchspeed_http_limit_errors_total"),
               "failures": len(failures)}
        # A draining stop: exit status 0 within the drain deadline.
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(30)
                if rc != 0:
                    failures.append(f"the server exited {rc} after SIGTERM")
            except subprocess.TimeoutExpired:
                failures.append("the server did not stop within 30 s of SIGTERM")
        check_signals(args, failures)
        check_engine_failure(args, failures)
        fig["failures"] = len(failures)
        print("soak: " + json.dumps(fig), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(fig, f, indent=1)
        for f in failures[:30]:
            print(f"FAIL {f}", flush=True)
        ok = not failures
        return 0 if ok else 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if not ok:
            with open(log.name, "rb") as f:
                tail = f.read()[-3000:].decode(errors="replace")
            print("--- server log tail ---\n" + tail, flush=True)


if __name__ == "__main__":
    sys.exit(main())
