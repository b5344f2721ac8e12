"""OpenAI's client APIs."""
