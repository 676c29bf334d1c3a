"""The graph files of the rematerialization literature (../shared/data/remat-graphs): loaded as
`solvers.Problem`s, and solved exactly where the graph is narrow."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from solvers import Status, peak_bytes, solve
from solvers.graphs import load_graph
from solvers.structure import Structure

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = ROOT.parent / "shared" / "data" / "remat-graphs"

needs_graphs = pytest.mark.skipif(not GRAPHS.is_dir(), reason=f"{GRAPHS} is not there")
EXPECTED_NODES = {
    "VGG16_256_224_224_3_train.json": 22,
    "MobileNet_512_224_224_3_train.json": 92,
    "ResNet50_256_224_224_3_train.json": 176,
    "random_layered_n100_w0.27_nlv0.75_ed0.2_scd0.14.json": 100,
    "random_layered_n250_w0.43_nlv0.75_ed0.2_scd0.14.json": 250,
    "random_layered_n500_w0.36_nlv0.75_ed0.2_scd0.14.json": 500,
    "random_layered_n1000_w0.31_nlv0.75_ed0.2_scd0.14.json": 1000,
}


@needs_graphs
@pytest.mark.parametrize("name", sorted(EXPECTED_NODES))
def test_load_graph(name: str):
    problem = load_graph(GRAPHS / name)
    assert len(problem) == EXPECTED_NODES[name]
    assert all(owner < i for i, n in enumerate(problem.nodes) for owner in n.uses)  # topological
    assert all(n.saves in ((), (i,)) for i, n in enumerate(problem.nodes))
    assert problem.nodes[-1].is_output and sum(n.saves == (i,) for i, n in enumerate(problem.nodes)) > len(problem) // 2
    assert all(n.grad_bytes == n.output_bytes >= 0 and n.compute_ms >= 0 for n in problem.nodes)
    assert Structure.of(problem).saves_only_what_it_reads


@needs_graphs
def test_checkmate_graph_fields():
    problem = load_graph(GRAPHS / "VGG16_256_224_224_3_train.json")
    first = problem.nodes[0]
    assert (first.name, first.compute_ms, first.output_bytes) == ("block1_conv1", 385.0, 3288334336)
    assert problem.nodes[1].uses == (0,)
    # Narrow graph: dp is exact and agrees with ilp.
    budget = int(0.7 * peak_bytes(problem))
    dp = solve(problem, budget, method="dp")
    ilp = solve(problem, budget, method="ilp", time_limit_s=30)
    assert dp.status == ilp.status == Status.OPTIMAL
    assert math.isclose(dp.recompute_ms, ilp.recompute_ms)
    assert dp.recompute_ms <= solve(problem, int(0.9 * peak_bytes(problem)), method="sqrt").recompute_ms


def test_load_graph_rejects_other_json(tmp_path):
    path = tmp_path / "graph.json"
    path.write_text('{"nodes": [{"id": 0, "weight": 3}], "links": []}')
    with pytest.raises(ValueError, match="unknown node fields"):
        load_graph(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="node-link"):
        load_graph(path)
