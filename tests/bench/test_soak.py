"""The soak benchmark's short version: a minute of clients that send, cancel and
disconnect at random; every request ends exactly once and the daemon neither dies nor
grows beyond its bounded caches."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import soak  # noqa: E402


def test_a_minute_of_random_clients():
    out = soak.main(["--clients", "4", "--minutes", "0.75", "--seed", "3", "--json"])
    assert out["daemon_alive"] and out["lost"] == 0 and out["duplicated"] == 0
    assert out["completed"] > 20 and out["cancelled"] > 0 and out["disconnected"] > 0
    assert out["daemon_ended"] == out["daemon_accepted"]  # every accepted request ended once in the daemon too
    assert 0 <= out["never_arrived"] <= out["disconnected"]  # only a disconnect can lose a request in flight
    assert 0 < out["kv_cache_mib"] <= out["kv_budget_mib"]  # the prefix cache filled, within its budget
    # beyond what the prefix cache holds (the faster the box, the more prompts fill it)
    assert out["rss_end_mib"] - out["rss_start_mib"] - out["kv_cache_mib"] < 200
