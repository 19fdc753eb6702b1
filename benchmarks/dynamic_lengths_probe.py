"""How many graphs dynamo compiles for one model fed several sequence lengths (GPU): plain
``torch.compile`` (Inductor) against ``backend="protrain"``. Dynamo traces the second length with
dynamic sizes, so two graphs serve every length; a backend whose compile specializes the sizes
makes one graph per length, and past dynamo's recompile limit (8) the frame runs eagerly.

    python benchmarks/dynamic_lengths_probe.py tiny_inductor|tiny_protrain|big_protrain_host \
        [--trace-guards] [--lengths 64,48,56]
    python benchmarks/dynamic_lengths_probe.py tiny_fake_prop

``tiny_*``: the tests' HF Llama (4 layers, width 128, sdpa) on the GPU, lengths 16, 12, 14, 10;
``big_protrain_host``: the Llama-3.2-1B shape built under ``host_init``, a 3 GiB budget, lengths
256, 192, 224. bf16 autocast, ``labels=`` loss, AdamW. Prints ``RESULT <case> graphs: N``; run
with ``TORCH_LOGS=recompiles`` to see why each graph was compiled, and with ``--trace-guards`` to
print, for every guard or specialization dynamo's shape environment records, the stack frames of
this project that asked for it (what turns a symbolic size into a constant). ``tiny_fake_prop``
runs the tiny model through a backend that propagates fake tensors over each dynamic graph with
and without the python dispatcher and prints what each specialized (runs 103: on CUDA, without it,
HF Llama's rotary matmul; nothing on the CPU).
"""

import os
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
for d in ("tests", "examples", "benchmarks"):
    sys.path.insert(0, os.path.join(HERE, "..", d))

import torch._dynamo.utils as du  # noqa: E402
from hf_models import HF_VOCAB, hf_llama  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU to check the probe itself


def trace_guards() -> None:
    """Print this project's frames under every guard and replacement the shape environment adds."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def ours() -> str:
        frames = [
            f"{f.filename}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-2]
            if "protrain_fx" in f.filename or "/passes/" in f.filename
        ]
        return " <- ".join(reversed(frames[-6:])) or "(no protrain frame)"

    log_guard, set_replacement = ShapeEnv._log_guard, ShapeEnv._set_replacement

    def node_run() -> str:
        """The innermost FX node an interpreter is running, and the frames between it and here."""
        frame, below = sys._getframe(2), []
        while frame is not None:
            n = frame.f_locals.get("n") if frame.f_code.co_name == "run_node" else None
            if isinstance(n, torch.fx.Node):
                return f"node {n.format_node()}; under it: " + " <- ".join(below[:40])
            code = frame.f_code
            below.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        return "no node"

    def _log_guard(self, prefix, g, forcing_spec):
        print(f"GUARD {prefix} {g} spec={forcing_spec} at {ours()}", flush=True)
        if "suppressed" not in prefix:
            print(f"  RUNNING {node_run()}", flush=True)
        return log_guard(self, prefix, g, forcing_spec)

    def _set_replacement(self, a, tgt, msg):
        if getattr(tgt, "is_number", False):
            print(f"SPECIALIZE {a} = {tgt} ({msg}) at {ours()}", flush=True)
        return set_replacement(self, a, tgt, msg)

    ShapeEnv._log_guard, ShapeEnv._set_replacement = _log_guard, _set_replacement


def fake_prop_backend(gm, example_inputs):
    """``tiny_fake_prop``'s backend: for a graph with symbolic sizes, run ``FakeTensorProp`` over it
    twice, under the python dispatcher (as dynamo and aot_autograd trace) and without it, and print
    the sizes each run turned into constants and at which node; then run the graph as it is."""
    import contextlib

    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = torch._guards.detect_fake_mode(example_inputs)
    env = mode.shape_env
    if any(isinstance(e, torch.SymInt) for e in example_inputs):
        for dispatcher in (True, False):
            before = dict(env.replacements)

            class Prop(FakeTensorProp):
                def run_node(self, n):
                    k = len(env.replacements)
                    out = super().run_node(n)
                    if len(env.replacements) != k:
                        print(f"SPECIALIZED_AT python_dispatcher={dispatcher}: {n.format_node()}")
                    return out

            fakes = [
                mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs
            ]
            ctx = enable_python_dispatcher() if dispatcher else contextlib.nullcontext()
            mode.allow_non_fake_inputs = True
            with ctx, mode:
                Prop(gm, mode).propagate_dont_convert_inputs(*fakes)
            new = {str(k): str(v) for k, v in env.replacements.items() if k not in before}
            print(f"PROP python_dispatcher={dispatcher} new replacements {new}", flush=True)
    return gm.forward


def main() -> None:
    which = sys.argv[1]
    if "--trace-guards" in sys.argv:
        trace_guards()
    if which.startswith("tiny"):
        model, vocab, lengths = (
            hf_llama(attn_implementation="sdpa").to(DEVICE),
            HF_VOCAB,
            (16, 12, 14, 10),
        )
    else:
        from oom_sweep import MODELS, build

        spec = MODELS["llama3.2-1b"]
        model = build(spec, 256, host=which.endswith("host"))
        vocab, lengths = spec["vocab"], (256, 192, 224)
    if "--lengths" in sys.argv:  # e.g. --lengths 64,48,56: the loop's lengths instead
        lengths = tuple(int(n) for n in sys.argv[sys.argv.index("--lengths") + 1].split(","))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backend = "protrain" if "protrain" in which else "inductor"
    if which.endswith("fake_prop"):
        backend = fake_prop_backend
    options = (
        {"memory_budget": "3GiB"} if backend == "protrain" and which.startswith("big") else None
    )
    compiled = torch.compile(model, backend=backend, options=options)
    for n in lengths:
        x = torch.randint(0, vocab, (2, n), device=DEVICE)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = compiled(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("RESULT", which, "graphs:", du.counters["stats"]["unique_graphs"], flush=True)


if __name__ == "__main__":
    main()
