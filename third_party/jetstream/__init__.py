"""lrl's paged rollout engine behind JetStream's Engine API, and a gRPC server over it.

    compat.py     patches that let google-jetstream 0.2.2 run on jax 0.10 / 0.11 without seqio
    engine.py     `LrlEngine`: jetstream.engine.engine_api.Engine over lrl.rollout.engine.Engine
    tokenizer.py  a Hugging Face tokenizer as jetstream.engine.tokenizer_api.Tokenizer
    server.py     the orchestrator (JetStream's Driver) and its gRPC server on one host
    serve.py      `python -m lrl.serve --checkpoint=DIR`: load a policy and serve it
    client.py     a tiny client: send a chat prompt, print the streamed reply
    chat.py       multi-turn chat with tools: the history as token ids, tools run locally

Import `compat` and call `compat.install()` before anything imports jetstream; the modules
here do so themselves.
"""
