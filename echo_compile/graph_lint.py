"""Checks that a compiled step would be CUDA-graph safe, usable without a GPU (CPU CI).

Both checks use private torch APIs (docs/graph_notes.md); they are pinned here, in one helper:
- no node that disables CUDA graphs (``.item()``, ``nonzero``, boolean indexing, data-dependent
  shapes, ops tagged cudagraph-unsafe): ``get_first_incompatible_cudagraph_node``;
- every graph input the step mutates is static (a parameter, a buffer or a
  ``mark_static_address`` tensor), so cudagraph trees would not skip the graph for "mutated inputs".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LintReport:
    graphs: int = 0
    incompatible_nodes: list[str] = field(default_factory=list)
    mutated_inputs: int = 0
    mutated_non_static: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.graphs > 0 and not self.incompatible_nodes and not self.mutated_non_static


def lint_backend(report: LintReport):
    """A Dynamo backend that records the report and runs the graph eagerly."""
    from torch._dynamo.utils import get_static_address_type
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    def backend(gm: torch.fx.GraphModule, example_inputs):
        def fw(g: torch.fx.GraphModule, _fake_inputs):
            report.graphs += 1
            bad = get_first_incompatible_cudagraph_node(g)
            if bad is not None:
                report.incompatible_nodes.append(f"{bad.op} {bad.target}")
            placeholders = [n for n in g.graph.nodes if n.op == "placeholder"]
            for n in g.graph.nodes:
                if n.op == "call_function" and n.target is torch.ops.aten.copy_.default:
                    dst = n.args[0]
                    if dst.op == "placeholder":
                        report.mutated_inputs += 1
                        i = placeholders.index(dst)
                        # fw's inputs are fake tensors; the backend's example inputs are the real
                        # ones, in the same order (inference graph: no lifted parameters)
                        if get_static_address_type(example_inputs[i]) is None:
                            report.mutated_non_static.append(dst.name)
            return g

        return aot_module_simplified(
            gm, example_inputs, fw_compiler=fw, keep_inference_input_mutations=True
        )

    return backend
