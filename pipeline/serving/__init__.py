"""Serving with vLLM: server lifecycle (`server`), benchmark client (`client`)."""
