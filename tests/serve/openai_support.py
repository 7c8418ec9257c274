"""What test_openai_client.py's checks share: the server's settings, raw HTTP and SSE helpers, the
/metrics parser, the openai client context (CTX) and the server process's start and stop. Every
network call has a timeout and every loop is bounded."""

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


HOST = "127.0.0.1"
API_KEY = "test-key"
HTTP_TIMEOUT = 30.0  # seconds, every HTTP call
STARTUP_TIMEOUT = 120.0  # seconds for /health to turn 200
SHUTDOWN_TIMEOUT = 20.0  # seconds after SIGTERM before SIGKILL
MAX_QUEUE = 4
MAX_NUM_SEQS = 4



class CheckFailed(AssertionError):
    pass


def check(cond, msg):
    if not cond:
        raise CheckFailed(msg)


# ---------------------------------------------------------------------------------------------
# Raw HTTP (http.client: no proxies, exact status codes and headers)


class Resp:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers  # lower-cased name -> value
        self.body = body  # bytes

    def text(self):
        return self.body.decode("utf-8", errors="replace")

    def json(self):
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise CheckFailed(f"HTTP {self.status}: body is not JSON ({e}): {self.body[:300]!r}")

    def __repr__(self):
        return f"HTTP {self.status} {self.body[:300]!r}"


class RawStream:
    """A raw streaming (SSE) request; read events with events(), end with close() or abort()."""

    def __init__(self, port, method, path, body, headers):
        self.conn = http.client.HTTPConnection(HOST, port, timeout=HTTP_TIMEOUT)
        self.conn.connect()
        self.sock = self.conn.sock  # kept: http.client drops conn.sock for Connection: close
        self.method, self.path, self.body, self.headers = method, path, body, headers
        self.resp = None
        self.status = None
        self.resp_headers = {}

    def send(self):
        self.conn.request(self.method, self.path, body=self.body, headers=self.headers)
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.resp_headers = {k.lower(): v for k, v in self.resp.getheaders()}
        return self

    def read_body(self):
        return self.resp.read()

    def events(self, max_events=100000):
        """Yields the data of each server-sent event (str), ending at EOF."""
        data_lines = []
        for _ in range(max_events * 8):  # bounded: a few lines per event at most
            line = self.resp.readline(1 << 20)
            if not line:
                if data_lines:
                    yield "\n".join(data_lines)
                return
            line = line.rstrip(b"\r\n")
            if not line:
                if data_lines:
                    yield "\n".join(data_lines)
                    data_lines = []
                continue
            if line.startswith(b":"):
                continue  # SSE comment / keep-alive
            field, _, value = line.partition(b":")
            if value.startswith(b" "):
                value = value[1:]
            if field == b"data":
                data_lines.append(value.decode("utf-8"))
        raise CheckFailed("stream did not end within the event bound")

    def close(self):
        for f in (lambda: self.resp and self.resp.close(), self.conn.close, self.sock.close):
            try:
                f()
            except OSError:
                pass

    def abort(self):
        """Closes the socket abruptly (RST, no FIN handshake)."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.close()

    def interrupt(self):
        """Unblocks a thread blocked reading this stream (from another thread)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _encode(body):
    if body is None:
        return None
    if isinstance(body, (bytes, bytearray)):
        return bytes(body)
    if isinstance(body, str):
        return body.encode("utf-8")
    return json.dumps(body).encode("utf-8")


def _headers(body, headers, auth):
    h = {}
    if body is not None:
        h["Content-Type"] = "application/json"
    if auth:
        h["Authorization"] = f"Bearer {API_KEY}"
    h.update(headers or {})
    return {k: v for k, v in h.items() if v is not None}  # a None value removes a default


