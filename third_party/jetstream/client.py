"""A tiny JetStream client: send one chat prompt to a server started by `python -m lrl.serve`
and print the reply as it streams.

    python third_party/jetstream/client.py --address=127.0.0.1:9000 --prompt="What is 3+4?" \
        [--max_tokens=128]

Needs only grpcio and google-jetstream's generated protocol modules (no jax, no compat layer:
`jetstream.core.proto` imports nothing else of JetStream).
"""
from __future__ import annotations

import argparse
import sys
from typing import Iterator

import grpc
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc


def stream(address: str, prompt: str, max_tokens: int, timeout: float = 600.0) -> Iterator[str]:
    """Yields the reply's text pieces as the server sends them."""
    with grpc.insecure_channel(address) as channel:
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        request = jetstream_pb2.DecodeRequest(
            text_content=jetstream_pb2.DecodeRequest.TextContent(text=prompt),
            max_tokens=max_tokens)
        for response in stub.Decode(request, timeout=timeout):
            for sample in response.stream_content.samples:   # one sample per request
                if sample.text:
                    yield sample.text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", default="127.0.0.1:9000", help="HOST:PORT of the server")
    ap.add_argument("--prompt", required=True, help="the user message")
    ap.add_argument("--max_tokens", type=int, default=128, help="most tokens of the reply")
    args = ap.parse_args(argv)
    try:
        for piece in stream(args.address, args.prompt, args.max_tokens):
            print(piece, end="", flush=True)
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
