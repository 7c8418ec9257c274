#!/usr/bin/env python3
"""The chat page `torchspeed serve` answers GET / with, driven in headless Chromium: it loads,
finds the model, sends a question given in the URL, streams the answer into the page, and then
takes a second question typed into its box (the conversation goes on). Chromium is driven over
the DevTools protocol (a minimal WebSocket client below: the standard library has none); a
screenshot of the page is written beside the test and named in its log.

    chat_page.py --torchspeed build/bin/torchspeed --model SmolLM2.gguf [--expect Paris]
"""
import argparse
import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class DevTools:
    """Just enough WebSocket (RFC 6455: client frames masked, text only) for DevTools commands."""

    def __init__(self, url):
        u = urllib.parse.urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise OSError("DevTools closed the connection during the handshake")
            head += chunk
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise OSError(f"DevTools handshake: {head[:200]!r}")
        self.buf = head.split(b"\r\n\r\n", 1)[1]
        self.next_id = 0

    def _read(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise OSError("DevTools closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _recv(self):
        data = b""
        while True:
            b0, b1 = self._read(2)
            n = b1 & 127
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            payload = self._read(n)
            data += payload
            if b0 & 0x80:
                return data

    def call(self, method, **params):
        self.next_id += 1
        msg = json.dumps({"id": self.next_id, "method": method, "params": params}).encode()
        mask = os.urandom(4)
        header = bytes([0x81])
        if len(msg) < 126:
            header += bytes([0x80 | len(msg)])
        elif len(msg) < 65536:
            header += bytes([0x80 | 126]) + struct.pack(">H", len(msg))
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", len(msg))
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(msg)))
        while True:
            reply = json.loads(self._recv())
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def eval(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True)
        return r["result"].get("value")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torchspeed", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--question", default="What is the capital of France?")
    ap.add_argument("--expect", default="Paris", help="a word the greedy answer must contain")
    ap.add_argument("--screenshot", default="chat_page.png")
    args = ap.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        print("FAIL chromium is not installed (scripts/setup installs it)", flush=True)
        return 1
    port, dport = free_port(), free_port()
    log = tempfile.NamedTemporaryFile(prefix="torchspeed-chat-page-", suffix=".log", delete=False)
    # fp32 weights: the greedy answer is transformers' (tests/hf/smollm2.sh checks that), whatever the CPU.
    server = subprocess.Popen([args.torchspeed, "serve", "--checkpoint", args.model, "--weights", "fp32", "--host", "127.0.0.1",
                               "--port", str(port), "--api-key", "page-key"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    profile = tempfile.mkdtemp(prefix="torchspeed-chromium-")
    chrome = None
    failures = []
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None:
                print(f"FAIL the server exited; log {log.name}", flush=True)
                return 1
            time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/") as r:
            page = r.read().decode()
            if r.status != 200 or "text/html" not in r.headers.get("Content-Type", "") or "<title>torchspeed chat" not in page:
                failures.append(f"GET / answered {r.status} {r.headers.get('Content-Type')}")
        q = urllib.parse.urlencode({"q": args.question, "key": "page-key", "temperature": 0, "max_tokens": 48})
        chrome = subprocess.Popen([browser, "--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                                   f"--remote-debugging-port={dport}", "--window-size=900,700", "--no-first-run",
                                   f"http://127.0.0.1:{port}/?{q}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        ws = None
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{dport}/json/list", timeout=2) as r:
                    pages = [t for t in json.load(r) if t.get("type") == "page" and str(port) in t.get("url", "")]
                if pages:
                    ws = pages[0]["webSocketDebuggerUrl"]
                    break
            except OSError:
                pass
            time.sleep(0.1)
        if not ws:
            print("FAIL chromium's DevTools did not list the page", flush=True)
            return 1
        dt = DevTools(ws)

        def answers(timeout=120):
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                got = dt.eval("JSON.stringify([...document.querySelectorAll('.msg')].map(d => [d.className, d.textContent, !!d.dataset.done]))")
                msgs = json.loads(got or "[]")
                if msgs and msgs[-1][0] != "msg assistant" or (msgs and msgs[-1][2]):
                    return msgs
                time.sleep(0.2)
            return msgs

        msgs = answers()
        print(f"chat page, first turn: {msgs}", flush=True)
        if len(msgs) != 2 or msgs[0] != ["msg user", args.question, False] or msgs[1][0] != "msg assistant" or not msgs[1][2]:
            failures.append(f"first turn: {msgs}")
        elif args.expect and args.expect not in msgs[1][1]:
            failures.append(f"the answer {msgs[1][1]!r} does not contain {args.expect!r}")
        status = dt.eval("document.getElementById('status').textContent")
        model = dt.eval("document.getElementById('model').textContent")
        print(f"status line: {status!r}; model: {model!r}", flush=True)
        if "tok/s" not in (status or "") or "context" not in (model or ""):
            failures.append(f"status {status!r}, model {model!r}")
        # A second question typed into the box and sent with Enter: the conversation goes on.
        dt.eval("const i = document.getElementById('input'); i.value = 'And of Germany?';"
                "i.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', bubbles: true}))")
        msgs = answers()
        print(f"chat page, second turn: {msgs[2:]}", flush=True)
        if len(msgs) != 4 or msgs[2][1] != "And of Germany?" or not msgs[3][2] or not msgs[3][1].strip():
            failures.append(f"second turn: {msgs}")
        shot = dt.call("Page.captureScreenshot", format="png")
        with open(args.screenshot, "wb") as f:
            f.write(base64.b64decode(shot["data"]))
        print(f"screenshot: {os.path.abspath(args.screenshot)}", flush=True)
    finally:
        for p in (chrome, server):
            if p and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(profile, ignore_errors=True)
    for f in failures:
        print(f"FAIL {f}", flush=True)
    if failures:
        print(f"server log: {log.name}", flush=True)
        return 1
    os.unlink(log.name)
    print("chat page: both turns answered", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
