"""The prefill node: an aiohttp service (node) around vLLM's AsyncLLM with our KV connector (kv_bridge/vllm/). May
import backends' root and kv_bridge; never decode/, cli/, site/ or grading/."""
