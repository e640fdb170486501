"""Where a run's compile seconds go: dynamo, AOTAutograd, inductor, the C++ compiler.

Runs the recipe in this process (``ppo_full_finetune.recipe_main``, as ``tune run`` does) with
the config and overrides given, then prints torch's own compile timers
(``torch._dynamo.utils.compilation_time_metrics``), summed over every compiled graph of the run.
The timers nest (dynamo's compile holds the backend's, AOTAutograd's holds inductor's), so
dynamo's and AOTAutograd's own seconds are their timer less the one they hold:

    dynamo        _compile.compile_inner - OutputGraph.call_user_compiler (bytecode tracing,
                  guards; bytecode_tracing alone is printed too)
    aotautograd   create_aot_dispatcher_function - inductor's forward and backward compiles
    inductor      compile_fx's fw_compiler_base + bw_compiler, the C++ builds it waits for included
    c++ compiler  compile_file summed over every kernel build (gcc); builds run in compile
                  workers beside inductor, so this sum is not a part of inductor's line

Run it with a new ``TORCHINDUCTOR_CACHE_DIR`` for a cold start, then again with the same folder
for a warm one:

    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    python benchmarks/bounds/compile_breakdown.py --config recipes/configs/smollm2/135M_ppo_arithmetic.yaml \
        num_ppo_steps=1 eval.every_n_steps=null eval.before_training=False output_dir=/tmp/cb1
    python benchmarks/bounds/compile_breakdown.py ... output_dir=/tmp/cb2      # warm
"""

import sys
import time
from typing import Dict, List

TIMERS = ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler",
          "create_aot_dispatcher_function", "compile_fx.<locals>.fw_compiler_base",
          "compile_fx.<locals>.bw_compiler", "compile_file", "async_compile.wait")


def totals() -> Dict[str, float]:
    """Each timer's seconds, summed over its calls."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: float(sum(compilation_time_metrics.get(name, []))) for name in TIMERS}


def stages(t: Dict[str, float]) -> Dict[str, float]:
    """Each stage's own seconds (see the module's docstring)."""
    inductor = t["compile_fx.<locals>.fw_compiler_base"] + t["compile_fx.<locals>.bw_compiler"]
    return {
        "dynamo": t["_compile.compile_inner"] - t["OutputGraph.call_user_compiler"],
        "  of which bytecode tracing": t["bytecode_tracing"],
        "aotautograd": t["create_aot_dispatcher_function"] - inductor,
        "inductor": inductor,
        "c++ compiler (summed builds)": t["compile_file"],
        "all compiling": t["_compile.compile_inner"],
    }


def main(argv: List[str]) -> int:
    import ppo_full_finetune

    sys.argv = ["tune", *argv]
    start = time.perf_counter()
    try:
        ppo_full_finetune.recipe_main()  # torchtune's config.parse ends it with sys.exit
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    wall = time.perf_counter() - start
    print(f"\nwhole run {wall:.1f} s; compiling, by stage (s):")
    for name, seconds in stages(totals()).items():
        print(f"  {name:<28} {seconds:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
