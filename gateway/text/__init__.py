"""Model text on the gateway: chat templating and tokenization, and the split of generated text into reasoning,
content and tool calls (per model family). Shared by every client API."""
