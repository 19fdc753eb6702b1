"""Graph dumps: with ``dump_dir`` (or env ``PROTRAIN_DUMP_DIR``) every compiled graph gets one
folder

    <dump_dir>/graph_<NNN>/
        dynamo.py         the dynamo graph as protrain received it
        joint.py          the joint forward+backward graph after protrain's joint passes
        fw.py, bw.py      forward and backward graphs after protrain's passes, before Inductor
        inference.py      (inference-only graphs) the graph after protrain's passes
        passes/           the graph after each pass: <stage>_<NN>_<pass>.py
        (protrain_fx/pipeline.py) plan.json         Plan.to_dict() annotations.tsv   one row per
        node of each stage: phase, block and its activation policy, whether the
                          partitioner must recompute it, chunk, parameter, output bytes, profile
                          columns

The code is snapshotted when the stage is handed to Inductor, which later mutates the same graph
objects. Every artifact also goes to torch's structured trace (``TORCH_TRACE=/tmp/trace``), where
tlparse shows it.
"""

from __future__ import annotations

import itertools
import json
import os

import torch
import torch.fx as fx

from protrain_fx import _compat
from protrain_fx.graph.annotation import annotation_of
from protrain_fx.plan.plan import Plan

_GRAPH_SEQ = itertools.count()

TSV_COLUMNS = (
    "stage",
    "node",
    "op",
    "target",
    "phase",
    "region",
    "block",
    "policy",
    "recompute",
    "chunk",
    "param",
    "out_bytes",
    "time_us",
    "mem_delta_bytes",
    "peak_bytes",
)


def _out_bytes(node: fx.Node) -> str:
    val = node.meta.get("val", node.meta.get("example_value"))
    vals = val if isinstance(val, (list, tuple)) else [val]
    total = 0
    for v in vals:
        if isinstance(v, torch.Tensor):
            n = v.numel()
            # symbolic sizes: int() would specialize the graph to one shape
            if not isinstance(n, int):
                return "symbolic"
            total += n * v.element_size()
    return str(total)


def graph_code(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=True)


class GraphDump:
    """Writes one compiled graph's artifacts; a no-op folder-wise when no dump_dir is set (the
    structured trace still gets them when tracing is on)."""

    def __init__(self, dump_dir: str | None, plan: Plan):
        self.name = f"graph_{next(_GRAPH_SEQ):03d}"
        self.plan = plan
        self.folder = os.path.join(dump_dir, self.name) if dump_dir else None
        self.rows: dict[str, list[tuple]] = {}
        if self.folder:
            os.makedirs(self.folder, exist_ok=True)

    def _write(self, filename: str, text: str) -> None:
        if self.folder:
            with open(os.path.join(self.folder, filename), "w") as f:
                f.write(text)

    def pass_step(self, stage: str, index: int, name: str, gm: fx.GraphModule) -> None:
        """The graph right after one pass (``passes/<stage>_<NN>_<pass>.py``), when dumping."""
        if self.folder is not None:
            os.makedirs(os.path.join(self.folder, "passes"), exist_ok=True)
            self._write(os.path.join("passes", f"{stage}_{index:02d}_{name}.py"), graph_code(gm))

    def stage(self, stage: str, gm: fx.GraphModule) -> None:
        """Snapshot one stage's graph (code + annotation rows)."""
        header = f"# protrain-fx {self.name} ({self.plan.graph_name}): stage {stage!r}\n"
        code = header + graph_code(gm)
        self._write(f"{stage}.py", code)
        _compat.trace_artifact(f"protrain_{stage}", "string", lambda: code)
        self.rows[stage] = [self._row(stage, n) for n in gm.graph.nodes]
        self.write_annotations()

    def _row(self, stage: str, node: fx.Node) -> tuple:
        ann = annotation_of(node)
        target = (
            node.target
            if isinstance(node.target, str)
            else getattr(node.target, "__name__", str(node.target))
        )
        prof = node.meta.get("protrain_profile") or {}
        policy = ""
        if ann is not None and ann.phase:
            policy = (
                self.plan.blocks[ann.block].policy
                if ann.block is not None and ann.block < len(self.plan.blocks)
                else "keep"
            )
        recompute = "must" if str(node.meta.get("recompute", "")).endswith("MUST_RECOMPUTE") else ""
        return (
            stage,
            node.name,
            node.op,
            str(target),
            ann.phase if ann else "",
            ann.region if ann else "",
            ann.block_name or "" if ann else "",
            policy,
            recompute,
            "" if ann is None or ann.chunk is None else str(ann.chunk),
            ann.param or "" if ann else "",
            _out_bytes(node),
            *(
                str(prof[k]) if k in prof else ""
                for k in ("time_us", "mem_delta_bytes", "peak_bytes")
            ),
        )

    def write_annotations(self) -> None:
        if not self.folder:
            return
        lines = ["\t".join(TSV_COLUMNS)]
        for rows in self.rows.values():
            lines += ["\t".join(r) for r in rows]
        self._write("annotations.tsv", "\n".join(lines) + "\n")

    def write_plan(self) -> None:
        text = json.dumps(self.plan.to_dict(), indent=2)
        self._write("plan.json", text + "\n")
        _compat.trace_artifact("protrain_plan", "json", lambda: text)
