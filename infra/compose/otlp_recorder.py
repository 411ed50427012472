"""A minimal OTLP/gRPC trace receiver that records spans, for the compose smoke test (where the
OpenTelemetry Collector and Jaeger images cannot be pulled). Runs from the pdserve image, which
has grpcio and the OTLP protobuf messages (they come with the OTLP exporter).

- gRPC ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` on ``--otlp-port`` (4317);
- HTTP ``GET /spans`` on ``--http-port`` (4319): ``{"spans": [{"trace_id", "service", "name"}]}``,
  the most recent ``--max-spans`` spans; ``GET /health`` answers 200.

Not a collector: nothing is forwarded or kept on disk.
"""

from __future__ import annotations

import argparse
import collections
import json
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Recorder(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, max_spans: int) -> None:
        self.spans: collections.deque[dict[str, str]] = collections.deque(maxlen=max_spans)
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method name
        rows = []
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    rows.append({"trace_id": span.trace_id.hex(), "service": service,
                                 "name": span.name})
        with self.lock:
            self.spans.extend(rows)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[dict[str, str]]:
        with self.lock:
            return list(self.spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--otlp-port", type=int, default=4317)
    parser.add_argument("--http-port", type=int, default=4319)
    parser.add_argument("--max-spans", type=int, default=200_000)
    args = parser.parse_args()
    recorder = Recorder(args.max_spans)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(recorder, server)
    server.add_insecure_port(f"0.0.0.0:{args.otlp_port}")
    server.start()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = (json.dumps({"spans": recorder.snapshot()}) if self.path == "/spans"
                    else "ok").encode()
            self.send_response(200 if self.path in ("/spans", "/health") else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    print(f"otlp-recorder grpc 0.0.0.0:{args.otlp_port} http 0.0.0.0:{args.http_port}",
          flush=True)
    ThreadingHTTPServer(("0.0.0.0", args.http_port), Handler).serve_forever()


if __name__ == "__main__":
    main()
