"""A stand-in for llama.cpp's llama-server in tests of `pdserve bench peer`:
takes its options (-m -t -np -c --host --port), answers /health, and streams
/v1/completions as server-sent events, one token an event, then usage."""

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STEP_S = 0.003


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = b'{"status":"ok"}' if self.path == "/health" else b"{}"
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert isinstance(req["prompt"], list) and req["stream"] and req["ignore_eos"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"text": "x", "finish_reason": None}]}
                  for _ in range(req["max_tokens"])]
        events.append({"choices": [], "usage": {"completion_tokens": req["max_tokens"]}})
        for e in events:
            time.sleep(STEP_S)      # the model's step: tokens arrive apart, as a real server's
            data = f"data: {json.dumps(e)}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


def main(argv):
    p = argparse.ArgumentParser()
    for flag in ("-m", "-t", "-np", "-c", "--host", "--port"):
        p.add_argument(flag, required=True)
    args = p.parse_args(argv)
    ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
