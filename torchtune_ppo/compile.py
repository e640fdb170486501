"""The one place that decides how hot regions are compiled, at the top of a run.

:func:`regions` returns every region's callable for a run, compiled or eager, with its mode and
fullgraph decided here from the config's ``compile:`` block, and the recipe hands them down:
the generator gets its prefill and decode step (:func:`generation_steps`), the rollout its
scoring region, the update its loss step. Nothing below imports this module. Every compiled
region is a plain function wrapped by :func:`maybe_compile`. No process-wide dynamo or inductor
setting is changed: ``dynamic=False`` already keeps shapes static (a new shape is a new static
graph, never a symbolic one) and specializes Python floats such as the temperature, so a user's
own ``torch.compile`` calls see the defaults they expect. The only other dynamo feature used,
skipping guard evaluation inside the decode loop, is scoped to the loop
(:func:`torchtune_ppo._patches.dynamo.skip_guard_checks`, entered by the generator when its
steps are compiled).

For tests only, the environment variable ``TORCHTUNE_PPO_COMPILE_BACKEND`` (``eager`` or
``aot_eager``; unset: inductor) swaps the backend every region is compiled with
(:func:`compile_backend`). Dynamo traces and guards each region exactly as with inductor, and
guards are what decide recompiles, so a test can count a real model's recompiles without
inductor's code generation (about 400 s a region for SmolLM2's 30 unrolled layers on 2 cores).
"""

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional, TypeVar, Union

import torch
from torchtune import utils

from torchtune_ppo._patches import dynamo as dynamo_patches
from torchtune_ppo._patches.torchtune_modules import LayerSteps, use_layer_steps
from torchtune_ppo.ppo.loss_step import packed_ppo_loss_step
from torchtune_ppo.rollout.fused import fused_rollout
from torchtune_ppo.rollout.generation import (GenerationSteps, extend, generate_next_token, prefill, prefill_group,
                                              prefill_prefix)
from torchtune_ppo.rollout.scoring import packed_score_trajectory
from torchtune_ppo.rollout.speculative import verify, verify_one
from torchtune_ppo.run.optim import MasterStep, adam_master_step, grad_sq_sum

F = TypeVar("F", bound=Callable)

# CUDA graphs replay on the decode step only; the prefill, run once per batch, goes without.
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
_NO_CUDAGRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


BACKEND_ENV = "TORCHTUNE_PPO_COMPILE_BACKEND"
TEST_BACKENDS = ("eager", "aot_eager")


def compile_backend() -> Optional[str]:
    """The backend ``TORCHTUNE_PPO_COMPILE_BACKEND`` asks for (tests only), or None: inductor.

    Raises:
        ValueError: if the variable is set to anything but ``eager`` or ``aot_eager``.
    """
    value = os.environ.get(BACKEND_ENV)
    if value is None or value == "":
        return None
    if value not in TEST_BACKENDS:
        raise ValueError(
            f"{BACKEND_ENV}={value!r} is not a test backend; valid: {list(TEST_BACKENDS)}, or "
            "unset it to compile with inductor."
        )
    return value


def maybe_compile(
    fn: F, *, enabled: bool, mode: str = "default", fullgraph: bool = True, dynamic: bool = False,
    around_layers: bool = False,
) -> F:
    """``torch.compile(fn)`` with static shapes when ``enabled`` (``dynamic``: symbolic sizes,
    for an elementwise region called on tensors of many shapes), else ``fn`` itself (the eager
    twin). ``around_layers``: a region with ``compile.layers``, whose graph breaks around each
    trunk it calls, compiled with ``fullgraph=False`` and nested graph breaks
    (:func:`~torchtune_ppo._patches.dynamo.with_nested_graph_breaks`)."""
    if not enabled:
        return fn
    kwargs = {"fullgraph": fullgraph and not around_layers, "dynamic": dynamic}
    backend = compile_backend()
    if backend is not None:
        kwargs["backend"] = backend  # modes are inductor's: a test backend runs without one
    elif mode != "default":
        kwargs["mode"] = mode
    elif dynamic:
        # with a symbolic size inductor's CPU code cannot tell the work's size and runs the
        # loop on one thread: one OpenMP scope, sized at run time (SmolLM2's optimizer step:
        # 13 GB/s on one of two cores; benchmarks/RESULTS.md, "bf16 on AMX")
        kwargs["options"] = {"cpp.dynamic_threads": True}
    compiled = torch.compile(fn, **kwargs)
    return dynamo_patches.with_nested_graph_breaks(compiled) if around_layers else compiled


