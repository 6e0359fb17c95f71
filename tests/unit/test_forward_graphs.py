"""`ForwardGraphs`: told when the last forward graph that awaits a backward is freed, only
where releasing is safe ([Note: kept for the backward's head] in zerodp.stage3.forward_graphs).

The graphs here are plain autograd graphs; the engine's cases (what is gathered, the bytes)
are in tests/distributed/test_backward_head.py.
"""

from __future__ import annotations

import gc
import threading

import torch

from zerodp.stage3.forward_graphs import ForwardGraphs, graph_nodes


def _output() -> torch.Tensor:
    weight = torch.randn(3, requires_grad=True)
    return (weight * 2).tanh()


def _watched() -> tuple[ForwardGraphs, list[int]]:
    calls: list[int] = []
    return ForwardGraphs(lambda: calls.append(1)), calls


def test_freed_graph_is_reported_where_it_is_dropped() -> None:
    graphs, calls = _watched()
    out = _output()
    graphs.add(graph_nodes([out]))
    loss = out.sum()
    del out
    assert calls == [] and graphs.any_waiting  # the loss still holds the graph
    del loss
    assert calls == [1] and not graphs.any_waiting


def test_nothing_is_reported_while_another_graph_awaits_a_backward() -> None:
    graphs, calls = _watched()
    first, second = _output(), _output()
    graphs.add(graph_nodes([first]))
    graphs.add(graph_nodes([second]))
    del second
    assert calls == []
    del first
    assert calls == [1]


def test_a_started_backward_takes_the_graphs_over() -> None:
    graphs, calls = _watched()
    spent, awaiting = _output(), _output()
    graphs.add(graph_nodes([spent]))
    spent.sum().backward(retain_graph=True)
    graphs.backward_started()  # what the engine's prologue says
    graphs.add(graph_nodes([awaiting]))
    del awaiting
    assert calls == [1]  # the spent graph, still alive, does not hold anything back
    del spent
    assert calls == [1, 1]


def test_a_graph_freed_by_the_collector_or_another_thread_reports_nothing() -> None:
    graphs, calls = _watched()
    cycle: list[object] = [_output()]
    cycle.append(cycle)  # freed only by a collection
    graphs.add(graph_nodes([cycle[0]]))  # type: ignore[list-item]
    del cycle
    assert calls == []
    gc.collect()
    assert calls == [] and not graphs.any_waiting
    box = [_output()]
    graphs.add(graph_nodes(box))
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    assert calls == [] and not graphs.any_waiting


def test_nothing_is_reported_after_close() -> None:
    graphs, calls = _watched()
    out = _output()
    graphs.add(graph_nodes([out]))
    graphs.close()
    del out
    assert calls == []


def test_outputs_without_a_graph_have_no_nodes() -> None:
    leaf = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        detached = leaf * 2
    assert graph_nodes([leaf, detached]) == []
