"""The backend of ``--capture cudagraphs``: a training step's graphs run by torch's eager kernels and replayed as
CUDA graphs (cudagraph trees), with the model's weights and buffers as the graphs' static inputs.

Why not dynamo's own "cudagraphs" backend, which this one follows in all else: it treats every input of a graph
as one to copy into the graph's own memory before each replay, the module's weights and buffers included (their
size, every step: 26 MB for the full-size AttFuse), and it keeps no input mutation in its graphs. So AOTAutograd
returns each buffer a graph updates (a training batch norm's running mean, variance and batch count) and copies
it back after the graph, one ``copy_`` launch per buffer, eagerly: 69 a step in the full-size pillar backbones,
which a replay does not take away (engine/census.ops_outside_graphs counts them).

Here, as inductor's "reduce-overhead" mode does for its own kernels, the inputs dynamo marks static (a module's
parameters and buffers: AOTAutograd's ``static_input_indices``) are read where they live, and a graph's updates
of them stay in the graph (AOTAutograd's ``keep_inference_input_mutations``, which despite its name governs
training graphs too): cudagraph trees allow a replay to write a static input. A weight or buffer that moves
(another tensor, another address) makes the trees record the graph again; the fit loop updates them in place.

On a device without CUDA graphs (the CPU) or for a graph that writes a non-static input, the graph runs on the
eager kernels, as aot_eager's, with one skip logged and counted as the torch backend does
(engine/census.cudagraph_skips). ``reset`` (``torch._dynamo.reset``) drops the trees' graphs and memory pools.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.cudagraphs import (find_input_mutations, get_device_index, get_device_node_mapping,
                                               get_stack_traces)
from torch._dynamo.backends.debugging import boxed_nop
from torch._inductor.cudagraph_utils import (BoxedDeviceIndex, check_multiple_devices_or_any_cpu_nodes,
                                             format_default_skip_message, get_mutation_stack_trace,
                                             get_placeholder_info, log_cudagraph_skip_and_bump_counter)
from torch._inductor.utils import BoxedBool, count_tangents, get_first_incompatible_cudagraph_node, \
    num_fw_fixed_arguments


def static_inputs(dynamo_inputs: int, aot_graph_inputs: int) -> list[int]:
    """The forward graph's inputs that keep their address over the steps: those AOTAutograd lifted itself (its
    fixed arguments) and those dynamo marked static (the modules' parameters and buffers, once modules are
    inlined, as they are by default)."""
    fixed = set(range(num_fw_fixed_arguments(dynamo_inputs, aot_graph_inputs)))
    context = torch._guards.TracingContext.try_get()
    marked = context.fw_metadata.static_input_indices if context is not None and context.fw_metadata else []
    return sorted(fixed | set(marked))


def skip_reason(graph: torch.fx.GraphModule, static: Sequence[int], devices: bool = True) -> Optional[str]:
    """Why a graph cannot be replayed as a CUDA graph (None: it can): it writes an input that is not static, it
    holds a node on the host or on two devices (`devices`: False leaves that out, for a graph traced on the meta
    device, which stands for the GPU in tests), or an op a CUDA graph cannot hold."""
    written = sorted(set(find_input_mutations(graph.graph)) - set(static))
    if written:
        return get_mutation_stack_trace(get_placeholder_info(graph.graph), written)
    where = check_multiple_devices_or_any_cpu_nodes(get_device_node_mapping(graph)) if devices else None
    if where:
        return where
    node = get_first_incompatible_cudagraph_node(graph)
    return format_default_skip_message(f"incompatible op ({node.name})") if node is not None else None


def _replayed(graph: torch.fx.GraphModule, inputs: list, static: Sequence[int], device_index: int,
              is_backward: bool, is_inference: bool) -> Callable:
    from torch._inductor.cudagraph_trees import cudagraphify_impl

    replay = cudagraphify_impl(boxed_nop(graph, inputs), inputs, list(static), device_index=device_index,
                               is_backward=is_backward, is_inference=is_inference,
                               stack_traces=get_stack_traces(graph), placeholders=get_placeholder_info(graph.graph),
                               mutated_input_idxs=find_input_mutations(graph.graph))
    replay._boxed_call = True
    return replay


class StaticWeightsCudagraphs:
    """The dynamo backend (``torch.compile(..., backend=StaticWeightsCudagraphs())``); the module's docstring."""

    compiler_name = "cudagraphs_static_weights"

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        replays = BoxedBool(True)  # whether the forward graph replays: its backward does only if it does
        device = BoxedDeviceIndex(None)

        def forward(aot_graph: torch.fx.GraphModule, aot_inputs: list, is_inference: bool = False) -> Callable:
            static = static_inputs(len(example_inputs), len(aot_inputs))
            reason = skip_reason(aot_graph, static)
            if reason is not None:
                BoxedBool.disable(replays)
                log_cudagraph_skip_and_bump_counter(f"skipping cudagraphs due to {reason}")
                return boxed_nop(aot_graph, aot_inputs)
            device.set(get_device_index(aot_graph))
            return _replayed(aot_graph, aot_inputs, static, device.value, False, is_inference)

        def backward(aot_graph: torch.fx.GraphModule, aot_inputs: list) -> Callable:
            if not replays:
                return aot_graph
            # The backward's inputs before its incoming gradients are the forward's saved tensors, which live in
            # the trees' memory or are the forward's own static inputs: static here.
            static = list(range(count_tangents(aot_graph)))
            reason = skip_reason(aot_graph, static)
            if reason is None:
                return _replayed(aot_graph, aot_inputs, static, get_device_index(aot_graph), True, False)
            log_cudagraph_skip_and_bump_counter(f"skipping cudagraphs due to {reason}")
            return _eager_backward_in_tree(aot_graph, device.value)

        compile_steps = aot_autograd(fw_compiler=forward, bw_compiler=backward,
                                     inference_compiler=functools.partial(forward, is_inference=True),
                                     keep_inference_input_mutations=True)
        return compile_steps(graph, example_inputs)

    @staticmethod
    def reset() -> None:
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()


def _eager_backward_in_tree(graph: torch.fx.GraphModule, device_index: Optional[int]) -> Callable:
    """A backward that cannot replay after a forward that does: run eagerly, with the trees told that the
    forward's generation is over (their outputs may be read), as torch's backend does."""
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(0 if device_index is None else device_index, create_if_none_exists=False)
    if manager is None:
        raise RuntimeError("a CUDA-graph forward without its trees' manager: torch's cudagraph trees changed")

    def run(inputs: list) -> Any:
        manager.set_to_running_backward()
        return graph(inputs)

    run._boxed_call = True
    return run


__all__ = ["StaticWeightsCudagraphs", "skip_reason", "static_inputs"]