class Regions(NamedTuple):
    """The compiled (or eager) callables of a run, from :func:`regions`.

    Attributes:
        generation (GenerationSteps): the generator's prefill and decode step, compiled with
            ``compile.generate`` in ``compile.mode`` (:func:`generation_steps`).
        score (Callable): steps 2-6 on packed rows,
            :func:`~torchtune_ppo.rollout.scoring.packed_score_trajectory`.
        fused_rollout (Optional[Callable]): steps 1-6 as one region
            (:func:`~torchtune_ppo.rollout.fused.fused_rollout`) with ``compile.rollout``, else None.
        loss_step (Callable): :func:`~torchtune_ppo.ppo.loss_step.packed_ppo_loss_step`.
        loss_step_fixed_shapes (bool): the loss step takes micro-steps of fixed shapes. Under
            FSDP (several processes) its compiled graph breaks at each sharded module's hooks,
            and the frames between them would specialise any dynamic size.
        whole_scoring_models (bool): the scoring runs as one graph, which cannot cross FSDP's
            hooks: sharded scoring models are gathered whole around it.
        master_step (Optional[MasterStep]): with ``compile.optimizer``, bf16 master weights' Adam
            step of one parameter in one pass (:func:`~torchtune_ppo.run.optim.adam_master_step`)
            and its gradient's sum of squares, compiled with symbolic sizes (one graph each for
            every parameter shape); None: the eager optimizer path.
        layers (Optional[LayerSteps]): with ``compile.layers``, one transformer layer compiled
            per use (:func:`layer_steps`), for :func:`use_layers` to hand to the models; None:
            each region unrolls every layer of every model it calls into its own graph.
    """

    generation: GenerationSteps
    score: Callable
    fused_rollout: Optional[Callable]
    loss_step: Callable
    loss_step_fixed_shapes: bool
    whole_scoring_models: bool
    master_step: Optional[MasterStep] = None
    layers: Optional[LayerSteps] = None


def regions(compile_cfg: Any, *, world_size: int = 1, device: Optional[torch.device] = None) -> Regions:
    """Every region's callable for a run, from the parsed ``compile:`` block.

    Args:
        compile_cfg (CompileConfig): ``generate``, ``trajectory``, ``loss_step``, ``rollout``,
            ``optimizer``, ``mode`` (:func:`torchtune_ppo.config.parse_compile`).
        world_size (int): processes of the run. Under FSDP (> 1) the loss step compiles with
            ``fullgraph=False``: its forward and backward need FSDP2's hooks, which dynamo
            cannot trace, so the graph breaks at each sharded module; its micro-steps then have
            fixed shapes. ``compile.layers`` is for one process (the config checks turn it off
            on several).
        device (Optional[torch.device]): where generation runs (CUDA graphs need CUDA); None: CPU.

    Returns:
        Regions: compiled regions where the block says so, eager twins elsewhere.
    """
    compile_backend()  # a bad test backend is refused before any weights load
    _log.info(f"Compiled regions: {compile_cfg}")
    fused = compile_cfg.rollout
    if fused and (compile_cfg.generate or compile_cfg.trajectory):
        warnings.warn("compile.rollout compiles steps 1-6 as one region; compile.generate and "
                      "compile.trajectory are unused.")
    layers = getattr(compile_cfg, "layers", False) and world_size == 1 and not fused
    # With compiled layers each region's graph breaks around each trunk it runs; everything
    # else in it stays compiled.
    return Regions(
        generation=generation_steps(compiled=compile_cfg.generate and not fused, mode=compile_cfg.mode,
                                    device=device or torch.device("cpu"), around_layers=layers),
        score=maybe_compile(packed_score_trajectory, enabled=compile_cfg.trajectory and not fused,
                            around_layers=layers),
        fused_rollout=maybe_compile(fused_rollout, enabled=True) if fused else None,
        loss_step=maybe_compile(packed_ppo_loss_step, enabled=compile_cfg.loss_step,
                                fullgraph=world_size == 1, around_layers=layers),
        loss_step_fixed_shapes=world_size > 1,
        whole_scoring_models=compile_cfg.trajectory or fused,
        master_step=MasterStep(step=maybe_compile(adam_master_step, enabled=True, dynamic=True),
                               sq_sum=maybe_compile(grad_sq_sum, enabled=True, dynamic=True))
        if getattr(compile_cfg, "optimizer", False) else None,
        layers=layer_steps(generate=compile_cfg.generate, trajectory=compile_cfg.trajectory,
                           loss_step=compile_cfg.loss_step, mode=without_cudagraphs(compile_cfg.mode))
        if layers else None,
    )


# One body, four functions: each use of a layer keeps its own graphs, guards and recompile
# limit (dynamo's cache lives on the code object), so no use ever evicts or recompiles another.
def _layer_decode(layer: torch.nn.Module, h: torch.Tensor, mask: Any, input_pos: torch.Tensor) -> torch.Tensor:
    return layer(h, mask=mask, input_pos=input_pos)


