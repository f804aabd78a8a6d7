"""Serving: OpenAI's HTTP API (`app`) and its batch files (`batch`) over one `frontends.serving.Engine`.

`protocol` checks OpenAI request bodies and writes responses from the engine's tokens.  FastAPI and
uvicorn come with the `serve` extra.
"""
