"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over the chat path (gateway.api.chat_job)."""
