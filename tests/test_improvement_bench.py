"""The headline bench's bookkeeping: its options' preset, wall time summed over a resumed
run's parts, and the ablations' reading of routers and routing decisions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from improvement import BENCH_PRESETS, Clock, arguments, bench_preset, mixture_ratio_step  # noqa: E402
from improvement_ablations import dominant, rename_adapters, top1  # noqa: E402


def test_bench_seconds_add_up_over_a_killed_run_and_its_resumption(tmp_path, monkeypatch):
    now = iter([0.0, 30.0, 50.0, 100.0, 110.0])
    monkeypatch.setattr("improvement.time.monotonic", lambda: next(now))
    first = Clock(tmp_path / "seconds.json")  # started at 0
    first.tick()  # 30 s into a stage
    first.tick()  # 50 s: then the run was killed
    resumed = Clock(tmp_path / "seconds.json")  # restarted at 100
    assert resumed.tick() == 60.0  # 50 s before the kill and 10 since
    assert json.loads((tmp_path / "seconds.json").read_text()) == {"seconds": 60.0}


def test_ablation_routers_rename_their_adapters_and_keep_one_expert_per_request():
    router = {
        "kind": "classifier",
        "experts": [
            {"capability": "lookup", "adapter": "lookup"},
            {"capability": "writes", "adapter": "writes"},
        ],
        "retrieval": {"corpus": [{"adapter": "lookup", "text": "where is"}], "k": 4, "top_p": 0.9},
    }
    renamed = rename_adapters(router, {"lookup@2": "nowarm_lookup@1", "writes@1": "nowarm_writes@1"})
    assert [e["adapter"] for e in renamed["experts"]] == ["nowarm_lookup", "nowarm_writes"]
    assert renamed["retrieval"]["corpus"][0]["adapter"] == "nowarm_lookup"
    assert [e["capability"] for e in renamed["experts"]] == ["lookup", "writes"]  # labels stay
    assert top1(router)["retrieval"]["top_p"] < 0.5 and router["retrieval"]["top_p"] == 0.9


def test_a_mixture_decision_counts_as_its_largest_share():
    assert dominant("lookup:0.7,writes:0.3") == "lookup"
    assert dominant("") == ""  # the base model
    assert dominant("lookup:0.6,writes:0.4;layers=0123456789ab") == "lookup"
    assert dominant("writes") == "writes"


def test_experts_are_spread_over_the_cycles_so_a_later_cycle_still_teaches():
    default = BENCH_PRESETS["default"]
    assert bench_preset(arguments("headline", [])) == default
    assert (default.max_experts, default.max_capabilities, default.cycles) == (1, 2, 2)  # one a cycle
    two = bench_preset(arguments("headline", ["--experts", "2"]))
    assert two == default
    three = bench_preset(arguments("headline", ["--experts", "3", "--cycles", "2", "--tasks", "12"]))
    assert (three.max_experts, three.max_capabilities, three.test_tasks) == (2, 3, 12)
    assert three.rollouts == default.rollouts  # nothing else changes


class _Played:
    """A bench's evaluations as the mixture figure reads them: each key played once, its
    wall time kept, and which keys were played here rather than read back."""

    def __init__(self, kept: dict[str, float]) -> None:
        self.seconds: dict[str, float] = {}
        self.kept, self.played = kept, []

    def evaluated(self, key, model):
        if key not in self.kept:
            model()
            self.played.append(key)
            self.kept[key] = 60.0
        self.seconds[key] = self.kept[key]
        return [1.0]

    def serve(self, router, name, adapters):
        return f"router:{name}"


def test_the_mixture_figure_reads_the_plays_the_cycles_kept_instead_of_playing_them_again():
    from types import SimpleNamespace

    last = SimpleNamespace(id="c2", router={"kind": "classifier"}, adapters={"a": "a@1", "b": "b@1"})
    experts = {"a": SimpleNamespace(capability="a", adapter_name="a@1")}
    cycles = [
        # Made live with one expert: the live agent's play is one expert alone.
        {"deployment": "c1", "candidate_key": "live-c1", "live_key": "live-c1", "live_alone": True},
        # Rejected: the composition was played as the cycle's candidate.
        {"deployment": "c2", "candidate_key": "candidate-2", "live_key": "live-c1", "live_alone": True},
    ]
    bench = _Played({"live-c1": 60.0, "candidate-2": 90.0})
    assert mixture_ratio_step(bench, last, experts, cycles) == 1.5  # 90 s through it ÷ 60 alone
    assert bench.played == []  # neither was played again
    # A folder whose cycles kept no such keys plays both.
    older = _Played({})
    mixture_ratio_step(older, last, experts, [{"deployment": "c2"}])
    assert older.played == ["expert-a", "mixture"]