def _layer_prefill(layer: torch.nn.Module, h: torch.Tensor, mask: Any, input_pos: torch.Tensor) -> torch.Tensor:
    return layer(h, mask=mask, input_pos=input_pos)


def _layer_infer(layer: torch.nn.Module, h: torch.Tensor, mask: Any, input_pos: torch.Tensor) -> torch.Tensor:
    return layer(h, mask=mask, input_pos=input_pos)


def _layer_train(layer: torch.nn.Module, h: torch.Tensor, mask: Any, input_pos: torch.Tensor) -> torch.Tensor:
    return layer(h, mask=mask, input_pos=input_pos)


def layer_steps(*, generate: bool = True, trajectory: bool = True, loss_step: bool = True,
                mode: str = "default") -> LayerSteps:
    """One transformer layer's call compiled once per use: the decode step and the prefill (and
    multi-turn extend) with ``generate``, inference without grad (scoring) with ``trajectory``,
    training with ``loss_step``; None for the uses of regions left eager. The layer is an
    argument whose parameters dynamo reads as inputs, so one graph serves every layer of every
    model of the same shapes (a family's policy, reference, value and reward trunks);
    :func:`~torchtune_ppo._patches.torchtune_modules.final_hidden_states` runs a trunk through
    these in a Python loop, between the calling region's graphs.
    """
    on = (generate, generate, trajectory, loss_step)
    fns = (_layer_decode, _layer_prefill, _layer_infer, _layer_train)
    return LayerSteps(*(maybe_compile(fn, enabled=True, mode=mode) if enabled else None
                        for fn, enabled in zip(fns, on)))


def use_layers(models: Any, steps: Optional[LayerSteps]) -> None:
    """Hands ``steps`` (``Regions.layers``) to every model a compiled region may call (a run's
    :class:`~torchtune_ppo.models.build.Models`, or any iterable of models); None takes them back."""
    if hasattr(models, "ref_policy"):
        models = (models.policy, models.ref_policy, models.value, models.reward)
    for model in models:
        if model is not None:
            use_layer_steps(model, steps)


def generation_steps(*, compiled: bool, mode: str = "default",
                     device: torch.device = torch.device("cpu"), around_layers: bool = False) -> GenerationSteps:
    """The generator's prefill (one per row, or one per group) and decode step, compiled in
    ``mode`` or eager.

    CUDA graphs (``"reduce-overhead"``, ``"max-autotune"``) apply to the decode step only, and
    only on CUDA; the prefills, run once per batch, are compiled without them.
    """
    cudagraphs = compiled and mode in CUDAGRAPH_MODES and device.type == "cuda"
    if compiled and mode in CUDAGRAPH_MODES and not cudagraphs:
        warnings.warn(f"compile_mode={mode!r} uses CUDA graphs, which need a CUDA device; on "
                      f"{device.type} the steps run without them.")
    prefill_mode = without_cudagraphs(mode)
    return GenerationSteps(
        prefill=maybe_compile(prefill, enabled=compiled, mode=prefill_mode, around_layers=around_layers),
        prefill_group=maybe_compile(prefill_group, enabled=compiled, mode=prefill_mode, around_layers=around_layers),
        decode=maybe_compile(generate_next_token, enabled=compiled, mode=mode, around_layers=around_layers),
        compiled=compiled,
        cudagraphs=cudagraphs,
        extend=maybe_compile(extend, enabled=compiled, mode=prefill_mode, around_layers=around_layers),
        verify=maybe_compile(verify, enabled=compiled, mode=prefill_mode, around_layers=around_layers),
        verify_one=maybe_compile(verify_one, enabled=compiled, mode=prefill_mode, around_layers=around_layers),
        prefix=maybe_compile(prefill_prefix, enabled=compiled, mode=prefill_mode, around_layers=around_layers),
    )


def without_cudagraphs(mode: str) -> str:
    """The compile mode to use for a region that should not capture CUDA graphs."""
    return _NO_CUDAGRAPHS.get(mode, mode)


def compile_count() -> int:
    """Graphs dynamo has compiled in this process so far (first compiles and recompiles)."""
    return dynamo_patches.unique_graphs()


_log = utils.get_logger("INFO")

CACHE_FILE = "compile_cache.bin"


