"""The OpenAI-compatible HTTP server behind `launch.serve` (FastAPI + uvicorn)."""
