"""The prefill node's start-up memory decision (backends/prefill/memory.py) with fake readings: vLLM's ask against
what the GPU reports free, the page cache dropped where allowed, a smaller start where allowed, else a wait that
never exits (a restart under `--restart unless-stopped` would find the same and loop)."""

from __future__ import annotations

import asyncio
import logging

from backends.prefill import memory
from backends.prefill.memory import Reading, plan

GB10 = 121.7  # what torch.cuda.mem_get_info reports as total on a GB10 (docs/deploy.md)


def test_it_starts_as_configured_when_the_ask_fits():
    p = plan(0.75, 1, Reading(110.0, GB10, 5.0))
    assert p.utilization == 0.75 and not p.dropped and "91.3 GiB, 110.0 GiB free: starting" in p.lines[0]


def test_after_a_crash_the_page_cache_is_dropped_where_allowed():
    """~61 GB of the crashed run's weights in the page cache: 50 GiB free; dropping it frees enough."""
    drops = []
    p = plan(0.75, 1, Reading(50.0, GB10, 61.0), drop=lambda: drops.append(1) or Reading(112.0, GB10, 0.5))
    assert p.utilization == 0.75 and p.dropped and drops == [1]
    assert "only 50.0 GiB free (61.0 GiB of the host's memory is page cache)" in p.lines[0]
    assert "dropped the page cache" in p.lines[1] and "112.0 GiB free now" in p.lines[1]


def test_starts_smaller_and_says_so_where_allowed():
    p = plan(0.75, 1, Reading(80.0, GB10, 30.0), min_util=0.6)
    assert p.utilization == 0.65  # floor(80 / 121.7 * 100) / 100
    assert "starting SMALLER: gpu_memory_utilization 0.65 instead of 0.75" in p.lines[-1]


def test_two_engines_share_what_is_free():
    p = plan(0.4, 2, Reading(80.0, GB10), min_util=0.3)
    assert "x 2 engines = 97.4 GiB" in p.lines[0] and p.utilization == 0.32


def test_nothing_allowed_means_wait_and_say_how_to_allow_it():
    p = plan(0.75, 1, Reading(50.0, GB10, 61.0))
    assert p.utilization is None and not p.dropped
    assert "waiting for memory instead of exiting" in p.lines[-1]
    assert "drop_page_cache = true" in p.lines[-1] and "--privileged" in p.lines[-1]
    p = plan(0.75, 1, Reading(50.0, GB10, 61.0), min_util=0.5)  # 0.41 fits: under the floor
    assert p.utilization is None and "0.41 would fit, under [prefill] min_gpu_memory_utilization 0.5" in p.lines[-1]


def test_who_may_drop_the_page_cache(tmp_path):
    knob = tmp_path / "drop_caches"
    knob.write_text("0\n")
    assert memory.drop_allowed(False, 0, knob) == (False, "[prefill] drop_page_cache is false")
    assert memory.drop_allowed(True, 1000, knob)[1] == "the node runs as uid 1000, not root"
    assert memory.drop_allowed(True, 0, tmp_path / "missing")[0] is False
    assert memory.drop_allowed(True, 0, knob)[0] is True
    memory.drop_page_cache(knob)
    assert knob.read_text() == "1\n"


def test_page_cache_is_cached_less_shmem(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal: 131072000 kB\nCached: 65011712 kB\nShmem: 2097152 kB\n")
    assert memory.page_cache_gib(f) == 60.0


def test_the_start_waits_until_memory_frees_and_never_exits(caplog):
    """Readings: short twice (logged once), then enough: it returns the configured utilization, having slept."""
    readings = iter([Reading(50.0, GB10, 61.0), Reading(50.0, GB10, 61.0), Reading(100.0, GB10, 2.0)])
    caplog.set_level(logging.INFO, logger="backends.prefill.memory")
    util = asyncio.run(memory.utilization_to_start(0.75, 1, False, None, read=lambda: next(readings), poll_s=0,
                                                   allowed=memory.drop_allowed))
    assert util == 0.75
    text = caplog.text
    assert text.count("only 50.0 GiB free") == 1 and "page cache not dropped: [prefill] drop_page_cache is false" in text
    assert "100.0 GiB free: starting" in text


def test_the_start_drops_the_cache_when_allowed():
    state = {"free": 50.0}

    def drop():
        state["free"] = 110.0

    util = asyncio.run(memory.utilization_to_start(
        0.75, 1, True, None, read=lambda: Reading(state["free"], GB10, 61.0), poll_s=0, drop=drop,
        allowed=lambda enabled: (enabled, "root")))
    assert util == 0.75 and state["free"] == 110.0


def test_without_cuda_nothing_is_checked():
    assert asyncio.run(memory.utilization_to_start(0.3, 1, False, None, read=lambda: None)) == 0.3
