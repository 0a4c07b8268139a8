"""An OpenAI-compatible HTTP server over the batching Scheduler (`tinyinfer serve`; needs the `serve` extra:
fastapi + uvicorn). app.py: the FastAPI app factory; protocol.py: the wire format; main.py: the command."""
