"""A pipeline's stage graph, laid out in columns for an SVG drawing: inputs -> stages -> outputs.

Each stage sits one column right of the furthest stage it takes input from, so the wiring always
flows left to right; outputs take the last column. Edges carry the port names (``ar.text ->
prompt``) and the modality handed over, as the spec declares them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from omni_jobs.pipelines.spec import INPUT_SOURCE, PipelineSpec

NODE_W = 200
STAGE_H = 104
PORT_H = 44
COL_GAP = 150
LANE_GAP = 20
"""Edges that skip a column run in lanes below the nodes, so they never pass under a stage."""
ROW_GAP = 22
MARGIN = 16

NodeKind = Literal["input", "stage", "output"]


@dataclass
class Node:
    id: str
    kind: NodeKind
    title: str
    lines: list[str]
    col: int = 0
    x: float = 0
    y: float = 0
    w: float = NODE_W
    h: float = PORT_H
    engine: str = ""

    @property
    def cx(self) -> float:
        return self.x + self.w / 2


@dataclass
class Edge:
    source: str
    target: str
    label: str
    path: str = ""
    label_x: float = 0
    label_y: float = 0


@dataclass
class Graph:
    nodes: list[Node]
    edges: list[Edge]
    width: float = 0
    height: float = 0
    columns: list[list[Node]] = field(default_factory=list)


def _short(text: str, limit: int = 28) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def layout(spec: PipelineSpec) -> Graph:
    by_id = {s.id: s for s in spec.stages}
    nodes: dict[str, Node] = {}
    for name, inp in spec.inputs.items():
        nodes[f"input:{name}"] = Node(f"input:{name}", "input", name, [inp.type + ("" if inp.required else ", optional")])

    depth: dict[str, int] = {}

    def stage_col(stage_id: str, seen: tuple[str, ...] = ()) -> int:
        if stage_id in depth:
            return depth[stage_id]
        upstream = [s for s in by_id[stage_id].upstream() if s in by_id and s not in seen]
        depth[stage_id] = 1 + max((stage_col(s, (*seen, stage_id)) for s in upstream), default=0)
        return depth[stage_id]

    for stage in spec.stages:
        engine = {"ar": "AR (vLLM)", "dit": "DiT (diffusers)"}.get(stage.engine, stage.engine)
        nodes[f"stage:{stage.id}"] = Node(
            f"stage:{stage.id}", "stage", stage.id,
            [engine, f"task: {stage.task_name}", _short(f"model: {stage.model}"), f"queue: {stage.queue_name}"],
            col=stage_col(stage.id), h=STAGE_H, engine=stage.engine)
    last_col = max((n.col for n in nodes.values() if n.kind == "stage"), default=0) + 1
    for out in spec.outputs:
        nodes[f"output:{out.name}"] = Node(f"output:{out.name}", "output", out.name, [spec.output_type(out)],
                                           col=last_col)

    edges: list[Edge] = []
    for stage in spec.stages:
        for port, binding in stage.bindings():
            if binding.source == INPUT_SOURCE:
                source = f"input:{binding.port}"
                label = port if port == binding.port else f"{binding.port} → {port}"
            else:
                source = f"stage:{binding.source}"
                modality = by_id[binding.source].outputs.get(binding.port, "")
                label = f"{binding.port} → {port}" + (f" ({modality})" if modality and modality != binding.port else "")
            if source in nodes:
                edges.append(Edge(source, f"stage:{stage.id}", label))
    for out in spec.outputs:
        for binding in out.sources:
            source = f"stage:{binding.source}" if binding.source != INPUT_SOURCE else f"input:{binding.port}"
            if source in nodes:
                edges.append(Edge(source, f"output:{out.name}", binding.port))

    columns: list[list[Node]] = [[] for _ in range(last_col + 1)]
    for node in nodes.values():
        columns[node.col].append(node)
    heights = [sum(n.h for n in col) + ROW_GAP * max(0, len(col) - 1) for col in columns]
    total_h = max(heights, default=0)
    for index, col in enumerate(columns):
        y = MARGIN + (total_h - heights[index]) / 2
        for node in col:
            node.x = MARGIN + index * (NODE_W + COL_GAP)
            node.y = y
            y += node.h + ROW_GAP
    outgoing = _count(e.source for e in edges)
    incoming = _count(e.target for e in edges)
    lanes = 0
    for edge in edges:
        a, b = nodes[edge.source], nodes[edge.target]
        x1, y1 = a.x + a.w, a.y + a.h / 2
        x2, y2 = b.x, b.y + b.h / 2
        if b.col - a.col > 1:  # skips a column: down into a lane under everything, along, and up
            lane = MARGIN + total_h + LANE_GAP * (lanes + 1)
            lanes += 1
            edge.path = (f"M{x1:.1f},{y1:.1f} C{x1 + 40:.1f},{y1:.1f} {x1 + 40:.1f},{lane:.1f} {x1 + 80:.1f},{lane:.1f} "
                         f"L{x2 - 80:.1f},{lane:.1f} C{x2 - 40:.1f},{lane:.1f} {x2 - 40:.1f},{y2:.1f} {x2 - 6:.1f},{y2:.1f}")
            edge.label_x, edge.label_y = (x1 + x2) / 2, lane - 5
            continue
        bend = max(40.0, (x2 - x1) / 2)
        c1x, c2x = x1 + bend, x2 - bend
        edge.path = f"M{x1:.1f},{y1:.1f} C{c1x:.1f},{y1:.1f} {c2x:.1f},{y2:.1f} {x2 - 6:.1f},{y2:.1f}"
        # A fan-out's labels sit near their (distinct) targets, a fan-in's near their sources, so they part.
        fan_out, fan_in = outgoing[edge.source] > 1, incoming[edge.target] > 1
        t = 0.5 if fan_out == fan_in else 0.72 if fan_out else 0.28
        edge.label_x = _bezier(t, x1, c1x, c2x, x2)
        edge.label_y = _bezier(t, y1, y1, y2, y2) - 5
    width = MARGIN * 2 + len(columns) * NODE_W + (len(columns) - 1) * COL_GAP
    height = total_h + MARGIN * 2 + (LANE_GAP * lanes + 6 if lanes else 0)
    return Graph(list(nodes.values()), edges, width=width, height=height, columns=columns)


def _count(items: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def _bezier(t: float, p0: float, p1: float, p2: float, p3: float) -> float:
    u = 1 - t
    return u * u * u * p0 + 3 * u * u * t * p1 + 3 * u * t * t * p2 + t * t * t * p3