class CompileCache:
    """The compiled regions' inductor and AOTAutograd artifacts of a run, in one file.

    torch keeps both caches on disk (``TORCHINDUCTOR_CACHE_DIR``, by default
    ``/tmp/torchinductor_<user>``), so a second run on the same machine only traces its regions
    again. A run on a fresh machine (a resume after its node was lost, a copied output folder)
    starts with empty caches and compiles everything again. This file carries the artifacts
    with the run: :meth:`save` writes them after the first step (the first step compiles every
    region; rank 0 writes), and a run that finds the file at start reads it into torch's caches
    (:meth:`load`, every rank) before anything compiles. The entries are keyed by the graph, the
    torch version and the inductor settings, so a file from another config or torch version is
    read harmlessly and simply not used; an unreadable file is reported and the regions compile.

    Args:
        path (Optional[Path]): the file, or None: off.
        rank_zero (bool): this process writes the file.
    """

    def __init__(self, path: Optional[Path], *, rank_zero: bool = True) -> None:
        self.path, self._rank_zero = path, rank_zero
        self.loaded = 0  # entries read from the file

    @classmethod
    def from_config(cls, cfg: Any, *, rank_zero: bool = True) -> "CompileCache":
        """``compile_cache``: true (``<output_dir>/compile_cache.bin``), false, or a file path;
        off when no region is compiled or a test backend is in use (no inductor artifacts)."""
        setting: Union[bool, str] = cfg.get("compile_cache", True)
        compiled = cfg.get("compile", False)
        compiled = compiled if isinstance(compiled, bool) else any(
            bool(compiled.get(k, False)) for k in ("generate", "trajectory", "loss_step", "rollout"))
        if setting is False or not compiled or compile_backend() is not None:
            return cls(None)
        path = Path(cfg.output_dir) / CACHE_FILE if setting is True else Path(str(setting)).expanduser()
        return cls(path, rank_zero=rank_zero)

    def load(self) -> int:
        """Reads the file into torch's caches, if there is one; returns the entries read."""
        if self.path is None or not self.path.is_file():
            return 0
        try:  # a damaged or foreign file costs a compile, never the run
            info, why = torch.compiler.load_cache_artifacts(self.path.read_bytes()), "torch's reason above"
        except Exception as e:
            info, why = None, f"{type(e).__name__}: {e}"
        if info is None:
            _log.warning(f"Compile cache {self.path} could not be read ({why}); the regions compile "
                         "from scratch and the file is replaced after the first step.")
            return 0
        self.loaded = sum(len(v) for v in info.artifacts.values())
        _log.info(f"Compile cache: {self.loaded} compiled artifacts read from {self.path}.")
        return self.loaded

    def save(self) -> Optional[Path]:
        """Writes every artifact this process compiled or read (rank 0; atomically), and logs
        how many of the regions' inductor graphs came from a cache."""
        if self.path is None or not self._rank_zero:
            return None
        hits, misses = dynamo_patches.fx_graph_cache_counts()
        _log.info(f"Compile cache: {hits} of {hits + misses} inductor graphs read from a cache, "
                  f"{misses} compiled.")
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return None
        data, info = saved
        entries = sum(len(v) for v in info.artifacts.values())
        if entries <= self.loaded and self.path.is_file():
            return None  # nothing new since the file was read
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)
        _log.info(f"Compile cache: {entries} compiled artifacts ({len(data) / 2**20:.1f} MiB) saved to "
                  f"{self.path}; a run that starts with this file skips inductor's compile.")
        return self.path


class RecompileCounter:
    """Counts compilations after a warm-up mark: ``counter.mark()`` then ``counter.since_mark``.

    Graphs compiled inside ``with counter.excluded():`` are left out: a region run for the first
    time after the mark (the first evaluation of a run that does not evaluate before training)
    compiles its graphs then, which is its warm-up, not a recompile.

    Args:
        cache (Optional[CompileCache]): read now, before any region compiles, and saved at the
            mark, when the first step has compiled every region.
    """

    def __init__(self, cache: Optional[CompileCache] = None) -> None:
        self._mark = None
        self._excluded = 0
        self._cache = cache
        if cache is not None:
            cache.load()

    @classmethod
    def for_run(cls, cfg: Any, rank_zero: bool = True) -> "RecompileCounter":
        """The run's counter, with its ``compile_cache`` (:meth:`CompileCache.from_config`)."""
        return cls(CompileCache.from_config(cfg, rank_zero=rank_zero))

    def mark(self) -> None:
        self._mark = compile_count()
        if self._cache is not None:
            self._cache.save()

    @property
    def marked(self) -> bool:
        return self._mark is not None

    @property
    def since_mark(self) -> int:
        return 0 if self._mark is None else compile_count() - self._mark - self._excluded

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """The graphs compiled inside the block do not count in ``since_mark``."""
        start = compile_count()
        try:
            yield
        finally:
            if self._mark is not None:  # before the mark, nothing counts anyway
                self._excluded += compile_count() - start