def raw_request(method, path, body=None, headers=None, stream=False, auth=True, port=None):
    """One HTTP request. Returns Resp, or with stream=True a sent RawStream (caller closes it).

    body: dict/list (sent as JSON), str or bytes (sent as is), or None."""
    port = port or CTX.port
    data = _encode(body)
    hdrs = _headers(data, headers, auth)
    if stream:
        st = RawStream(port, method, path, data, hdrs)
        try:
            return st.send()
        except BaseException:
            st.close()
            raise
    conn = http.client.HTTPConnection(HOST, port, timeout=HTTP_TIMEOUT)
    try:
        conn.request(method, path, body=data, headers=hdrs)
        r = conn.getresponse()
        return Resp(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


def expect_json(resp, status=200):
    check(resp.status == status, f"expected HTTP {status}, got {resp!r}")
    ctype = resp.headers.get("content-type", "")
    check(ctype.startswith("application/json"), f"Content-Type {ctype!r}, want application/json")
    return resp.json()


def expect_error(resp, status, params=None):
    """An OpenAI error body: {"error": {"message", "type", "param", "code"}}; params: allowed
    values of error.param (a str or a tuple), or None for any."""
    j = expect_json(resp, status)
    err = j.get("error") if isinstance(j, dict) else None
    check(isinstance(err, dict), f"no error object in {j!r}")
    for k in ("message", "type", "param", "code"):
        check(k in err, f"error object lacks {k!r}: {err!r}")
    check(isinstance(err["message"], str) and err["message"], f"empty error message: {err!r}")
    if params is not None:
        params = (params,) if isinstance(params, str) else tuple(params)
        check(err["param"] in params,
              f"error.param {err['param']!r}, want one of {params}: {err!r}")
    return err


def sse_json_chunks(st, max_events=100000):
    """Reads a whole SSE stream: returns (list of JSON chunks, saw_done, events after [DONE])."""
    chunks, done, after = [], False, 0
    for data in st.events(max_events):
        if done:
            after += 1
            continue
        if data.strip() == "[DONE]":
            done = True
            continue
        try:
            chunks.append(json.loads(data))
        except ValueError:
            raise CheckFailed(f"stream event is not JSON: {data[:200]!r}")
    return chunks, done, after


# ---------------------------------------------------------------------------------------------
# Metrics


def parse_metrics_samples(text):
    """Prometheus text -> list of (name, labels dict, value)."""
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        labels = {}
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            i, n = brace + 1, len(line)
            while i < n and line[i] != "}":  # key="value", with \" \\ \n escapes
                while i < n and line[i] in ", ":
                    i += 1
                if i < n and line[i] == "}":
                    break
                eq = line.find("=", i)
                check(eq != -1, f"bad metrics line {raw!r}")
                key = line[i:eq].strip()
                check(eq + 1 < n and line[eq + 1] == '"', f"bad metrics line {raw!r}")
                j, val = eq + 2, []
                while j < n and line[j] != '"':
                    if line[j] == "\\" and j + 1 < n:
                        val.append({"n": "\n"}.get(line[j + 1], line[j + 1]))
                        j += 2
                    else:
                        val.append(line[j])
                        j += 1
                labels[key] = "".join(val)
                i = j + 1
            rest = line[i + 1:].split()
        else:
            parts = line.split()
            name, rest = parts[0], parts[1:]
        check(rest, f"metrics line without a value: {raw!r}")
        try:
            value = float(rest[0])  # handles +Inf, -Inf, NaN
        except ValueError:
            raise CheckFailed(f"bad metrics value in {raw!r}")
        out.append((name, labels, value))
    return out


def parse_metrics(text):
    """Prometheus text -> {name: value summed over label sets}."""
    d = {}
    for name, _, value in parse_metrics_samples(text):
        d[name] = d.get(name, 0.0) + value
    return d


def get_metrics_text():
    r = raw_request("GET", "/metrics", auth=False)
    check(r.status == 200, f"/metrics: {r!r}")
    return r.text()


def get_metrics():
    return parse_metrics(get_metrics_text())


def metric(m, name):
    check(name in m, f"metric {name} missing from /metrics (have: {sorted(m)[:40]})")
    return m[name]


def wait_until(pred, timeout, interval=0.1):
    """Polls pred() (returning (ok, info)) until ok or timeout; returns (ok, last info)."""
    deadline = time.monotonic() + timeout
    ok, info = pred()
    while not ok and time.monotonic() < deadline:
        time.sleep(interval)
        ok, info = pred()
    return ok, info


def idle_state():
    m = get_metrics()
    running = metric(m, "torchspeed_requests_running")
    waiting = metric(m, "torchspeed_requests_waiting")
    used = metric(m, "torchspeed_kv_blocks_used")
    return (running == 0 and waiting == 0 and used == 0,
            f"running={running:g} waiting={waiting:g} kv_blocks_used={used:g}")


def wait_idle(timeout=30.0, what="server"):
    ok, info = wait_until(idle_state, timeout)
    check(ok, f"{what} not idle after {timeout:g} s: {info}")


# ---------------------------------------------------------------------------------------------
# Shared state and openai helpers


class Ctx:
    port = None
    base = None
    client = None
    model = None
    max_len = None
    proc = None


CTX = Ctx()


def tokens_for(prompt_len, want):
    """A max_tokens no larger than want that fits after a prompt of prompt_len tokens."""
    n = min(want, CTX.max_len - prompt_len)
    check(n >= 1, f"max_model_len {CTX.max_len} too small for a {prompt_len}-token prompt")
    return n


def complete(prompt, **kw):
    return CTX.client.completions.create(model=CTX.model, prompt=prompt, **kw)


def stream_complete(prompt, **kw):
    """Streams with the openai client: returns (text, finish_reason of each chunk)."""
    stream = CTX.client.completions.create(model=CTX.model, prompt=prompt, stream=True, **kw)
    parts, reasons = [], []
    try:
        for chunk in stream:
            check(chunk.choices, f"stream chunk without choices: {chunk!r}")
            for c in chunk.choices:
                check(c.index == 0, f"unexpected choice index {c.index} in a single-choice stream")
                check(isinstance(c.text, str), f"chunk text is not a str: {c!r}")
                parts.append(c.text)
                reasons.append(c.finish_reason)
    finally:
        close = getattr(stream, "close", None)
        if close:
            close()
    return "".join(parts), reasons


def check_stream_reasons(reasons, want=None):
    check(reasons, "stream had no chunks")
    check(reasons[-1] is not None, f"last chunk has no finish_reason: {reasons[-1:]}")
    check(all(r is None for r in reasons[:-1]),
          f"finish_reason set before the last chunk: {reasons}")
    if want is not None:
        check(reasons[-1] == want, f"stream finish_reason {reasons[-1]!r}, want {want!r}")


def completions_body(**kw):
    body = {"model": CTX.model}
    body.update(kw)
    return body


# ---------------------------------------------------------------------------------------------
# Server process


def free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((HOST, 0))
        return s.getsockname()[1]
    finally:
        s.close()


def _die_with_parent():
    """In the child: SIGTERM when the test process dies (e.g. killed by a CTest timeout)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort, Linux only
        pass


def start_server(args, port, log):
    cmd = [args.torchspeed, "serve", "--checkpoint", args.model_dir, "--host", HOST,
           "--port", str(port), "--api-key", API_KEY, "--max-queue", str(MAX_QUEUE),
           "--max-num-seqs", str(MAX_NUM_SEQS)]
    if args.tp > 1:
        cmd += ["-n", str(args.tp), "--tp", str(args.tp)]
    print("server: " + " ".join(cmd), flush=True)
    linux = sys.platform.startswith("linux")
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_die_with_parent if linux else None)


def wait_healthy(proc, port):
    deadline = time.monotonic() + STARTUP_TIMEOUT
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"server exited with status {proc.returncode} while starting"
        try:
            r = raw_request("GET", "/health", auth=False, port=port)
            if r.status == 200:
                return None
            check(r.status == 503, f"/health while loading: {r!r} (want 503 or 200)")
            last = f"HTTP {r.status}"
        except CheckFailed as e:
            return str(e)
        except (OSError, http.client.HTTPException) as e:
            last = repr(e)
        time.sleep(0.25)
    return f"/health not 200 after {STARTUP_TIMEOUT:g} s (last: {last})"


def live_group_members(pgid):
    """Pids of non-zombie processes in process group pgid (Linux /proc); [] if unknown."""
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
            pids.append(int(e))
    return pids


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def stop_server(proc):
    """SIGTERM, wait up to SHUTDOWN_TIMEOUT, else SIGKILL. Returns None or a failure reason."""
    if proc.poll() is not None:
        return f"server had already exited with status {proc.returncode}"
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=SHUTDOWN_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return f"server still running {SHUTDOWN_TIMEOUT:g} s after SIGTERM (killed)"
    def group_gone():
        left = live_group_members(proc.pid)
        return not left, left
    ok, left = wait_until(group_gone, 5.0)
    if not ok:
        kill_group(proc)
        return f"server exited ({rc}) but left processes {left} running (killed)"
    if rc != 0:
        return f"server exited with status {rc} after SIGTERM, want 0"
    return None


def log_tail(path, lines=80):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(data.splitlines()[-lines:])


def run_check(name, fn):
    if CTX.proc.poll() is not None:
        return f"server is not running (exited with status {CTX.proc.returncode})"
    try:
        fn()
        return None
    except CheckFailed as e:
        return str(e)
    except openai.APIStatusError as e:
        return f"unexpected HTTP {e.status_code} from the server: {e.message}"
    except Exception as e:  # noqa: BLE001 - every failure becomes a FAIL line
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at line {tb[-1].lineno}" if tb else ""
        return f"{type(e).__name__}: {e}{where}"


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt  # unwinds through main's finally, which stops the server
